// How messages name things, said once: a byte offset as a key, a list of
// numbers (a shape, coordinates, samples), the last system error.
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace nanreplay {

// The key of an InputError about a position in a file: "byte 1234".
inline std::string byte_key(uint64_t offset) { return "byte " + std::to_string(offset); }

// "2, 64, 128"; past `limit` values, ", ... (N in all)".
inline std::string comma_list(const std::vector<int64_t>& values, size_t limit = SIZE_MAX) {
  std::string text;
  for (size_t i = 0; i < values.size() && i < limit; ++i) text += (i ? ", " : "") + std::to_string(values[i]);
  if (values.size() > limit) text += ", ... (" + std::to_string(values.size()) + " in all)";
  return text;
}

// "[2, 64, 128]": a shape or an element's coordinates.
inline std::string bracketed_list(const std::vector<int64_t>& values) { return "[" + comma_list(values) + "]"; }

// strerror(errno), read right after the failing call.
inline std::string errno_text() { return std::strerror(errno); }

}  // namespace nanreplay
