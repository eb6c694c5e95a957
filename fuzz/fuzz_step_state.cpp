// libFuzzer target for parse_step_state (loaders/bundle/step_state.cpp), which reads
// steps/<step>/state.json. Key constraint: every input ends in a StepState or
// an InputError; any other exception or sanitizer report is a bug.
#include <cstddef>
#include <cstdint>
#include <string>

#include "loaders/base/error.h"
#include "loaders/bundle/step_state.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const nanreplay::StepState state = nanreplay::parse_step_state(text, "steps/100/state.json");
    if (state.step < 0) __builtin_trap();  // refused by the parser, never returned
  } catch (const nanreplay::InputError&) {
    // The documented outcome for bad input.
  }
  return 0;
}
