// Tests for loaders/formats/safetensors.cpp: files written by SafetensorsWriter read
// back exactly, then hand-made corrupt buffers (truncation, bad offsets,
// overlaps, gaps, unknown dtypes, overflowing shapes, hostile header JSON),
// each rejected with an InputError naming the file and the tensor or byte.
#include <catch2/catch.hpp>

#include "tests/loader_test_support.h"

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "loaders/base/error.h"
#include "loaders/formats/safetensors.h"

namespace {

namespace fs = std::filesystem;
using nanreplay::DType;
using nanreplay::InputError;

using nanreplay_test::MessageMentions;
using nanreplay_test::TempDir;

const char* const kSafetensorsLabel = "steps/100/model.safetensors";

// Bytes of a safetensors file: length prefix (or `claimed_length`), header, data.
std::vector<uint8_t> raw_file(const std::string& header, size_t data_bytes,
                              std::optional<uint64_t> claimed_length = std::nullopt) {
  const uint64_t length = claimed_length.value_or(header.size());
  std::vector<uint8_t> bytes(8);
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<uint8_t>(length >> (8 * i));
  bytes.insert(bytes.end(), header.begin(), header.end());
  bytes.resize(bytes.size() + data_bytes, 0x5A);
  return bytes;
}

std::vector<nanreplay::TensorInfo> tensors_of(const std::vector<uint8_t>& bytes,
                                         std::map<std::string, std::string>* metadata = nullptr) {
  return nanreplay::parse_safetensors_buffer(bytes.data(), bytes.size(), kSafetensorsLabel, metadata);
}

std::vector<uint8_t> read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

void write_all(const fs::path& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace

TEST_CASE("safetensors: written tensors read back exactly", "[loaders][safetensors]") {
  TempDir dir;
  const std::vector<float> weights = {1.0f, -2.5f, 3.25f, 0.0f, 1e-30f, -7.0f};
  const std::vector<uint16_t> halves = {0x3C00, 0xC000, 0x7C00};  // F16 1, -2, inf
  const std::vector<uint16_t> bfloats = {0x3F80, 0x7FC0};         // BF16 1, nan
  const int64_t step_count = 42;
  nanreplay::SafetensorsWriter writer;
  writer.add("model.layers.0.mlp.up_proj.weight", DType::kF32, {2, 3}, weights.data(),
             weights.size() * sizeof(float));
  writer.add("b.f16", DType::kF16, {3}, halves.data(), halves.size() * 2);
  writer.add("a.bf16", DType::kBF16, {1, 2}, bfloats.data(), bfloats.size() * 2);
  writer.add("step", DType::kI64, {}, &step_count, sizeof step_count);
  writer.add("empty", DType::kF32, {0, 4}, nullptr, 0);
  writer.set_metadata("format", "pt");
  writer.set_metadata("producer", "nanreplay tests");
  const fs::path path = dir / "model.safetensors";
  writer.write(path.string());
  CHECK_FALSE(fs::exists(path.string() + ".tmp"));

  const std::vector<uint8_t> bytes = read_all(path);
  uint64_t header_length = 0;
  std::memcpy(&header_length, bytes.data(), 8);
  CHECK(header_length % 8 == 0);  // the data region starts 8-byte aligned
  const char last = static_cast<char>(bytes[8 + header_length - 1]);
  CHECK((last == ' ' || last == '}'));  // padded with spaces, as the format allows

  const nanreplay::SafetensorsFile file = nanreplay::SafetensorsFile::open(path.string(), kSafetensorsLabel);
  CHECK(file.label() == kSafetensorsLabel);
  REQUIRE(file.tensors().size() == 5);
  std::vector<std::string> names;
  for (const auto& tensor : file.tensors()) names.push_back(tensor.name);
  CHECK(names == std::vector<std::string>{"a.bf16", "b.f16", "empty",
                                          "model.layers.0.mlp.up_proj.weight", "step"});

  const nanreplay::TensorInfo& w = file.at("model.layers.0.mlp.up_proj.weight");
  CHECK(w.dtype == DType::kF32);
  CHECK(w.shape == std::vector<int64_t>{2, 3});
  CHECK(w.numel() == 6);
  CHECK(w.nbytes() == 24);
  std::vector<float> read_back(6);
  std::memcpy(read_back.data(), w.data, 24);
  CHECK(read_back == weights);

  const nanreplay::TensorInfo& h = file.at("b.f16");
  CHECK(h.dtype == DType::kF16);
  CHECK(std::memcmp(h.data, halves.data(), 6) == 0);
  const nanreplay::TensorInfo& bf = file.at("a.bf16");
  CHECK(bf.dtype == DType::kBF16);
  CHECK(bf.shape == std::vector<int64_t>{1, 2});
  CHECK(std::memcmp(bf.data, bfloats.data(), 4) == 0);
  const nanreplay::TensorInfo& s = file.at("step");
  CHECK(s.shape.empty());
  CHECK(s.numel() == 1);
  int64_t step_read = 0;
  std::memcpy(&step_read, s.data, 8);
  CHECK(step_read == 42);
  CHECK(file.at("empty").numel() == 0);
  CHECK(file.at("empty").nbytes() == 0);

  CHECK(file.metadata() == std::map<std::string, std::string>{{"format", "pt"},
                                                             {"producer", "nanreplay tests"}});
  CHECK(file.find("lm_head.weight") == nullptr);
  REQUIRE_INPUT_ERROR(file.at("lm_head.weight"), kSafetensorsLabel, "lm_head.weight", "missing tensor");
}

TEST_CASE("safetensors: a file with no tensors is valid", "[loaders][safetensors]") {
  TempDir dir;
  nanreplay::SafetensorsWriter().write((dir / "empty.safetensors").string());
  const auto file = nanreplay::SafetensorsFile::open((dir / "empty.safetensors").string(), "e");
  CHECK(file.tensors().empty());
  CHECK(file.metadata().empty());
  CHECK(tensors_of(raw_file("{}", 0)).empty());
}

TEST_CASE("safetensors: the writer refuses inconsistent tensors", "[loaders][safetensors]") {
  nanreplay::SafetensorsWriter writer;
  const float value = 1.0f;
  CHECK_THROWS_AS(writer.add("x", DType::kF32, {2}, &value, 4), std::invalid_argument);
  CHECK_THROWS_AS(writer.add("x", DType::kF32, {-1}, &value, 4), std::invalid_argument);
  CHECK_THROWS_AS(writer.add("__metadata__", DType::kF32, {1}, &value, 4), std::invalid_argument);
  writer.add("x", DType::kF32, {1}, &value, 4);
  CHECK_THROWS_AS(writer.add("x", DType::kF32, {1}, &value, 4), std::invalid_argument);
  CHECK_THROWS_AS(writer.write("/nonexistent-dir/x.safetensors"), std::runtime_error);
}

TEST_CASE("safetensors: dtype names and sizes", "[loaders][safetensors]") {
  CHECK(std::string(nanreplay::dtype_name(DType::kBF16)) == "BF16");
  CHECK(nanreplay::dtype_size(DType::kF32) == 4);
  CHECK(nanreplay::dtype_size(DType::kF16) == 2);
  CHECK(nanreplay::dtype_size(DType::kBF16) == 2);
  CHECK(nanreplay::dtype_size(DType::kF64) == 8);
  CHECK(nanreplay::dtype_size(DType::kI64) == 8);
  CHECK(nanreplay::dtype_size(DType::kI32) == 4);
  CHECK(nanreplay::dtype_size(DType::kU8) == 1);
}

TEST_CASE("safetensors: a hand-made buffer with unpadded header parses",
          "[loaders][safetensors]") {
  std::map<std::string, std::string> metadata;
  const auto tensors = tensors_of(
      raw_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
               R"("u":{"dtype":"U8","shape":[3],"data_offsets":[8,11]},)"
               R"("__metadata__":{"k":"v"}})", 11),
      &metadata);
  REQUIRE(tensors.size() == 2);
  CHECK(tensors[0].name == "u");
  CHECK(tensors[0].begin == 8);
  CHECK(tensors[1].name == "w");
  CHECK(metadata.at("k") == "v");
}

TEST_CASE("safetensors: truncated files and bad header lengths name byte 0",
          "[loaders][safetensors]") {
  REQUIRE_INPUT_ERROR(tensors_of({}), kSafetensorsLabel, "byte 0", "8 bytes");
  REQUIRE_INPUT_ERROR(tensors_of({1, 0, 0}), kSafetensorsLabel, "byte 0", "3 bytes");
  REQUIRE_INPUT_ERROR(tensors_of(raw_file("{}", 0, 1000)), kSafetensorsLabel, "byte 0",
                      "header length 1000 exceeds file size 10");
  REQUIRE_INPUT_ERROR(tensors_of(raw_file("{}", 0, UINT64_MAX)), kSafetensorsLabel, "byte 0",
                      "exceeds file size");
  const uint64_t over_limit = (100ull << 20) + 8;
  REQUIRE_INPUT_ERROR(tensors_of(raw_file(std::string(over_limit, ' '), 0)), kSafetensorsLabel, "byte 0",
                      "100 MiB");
  // A valid file cut short: its data region no longer matches its offsets.
  std::vector<uint8_t> cut = raw_file(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 16);
  cut.resize(cut.size() - 5);
  REQUIRE_INPUT_ERROR(tensors_of(cut), kSafetensorsLabel, "w", "out of range");
}

TEST_CASE("safetensors: bad offsets name the tensor", "[loaders][safetensors]") {
  const std::string f32_4 = R"("dtype":"F32","shape":[4])";
  REQUIRE_INPUT_ERROR(tensors_of(raw_file(R"({"w":{)" + f32_4 + R"(,"data_offsets":[0,32]}})", 16)),
                      kSafetensorsLabel, "w", "out of range", "[0, 32]");
  REQUIRE_INPUT_ERROR(tensors_of(raw_file(R"({"w":{)" + f32_4 + R"(,"data_offsets":[16,0]}})", 16)),
                      kSafetensorsLabel, "w", "out of range");
  REQUIRE_INPUT_ERROR(
      tensors_of(raw_file(R"({"w":{)" + f32_4 + R"(,"data_offsets":[0,18446744073709551615]}})", 16)),
      kSafetensorsLabel, "w", "out of range");
  for (const char* offsets : {"[0]", "[0,16,32]", "[-1,15]", "[0,\"16\"]", "{}", "[0,1.5]"}) {
    CAPTURE(offsets);
    REQUIRE_INPUT_ERROR(
        tensors_of(raw_file(R"({"w":{)" + f32_4 + R"(,"data_offsets":)" + offsets + "}}", 16)),
        kSafetensorsLabel, "w", "data_offsets");
  }
  REQUIRE_INPUT_ERROR(tensors_of(raw_file(R"({"w":{)" + f32_4 + "}}", 16)), kSafetensorsLabel, "w",
                      "data_offsets: required key is missing");
}

TEST_CASE("safetensors: overlapping tensors name both", "[loaders][safetensors]") {
  REQUIRE_INPUT_ERROR(
      tensors_of(raw_file(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                     R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 16)),
      kSafetensorsLabel, "b", "overlap tensor 'a'", "[8, 16]", "[0, 16]");
  // Two tensors claiming the same bytes.
  REQUIRE_INPUT_ERROR(
      tensors_of(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                     R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8)),
      kSafetensorsLabel, "overlap");
}

