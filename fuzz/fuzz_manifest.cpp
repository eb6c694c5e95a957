// libFuzzer target for parse_manifest (loaders/bundle/manifest.cpp), the first thing
// nanreplay reads from an untrusted bundle. Key constraint: every input must
// end in a Manifest or an InputError; any other exception, crash, sanitizer
// report or hang is a bug (the exception escapes and libFuzzer reports it).
#include <cstddef>
#include <cstdint>
#include <string>

#include "loaders/base/error.h"
#include "loaders/bundle/manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const nanreplay::Manifest manifest = nanreplay::parse_manifest(text, "manifest.json");
    // What later stages trust about a parsed manifest.
    // hidden_size splits into heads unless an explicit head_dim (Qwen3, Gemma) sets the heads' width.
    const nanreplay::ModelConfig& m = manifest.model;
    if (manifest.steps.empty() || manifest.data.shards.empty() || m.num_heads <= 0 ||
        (m.explicit_head_dim == 0 && m.hidden_size % m.num_heads != 0)) {
      __builtin_trap();
    }
  } catch (const nanreplay::InputError&) {
    // The documented outcome for bad input.
  }
  return 0;
}
