// safetensors reading (mmap, header validated in full before any tensor byte
// is trusted) and writing (header space-padded to 8 bytes, temp file + rename).
// Key constraint: a hostile header must end in an InputError naming the tensor
// or byte at fault; all size arithmetic is overflow-checked, offsets must tile
// the data region exactly (no overlap, no gap), as the reference reader demands.
#include "loaders/formats/safetensors.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <stdexcept>
#include <system_error>

#include <nlohmann/json.hpp>

#include "loaders/base/error.h"
#include "loaders/base/json_util.h"
#include "loaders/base/message_text.h"

namespace nanreplay {
namespace {

constexpr uint64_t kLengthPrefixBytes = 8;
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // the reference implementation's limit
constexpr const char* kMetadataKey = "__metadata__";

struct DTypeEntry {
  DType dtype;
  const char* name;
  size_t size;
};

constexpr DTypeEntry kDTypes[] = {
    {DType::kF32, "F32", 4}, {DType::kF16, "F16", 2}, {DType::kBF16, "BF16", 2},
    {DType::kF64, "F64", 8}, {DType::kI64, "I64", 8}, {DType::kI32, "I32", 4},
    {DType::kU8, "U8", 1},
};

std::optional<DType> dtype_from_name(const std::string& name) {
  for (const DTypeEntry& entry : kDTypes) {
    if (name == entry.name) return entry.dtype;
  }
  return std::nullopt;
}

uint64_t read_u64_le(const uint8_t* bytes) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | bytes[i];
  return value;
}

std::string span_text(uint64_t begin, uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
}

// Where one tensor's header entry is being checked, for error messages.
struct EntryContext {
  const std::string& label;
  const std::string& name;
  uint64_t data_region_bytes;

  [[noreturn]] void fail(const std::string& what) const { throw InputError(label, name, what); }
};

// A JSON integer in [0, 2^64) (offsets) or [0, 2^63) (dims), else nullopt.
std::optional<uint64_t> non_negative(const nlohmann::json& value) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer() && value.get<int64_t>() >= 0) {
    return static_cast<uint64_t>(value.get<int64_t>());
  }
  return std::nullopt;
}

DType parse_dtype(const nlohmann::json& entry, const EntryContext& context) {
  const auto it = entry.find("dtype");
  if (it == entry.end()) context.fail("dtype: required key is missing");
  if (!it->is_string()) context.fail("dtype: expected a string, got " + json_describe(*it));
  const std::string name = it->get<std::string>();
  const std::optional<DType> dtype = dtype_from_name(name);
  if (!dtype) context.fail("unknown dtype '" + name + "' (expected F32, F16, BF16, F64, I64, I32 or U8)");
  return *dtype;
}

std::vector<int64_t> parse_shape(const nlohmann::json& entry, const EntryContext& context) {
  const auto it = entry.find("shape");
  if (it == entry.end()) context.fail("shape: required key is missing");
  if (!it->is_array()) context.fail("shape: expected an array, got " + json_describe(*it));
  std::vector<int64_t> shape;
  for (const nlohmann::json& dim : *it) {
    const std::optional<uint64_t> size = non_negative(dim);
    if (!size || *size > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      context.fail("shape: expected non-negative integers, got " + json_describe(dim));
    }
    shape.push_back(static_cast<int64_t>(*size));
  }
  return shape;
}

int64_t checked_numel(const std::vector<int64_t>& shape, const EntryContext& context) {
  int64_t count = 1;
  for (int64_t dim : shape) {
    if (__builtin_mul_overflow(count, dim, &count)) {
      context.fail("shape " + bracketed_list(shape) + " has more elements than fit a 64-bit count");
    }
  }
  return count;
}