TEST_CASE("safetensors: gaps in the data region are rejected", "[loaders][safetensors]") {
  REQUIRE_INPUT_ERROR(
      tensors_of(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                     R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})", 12)),
      kSafetensorsLabel, "b", "gap", "[4, 8)");
  REQUIRE_INPUT_ERROR(
      tensors_of(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8)), kSafetensorsLabel,
      "a", "gap", "[0, 4)");
  // Trailing bytes after the last tensor are named by their file offset.
  const std::string header = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  REQUIRE_INPUT_ERROR(tensors_of(raw_file(header, 12)), kSafetensorsLabel,
                      "byte " + std::to_string(8 + header.size() + 4), "[4, 12)",
                      "belong to no tensor");
  REQUIRE_INPUT_ERROR(tensors_of(raw_file("{}", 4)), kSafetensorsLabel, "byte 10", "[0, 4)");
}

TEST_CASE("safetensors: bad dtypes and shapes name the tensor", "[loaders][safetensors]") {
  REQUIRE_INPUT_ERROR(
      tensors_of(raw_file(R"({"w":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]}})", 4)),
      kSafetensorsLabel, "w", "unknown dtype 'F8_E4M3'");
  REQUIRE_INPUT_ERROR(tensors_of(raw_file(R"({"w":{"dtype":4,"shape":[4],"data_offsets":[0,4]}})", 4)),
                      kSafetensorsLabel, "w", "dtype");
  REQUIRE_INPUT_ERROR(tensors_of(raw_file(R"({"w":{"shape":[4],"data_offsets":[0,4]}})", 4)), kSafetensorsLabel,
                      "w", "dtype: required key is missing");
  // Shape and byte span disagree.
  REQUIRE_INPUT_ERROR(
      tensors_of(raw_file(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", 20)),
      kSafetensorsLabel, "w", "shape [2, 3] of F32 needs 24 bytes", "span 20");
  REQUIRE_INPUT_ERROR(
      tensors_of(raw_file(R"({"w":{"dtype":"BF16","shape":[4],"data_offsets":[0,16]}})", 16)),
      kSafetensorsLabel, "w", "needs 8 bytes");
  // A shape claiming terabytes cannot match a small span.
  REQUIRE_INPUT_ERROR(
      tensors_of(raw_file(R"({"w":{"dtype":"F32","shape":[1000000,1000000],"data_offsets":[0,4]}})", 4)),
      kSafetensorsLabel, "w", "needs 4000000000000 bytes");
  // Element count beyond int64, and bytes beyond uint64.
  REQUIRE_INPUT_ERROR(
      tensors_of(raw_file(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})",
                     4)),
      kSafetensorsLabel, "w", "more elements");
  REQUIRE_INPUT_ERROR(
      tensors_of(raw_file(R"({"w":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]}})",
                     8)),
      kSafetensorsLabel, "w", "more than 2^64");
  for (const char* shape : {"[-1]", "[2.0]", "[\"2\"]", "4", "[9223372036854775808]", "[true]"}) {
    CAPTURE(shape);
    REQUIRE_INPUT_ERROR(
        tensors_of(raw_file(std::string(R"({"w":{"dtype":"U8","data_offsets":[0,0],"shape":)") + shape +
                       "}}", 0)),
        kSafetensorsLabel, "w", "shape");
  }
  REQUIRE_INPUT_ERROR(tensors_of(raw_file(R"({"w":[1,2]})", 0)), kSafetensorsLabel, "w", "expected an object");
}

