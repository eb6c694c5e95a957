// Value checks every section of manifest.json shares (the model options
// included): each reads one key through a JsonReader and throws InputError
// naming the file and the full key path, with the value it got.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "loaders/base/json_util.h"

namespace nanreplay {

// A model dimension (a width, a count of layers, heads or experts, a length):
// no real model comes near 2^30, and up to it the element count of any
// parameter tensor (two dimensions, gpt2's 4 * hidden_size included) fits 64 bits.
constexpr int64_t kLargestDimension = int64_t{1} << 30;

int64_t positive_integer(const JsonReader& reader, const std::string& key);
int64_t optional_positive_integer(const JsonReader& reader, const std::string& key, int64_t fallback);
// A positive integer up to kLargestDimension.
int64_t dimension(const JsonReader& reader, const std::string& key);
int64_t optional_dimension(const JsonReader& reader, const std::string& key, int64_t fallback);

// Shortest round-trip text, "nan"/"inf" for non-finite values, "0" not "0.0".
std::string exact_number_text(double value);

// A finite number with `lowest` as its bound (inclusive or not).
double finite_number_above(const JsonReader& reader, const std::string& key, double lowest, bool inclusive);

// A string that is one of `choices`; the error lists them ("expected \"a\" or \"b\", got ...").
std::string one_of(const JsonReader& reader, const std::string& key, const std::vector<const char*>& choices);

}  // namespace nanreplay