void parse_offsets(const nlohmann::json& entry, const EntryContext& context, TensorInfo& tensor) {
  const auto it = entry.find("data_offsets");
  if (it == entry.end()) context.fail("data_offsets: required key is missing");
  if (!it->is_array() || it->size() != 2 || !non_negative((*it)[0]) ||
      !non_negative((*it)[1])) {
    context.fail("data_offsets: expected [begin, end] as non-negative integers, got " +
                 it->dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  }
  tensor.begin = *non_negative((*it)[0]);
  tensor.end = *non_negative((*it)[1]);
  if (tensor.begin > tensor.end || tensor.end > context.data_region_bytes) {
    context.fail("data_offsets " + span_text(tensor.begin, tensor.end) +
                 " are out of range: expected begin <= end <= " +
                 std::to_string(context.data_region_bytes) + " (the data region's size)");
  }
}

void check_byte_span(const TensorInfo& tensor, const EntryContext& context) {
  uint64_t expected = 0;
  const bool overflow = __builtin_mul_overflow(static_cast<uint64_t>(tensor.numel()),
                                               static_cast<uint64_t>(dtype_size(tensor.dtype)),
                                               &expected);
  if (overflow || expected != tensor.nbytes()) {
    context.fail("shape " + bracketed_list(tensor.shape) + " of " + dtype_name(tensor.dtype) +
                 " needs " + (overflow ? std::string("more than 2^64") : std::to_string(expected)) +
                 " bytes, but data_offsets " + span_text(tensor.begin, tensor.end) + " span " +
                 std::to_string(tensor.nbytes()));
  }
}

TensorInfo parse_tensor_entry(const std::string& name, const nlohmann::json& entry,
                              const EntryContext& context) {
  if (!entry.is_object()) {
    context.fail("expected an object with dtype, shape and data_offsets, got " +
                 json_describe(entry));
  }
  TensorInfo tensor;
  tensor.name = name;
  tensor.dtype = parse_dtype(entry, context);
  tensor.shape = parse_shape(entry, context);
  checked_numel(tensor.shape, context);
  parse_offsets(entry, context, tensor);
  check_byte_span(tensor, context);
  return tensor;
}

std::map<std::string, std::string> parse_metadata(const nlohmann::json& value,
                                                  const std::string& label) {
  if (!value.is_object()) {
    throw InputError(label, kMetadataKey,
                     "expected an object of strings, got " + json_describe(value));
  }
  std::map<std::string, std::string> metadata;
  for (const auto& [key, text] : value.items()) {
    if (!text.is_string()) {
      throw InputError(label, std::string(kMetadataKey) + "." + key,
                       "expected a string, got " + json_describe(text));
    }
    metadata[key] = text.get<std::string>();
  }
  return metadata;
}

// Tensors sorted by offset must tile [0, data_region_bytes) exactly.
void check_coverage(std::vector<const TensorInfo*> by_offset, uint64_t data_region_bytes,
                    uint64_t data_start, const std::string& label) {
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t covered_to = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo* tensor : by_offset) {
    if (tensor->begin < covered_to) {
      throw InputError(label, tensor->name,
                       "data_offsets " + span_text(tensor->begin, tensor->end) +
                           " overlap tensor '" + previous->name + "' at " +
                           span_text(previous->begin, previous->end));
    }
    if (tensor->begin > covered_to) {
      throw InputError(label, tensor->name,
                       "data_offsets " + span_text(tensor->begin, tensor->end) +
                           " leave a gap: bytes [" + std::to_string(covered_to) + ", " +
                           std::to_string(tensor->begin) +
                           ") of the data region belong to no tensor (file byte " +
                           std::to_string(data_start + covered_to) + ")");
    }
    covered_to = tensor->end;
    previous = tensor;
  }
  if (covered_to != data_region_bytes) {
    throw InputError(label, byte_key(data_start + covered_to),
                     "bytes [" + std::to_string(covered_to) + ", " +
                         std::to_string(data_region_bytes) +
                         ") of the data region belong to no tensor: expected data_offsets to "
                         "cover all " + std::to_string(data_region_bytes) + " bytes");
  }
}

uint64_t read_header_length(const uint8_t* bytes, size_t size, const std::string& label) {
  if (size < kLengthPrefixBytes) {
    throw InputError(label, "byte 0",
                     "expected at least 8 bytes (the header length), got a file of " +
                         std::to_string(size) + " bytes");
  }
  const uint64_t header_bytes = read_u64_le(bytes);
  if (header_bytes > size - kLengthPrefixBytes) {
    throw InputError(label, "byte 0",
                     "header length " + std::to_string(header_bytes) + " exceeds file size " +
                         std::to_string(size));
  }
  if (header_bytes > kMaxHeaderBytes) {
    throw InputError(label, "byte 0",
                     "header length " + std::to_string(header_bytes) +
                         " exceeds the 100 MiB limit on safetensors headers");
  }
  return header_bytes;
}

void write_u64_le(std::ostream& out, uint64_t value) {
  char bytes[8];
  for (char& byte : bytes) {
    byte = static_cast<char>(value & 0xFF);
    value >>= 8;
  }
  out.write(bytes, sizeof bytes);
}

}  // namespace

const char* dtype_name(DType dtype) {
  for (const DTypeEntry& entry : kDTypes) {
    if (entry.dtype == dtype) return entry.name;
  }
  return "?";
}

size_t dtype_size(DType dtype) {
  for (const DTypeEntry& entry : kDTypes) {
    if (entry.dtype == dtype) return entry.size;
  }
  return 0;
}

int64_t TensorInfo::numel() const {
  int64_t count = 1;
  for (int64_t dim : shape) count *= dim;  // validated against overflow when parsed
  return count;
}