TEST_CASE("safetensors: hostile header JSON names the file and byte", "[loaders][safetensors]") {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  REQUIRE_INPUT_ERROR(tensors_of(raw_file(deep, 0)), kSafetensorsLabel, "byte 72", "nested");
  const std::string deep_value = R"({"w":)" + std::string(100, '{');
  REQUIRE_INPUT_ERROR(tensors_of(raw_file(deep_value, 0)), kSafetensorsLabel, "nested");
  // Invalid UTF-8 in a tensor name, at header byte 2 (file byte 10).
  REQUIRE_INPUT_ERROR(
      tensors_of(raw_file("{\"\xc3\x28\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]}}", 0)),
      kSafetensorsLabel, "byte 10", "UTF-8");
  REQUIRE_INPUT_ERROR(tensors_of(raw_file("{\"w\": ", 0)), kSafetensorsLabel, "invalid JSON");
  REQUIRE_INPUT_ERROR(tensors_of(raw_file(std::string(8, '\0'), 0)), kSafetensorsLabel, "invalid JSON");
  REQUIRE_INPUT_ERROR(tensors_of(raw_file("[]      ", 0)), kSafetensorsLabel, "byte 8", "JSON object");
  REQUIRE_INPUT_ERROR(tensors_of(raw_file(R"({"__metadata__":{"k":1}})", 0)), kSafetensorsLabel,
                      "__metadata__.k", "string");
  REQUIRE_INPUT_ERROR(tensors_of(raw_file(R"({"__metadata__":["k"]})", 0)), kSafetensorsLabel, "__metadata__",
                      "object");
}

TEST_CASE("safetensors: file-level errors name the file", "[loaders][safetensors]") {
  TempDir dir;
  REQUIRE_INPUT_ERROR(nanreplay::SafetensorsFile::open((dir / "absent").string(), kSafetensorsLabel), kSafetensorsLabel,
                      "cannot open");
  REQUIRE_INPUT_ERROR(nanreplay::SafetensorsFile::open(dir.path().string(), kSafetensorsLabel), kSafetensorsLabel,
                      "directory");
  write_all(dir / "empty.safetensors", {});
  REQUIRE_INPUT_ERROR(
      nanreplay::SafetensorsFile::open((dir / "empty.safetensors").string(), kSafetensorsLabel), kSafetensorsLabel,
      "byte 0");
  write_all(dir / "bad.safetensors",
            raw_file(R"({"w":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}})", 1));
  REQUIRE_INPUT_ERROR(nanreplay::SafetensorsFile::open((dir / "bad.safetensors").string(), kSafetensorsLabel),
                      kSafetensorsLabel, "w", "unknown dtype 'Q4'");
}
