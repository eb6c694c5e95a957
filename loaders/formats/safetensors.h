// safetensors files: read through mmap with the header fully validated before
// any tensor is touched, and written (for demo bundles and tests).
// Layout: u64 little-endian header length N, N bytes of JSON header
// {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
//  "__metadata__": {str: str}}, then the data region; offsets are relative to
// the data region, must not overlap and must cover it exactly.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "loaders/base/mapped_file.h"

namespace nanreplay {

enum class DType { kF32, kF16, kBF16, kF64, kI64, kI32, kU8 };

const char* dtype_name(DType dtype);  // "F32", ...
size_t dtype_size(DType dtype);

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets within the data region
  uint64_t end = 0;
  // Points into the mapping. Not necessarily aligned for the dtype (headers
  // need not be padded), so read through memcpy.
  const uint8_t* data = nullptr;

  int64_t numel() const;
  uint64_t nbytes() const { return end - begin; }
};

class SafetensorsFile {
 public:
  // Maps and validates `path`; `label` names the file in errors.
  // Rejects: file shorter than 8 bytes, header length beyond the file or over
  // 100 MiB, invalid JSON, unknown dtype, negative or overflowing shapes,
  // offsets out of range / overlapping / not covering the data region,
  // byte span disagreeing with shape * dtype size.
  static SafetensorsFile open(const std::string& path, const std::string& label);

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(const std::string& name) const;
  // Throws InputError(label, name, "missing tensor") when absent.
  const TensorInfo& at(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& label() const { return map_.label(); }
  // Drops `info`'s pages from resident memory once a pass is done with them
  // (MappedFile::release_pages); its data stays readable.
  void release(const TensorInfo& info) const;

 private:
  MappedFile map_;
  std::vector<TensorInfo> tensors_;  // sorted by name
  std::map<std::string, std::string> metadata_;
};

// Validates a raw safetensors byte buffer (header + data) without a file;
// used by the file reader and the fuzz targets.
std::vector<TensorInfo> parse_safetensors_buffer(const uint8_t* bytes, size_t size,
                                                 const std::string& label,
                                                 std::map<std::string, std::string>* metadata);

// Collects tensors and writes a standard safetensors file (header padded with
// spaces to a multiple of 8 bytes so data is aligned).
class SafetensorsWriter {
 public:
  void add(const std::string& name, DType dtype, std::vector<int64_t> shape,
           const void* data, size_t nbytes);
  void set_metadata(const std::string& key, const std::string& value);
  // Writes to `path` (via a temporary name and rename). Throws std::runtime_error on I/O failure.
  void write(const std::string& path) const;

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
  };
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace nanreplay