std::vector<TensorInfo> parse_safetensors_buffer(const uint8_t* bytes, size_t size,
                                                 const std::string& label,
                                                 std::map<std::string, std::string>* metadata) {
  const uint64_t header_bytes = read_header_length(bytes, size, label);
  const uint64_t data_start = kLengthPrefixBytes + header_bytes;
  const uint64_t data_region_bytes = size - data_start;
  const std::string header_text(reinterpret_cast<const char*>(bytes) + kLengthPrefixBytes,
                                header_bytes);
  const nlohmann::json header =
      parse_json_guarded(header_text, label, 64, kLengthPrefixBytes);
  if (!header.is_object()) {
    throw InputError(label, byte_key(kLengthPrefixBytes),
                     "expected the header to be a JSON object, got " + json_describe(header));
  }

  std::vector<TensorInfo> tensors;
  std::map<std::string, std::string> parsed_metadata;
  for (const auto& [name, entry] : header.items()) {
    if (name == kMetadataKey) {
      parsed_metadata = parse_metadata(entry, label);
      continue;
    }
    tensors.push_back(parse_tensor_entry(name, entry, EntryContext{label, name, data_region_bytes}));
  }

  std::vector<const TensorInfo*> by_offset;
  by_offset.reserve(tensors.size());
  for (const TensorInfo& tensor : tensors) by_offset.push_back(&tensor);
  check_coverage(std::move(by_offset), data_region_bytes, data_start, label);

  for (TensorInfo& tensor : tensors) tensor.data = bytes + data_start + tensor.begin;
  std::sort(tensors.begin(), tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
  if (metadata != nullptr) *metadata = std::move(parsed_metadata);
  return tensors;
}

SafetensorsFile SafetensorsFile::open(const std::string& path, const std::string& label) {
  SafetensorsFile file;
  file.map_ = MappedFile(path, label);
  // The mapping's address survives moves of `file`, so data pointers stay valid.
  file.tensors_ = parse_safetensors_buffer(file.map_.data(), file.map_.size(), label,
                                           &file.metadata_);
  return file;
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  const auto it = std::lower_bound(
      tensors_.begin(), tensors_.end(), name,
      [](const TensorInfo& tensor, const std::string& key) { return tensor.name < key; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

const TensorInfo& SafetensorsFile::at(const std::string& name) const {
  if (const TensorInfo* tensor = find(name)) return *tensor;
  throw InputError(label(), name, "missing tensor (the file holds " +
                                      std::to_string(tensors_.size()) + " tensors)");
}

void SafetensorsWriter::add(const std::string& name, DType dtype, std::vector<int64_t> shape,
                            const void* data, size_t nbytes) {
  if (name == kMetadataKey) throw std::invalid_argument("tensor name __metadata__ is reserved");
  for (const Entry& entry : entries_) {
    if (entry.name == name) throw std::invalid_argument("duplicate tensor name " + name);
  }
  uint64_t expected = dtype_size(dtype);
  for (int64_t dim : shape) {
    if (dim < 0 || __builtin_mul_overflow(expected, static_cast<uint64_t>(dim), &expected)) {
      throw std::invalid_argument("tensor " + name + ": bad shape " + bracketed_list(shape));
    }
  }
  if (expected != nbytes) {
    throw std::invalid_argument("tensor " + name + ": shape " + bracketed_list(shape) + " of " +
                                dtype_name(dtype) + " needs " + std::to_string(expected) +
                                " bytes, got " + std::to_string(nbytes));
  }
  const auto* first = static_cast<const uint8_t*>(data);
  entries_.push_back(Entry{name, dtype, std::move(shape),
                           std::vector<uint8_t>(first, first + nbytes)});
}

void SafetensorsWriter::set_metadata(const std::string& key, const std::string& value) {
  metadata_[key] = value;
}

void SafetensorsWriter::write(const std::string& path) const {
  nlohmann::json header = nlohmann::json::object();
  uint64_t offset = 0;
  for (const Entry& entry : entries_) {
    header[entry.name] = {{"dtype", dtype_name(entry.dtype)},
                          {"shape", entry.shape},
                          {"data_offsets", {offset, offset + entry.bytes.size()}}};
    offset += entry.bytes.size();
  }
  if (!metadata_.empty()) header[kMetadataKey] = metadata_;

  std::string header_text;
  try {
    header_text = header.dump();
  } catch (const nlohmann::json::exception& error) {
    throw std::runtime_error("cannot write " + path + ": " + error.what());
  }
  // Spaces are valid JSON whitespace; padding aligns the data region to 8 bytes.
  header_text.append((8 - header_text.size() % 8) % 8, ' ');

  const std::string temporary = path + ".tmp";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    write_u64_le(out, header_text.size());
    out.write(header_text.data(), static_cast<std::streamsize>(header_text.size()));
    for (const Entry& entry : entries_) {
      out.write(reinterpret_cast<const char*>(entry.bytes.data()),
                static_cast<std::streamsize>(entry.bytes.size()));
    }
    out.close();
    if (!out) {
      std::error_code ignored;
      std::filesystem::remove(temporary, ignored);
      throw std::runtime_error("cannot write " + temporary);
    }
  }
  std::error_code error;
  std::filesystem::rename(temporary, path, error);
  if (error) {
    std::error_code ignored;
    std::filesystem::remove(temporary, ignored);
    throw std::runtime_error("cannot rename " + temporary + " to " + path + ": " +
                             error.message());
  }
}

void SafetensorsFile::release(const TensorInfo& info) const {
  map_.release_pages(static_cast<size_t>(info.data - map_.data()), info.nbytes());
}

}  // namespace nanreplay
