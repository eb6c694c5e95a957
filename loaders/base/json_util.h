// Typed access to JSON values with errors that name the file and key path.
// Also guards the parser against hostile input (encoding, nesting depth, size).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace nanreplay {

// Larger JSON texts are refused before parsing (their DOM would be ~10x larger).
constexpr size_t kMaxJsonBytes = size_t{256} << 20;
// The most a parsed JSON document may take in memory, estimated from its text
// before parsing: text dense with tiny values ("[{},{},...]") costs 20-30
// times its size in nlohmann's DOM, so a size cap alone does not bound memory.
// A real manifest is mostly arrays of sample indices, 24 bytes each by the
// estimate: 16 million of them fit.
constexpr size_t kMaxJsonDomBytes = size_t{384} << 20;

// Parses `text`, rejecting text over kMaxJsonBytes, invalid UTF-8, nesting
// deeper than `max_depth`, a DOM estimated over kMaxJsonDomBytes and anything
// that is not valid JSON, with
// InputError(file_label, "byte N", ...).
// The depth is checked by an iterative scan before parsing, so hostile input
// cannot exhaust the stack. `byte_base` is added to reported offsets (a JSON
// text embedded in a larger file, like a safetensors header, reports file bytes).
nlohmann::json parse_json_guarded(const std::string& text, const std::string& file_label,
                                  int max_depth = 64, uint64_t byte_base = 0);

// Accessors over an object `obj` found at key path `path` ("" for the root).
// Required getters throw when the key is missing; optional ones return nullopt
// (an explicit null counts as missing, as Python's json.dump writes None).
// Throws InputError when `obj` is not an object. `obj` must outlive the reader.
class JsonReader {
 public:
  JsonReader(const nlohmann::json& obj, std::string file_label, std::string path);

  bool has(const std::string& key) const;
  JsonReader object(const std::string& key) const;
  std::optional<JsonReader> optional_object(const std::string& key) const;
  const nlohmann::json& array(const std::string& key) const;

  std::string string(const std::string& key) const;
  std::optional<std::string> optional_string(const std::string& key) const;
  int64_t integer(const std::string& key) const;
  std::optional<int64_t> optional_integer(const std::string& key) const;
  // Finite or not: accepts numbers and the strings "nan", "inf", "-inf".
  double number(const std::string& key) const;
  std::optional<double> optional_number(const std::string& key) const;
  bool boolean(const std::string& key) const;
  std::optional<bool> optional_boolean(const std::string& key) const;

  std::string key_path(const std::string& key) const;  // "model.hidden_size"
  const std::string& file() const { return file_; }
  const nlohmann::json& json() const { return obj_; }

 private:
  const nlohmann::json& get(const std::string& key) const;
  const nlohmann::json& obj_;
  std::string file_;
  std::string path_;
};

// A JSON value as a double: numbers, or "nan"/"inf"/"-inf" (also "NaN",
// "Infinity", "-Infinity", any case). Throws InputError.
double number_from_json(const nlohmann::json& value, const std::string& file_label,
                   const std::string& key_path);

// A JSON integer that fits int64 (not a float such as 3.0, not a boolean).
int64_t json_integer(const nlohmann::json& value, const std::string& file_label,
                     const std::string& key_path);

// A short one-line description of a value for error messages: `-4`, `"abc"`,
// `3.5`, `true`, `null`, `an array`, `an object`.
std::string json_describe(const nlohmann::json& value);

}  // namespace nanreplay
