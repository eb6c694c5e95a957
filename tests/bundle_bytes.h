// Byte-level edits of a bundle's files for the tests that break bundles on
// purpose (test_cli_bad_bundles.cpp, test_cli_structure.cpp): raw writes,
// JSON edits in place, and safetensors' little-endian header length.
#pragma once

#include <catch2/catch.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "tests/cli_harness.h"

namespace nanreplay_test {

inline void write_bytes(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

inline void edit_json(const std::filesystem::path& path, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json doc = nlohmann::json::parse(slurp(path));
  edit(doc);
  write_bytes(path, doc.dump(2));
}

inline uint64_t read_u64_le(const std::string& bytes, size_t at = 0) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | static_cast<unsigned char>(bytes[at + static_cast<size_t>(i)]);
  return value;
}

inline std::string u64_le(uint64_t value) {
  std::string bytes(8, '\0');
  for (char& byte : bytes) {
    byte = static_cast<char>(value & 0xFF);
    value >>= 8;
  }
  return bytes;
}

}  // namespace nanreplay_test
