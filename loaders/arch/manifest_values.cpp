// See manifest_values.h.
#include "loaders/arch/manifest_values.h"

#include <cmath>

#include "loaders/base/error.h"

namespace nanreplay {

int64_t positive_integer(const JsonReader& reader, const std::string& key) {
  const int64_t value = reader.integer(key);
  if (value <= 0) {
    throw InputError(reader.file(), reader.key_path(key),
                     "expected a positive integer, got " + std::to_string(value));
  }
  return value;
}

int64_t optional_positive_integer(const JsonReader& reader, const std::string& key, int64_t fallback) {
  return reader.has(key) ? positive_integer(reader, key) : fallback;
}

int64_t dimension(const JsonReader& reader, const std::string& key) {
  const int64_t value = positive_integer(reader, key);
  if (value > kLargestDimension) {
    throw InputError(reader.file(), reader.key_path(key),
                     "expected at most " + std::to_string(kLargestDimension) +
                         " (larger than any model's; tensor sizes built from it would overflow), got " +
                         std::to_string(value));
  }
  return value;
}

int64_t optional_dimension(const JsonReader& reader, const std::string& key, int64_t fallback) {
  return reader.has(key) ? dimension(reader, key) : fallback;
}

std::string exact_number_text(double value) {
  if (!std::isfinite(value)) return std::isnan(value) ? "nan" : (value > 0 ? "inf" : "-inf");
  std::string text = nlohmann::json(value).dump();
  const std::string whole_suffix = ".0";
  if (text.size() > whole_suffix.size() &&
      text.compare(text.size() - whole_suffix.size(), whole_suffix.size(), whole_suffix) == 0) {
    text.resize(text.size() - whole_suffix.size());
  }
  return text;
}

double finite_number_above(const JsonReader& reader, const std::string& key, double lowest, bool inclusive) {
  const double value = reader.number(key);
  const bool in_range = inclusive ? value >= lowest : value > lowest;
  if (!std::isfinite(value) || !in_range) {
    throw InputError(reader.file(), reader.key_path(key),
                     std::string("expected a finite number ") + (inclusive ? ">= " : "> ") +
                         exact_number_text(lowest) + ", got " + exact_number_text(value));
  }
  return value;
}

std::string one_of(const JsonReader& reader, const std::string& key, const std::vector<const char*>& choices) {
  std::string value = reader.string(key);
  std::string listed;
  for (const char* choice : choices) {
    if (value == choice) return value;
    listed += (listed.empty() ? "" : " or ") + ("\"" + std::string(choice) + "\"");
  }
  throw InputError(reader.file(), reader.key_path(key),
                   "expected " + listed + ", got " + json_describe(nlohmann::json(value)));
}

}  // namespace nanreplay
