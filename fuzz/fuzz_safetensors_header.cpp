// libFuzzer target for parse_safetensors_buffer (loaders/formats/safetensors.cpp):
// the length prefix, the JSON header and every tensor's dtype, shape and
// offsets. Key constraint: an accepted file's tensors must lie inside the
// buffer and tile its data region; the target touches the first and last byte
// of each so AddressSanitizer catches any span the parser let past.
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "loaders/base/error.h"
#include "loaders/formats/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::map<std::string, std::string> metadata;
  try {
    const std::vector<nanreplay::TensorInfo> tensors =
        nanreplay::parse_safetensors_buffer(data, size, "steps/100/model.safetensors", &metadata);
    volatile uint8_t sink = 0;
    uint64_t covered = 0;
    for (const nanreplay::TensorInfo& tensor : tensors) {
      const uint64_t expected =
          static_cast<uint64_t>(tensor.numel()) * nanreplay::dtype_size(tensor.dtype);
      if (expected != tensor.nbytes() || tensor.data < data || tensor.data > data + size) {
        __builtin_trap();
      }
      if (tensor.nbytes() > 0) {
        sink = sink + tensor.data[0];
        sink = sink + tensor.data[tensor.nbytes() - 1];
      }
      covered += tensor.nbytes();
    }
    if (covered > size) __builtin_trap();
    (void)sink;
  } catch (const nanreplay::InputError&) {
    // The documented outcome for bad input.
  }
  return 0;
}
