// Guarded JSON parsing and typed accessors whose errors name file and key path.
// Key constraint: hostile text (invalid UTF-8, a million nested brackets) must
// end in an InputError, never a crash, so both are screened before nlohmann
// parses and every accessor checks the type it was promised.
#include "loaders/base/json_util.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>

#include "loaders/base/error.h"
#include "loaders/base/message_text.h"

namespace nanreplay {
namespace {

constexpr size_t kNotFound = std::string::npos;


// Offset of the first byte that does not start a well-formed UTF-8 sequence
// (overlong forms, surrogates and code points past U+10FFFF are ill-formed).
size_t find_invalid_utf8(const std::string& text) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(text.data());
  const size_t size = text.size();
  size_t i = 0;
  while (i < size) {
    const unsigned char lead = bytes[i];
    if (lead < 0x80) {
      ++i;
      continue;
    }
    size_t length = 0;
    uint32_t code_point = 0;
    uint32_t smallest = 0;
    if ((lead & 0xE0) == 0xC0) {
      length = 2, code_point = lead & 0x1F, smallest = 0x80;
    } else if ((lead & 0xF0) == 0xE0) {
      length = 3, code_point = lead & 0x0F, smallest = 0x800;
    } else if ((lead & 0xF8) == 0xF0) {
      length = 4, code_point = lead & 0x07, smallest = 0x10000;
    } else {
      return i;
    }
    if (length > size - i) return i;
    for (size_t k = 1; k < length; ++k) {
      if ((bytes[i + k] & 0xC0) != 0x80) return i;
      code_point = (code_point << 6) | (bytes[i + k] & 0x3F);
    }
    const bool surrogate = code_point >= 0xD800 && code_point <= 0xDFFF;
    if (code_point < smallest || code_point > 0x10FFFF || surrogate) return i;
    i += length;
  }
  return kNotFound;
}

// One flat scan of JSON text, no recursion: `visit(i, c, string_length)` sees
// every byte outside strings (c != '"') and each string's closing quote
// (c == '"', with the string's length); the first offset it returns true at,
// or kNotFound.
template <typename Visit>
size_t scan_outside_strings(const std::string& text, Visit visit) {
  size_t string_start = 0;
  bool in_string = false;
  bool escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (!in_string && c == '"') {
      in_string = true;
      string_start = i + 1;
    } else if (!in_string) {
      if (visit(i, c, size_t{0})) return i;
    } else if (escaped) {
      escaped = false;
    } else if (c == '\\') {
      escaped = true;
    } else if (c == '"') {
      in_string = false;
      if (visit(i, c, i - string_start)) return i;
    }
  }
  return kNotFound;
}

// Offset of the first '[' or '{' (outside strings) that opens level max_depth + 1.
size_t find_excess_nesting(const std::string& text, int max_depth) {
  int depth = 0;
  return scan_outside_strings(text, [&](size_t, char c, size_t) {
    if (c == '[' || c == '{') return ++depth > max_depth;
    if ((c == ']' || c == '}') && depth > 0) --depth;  // unbalanced closers are left for the parser to report
    return false;
  });
}

// What the DOM costs per token of the text (nlohmann::json on libstdc++,
// malloc's per-block overhead included; measured: "[{},{},...]" 82 bytes an
// element, "[\"\",...]" 63, "[1,2,...]" 17): a value is a 16-byte slot in its
// container, a container adds its heap vector or map, an object member a map
// node, a string its heap std::string, with the characters past 15 on the heap.
constexpr size_t kElementBytes = 24;    // per ',': one more slot, some spare capacity
constexpr size_t kContainerBytes = 64;  // per '[' or '{': the container and its first slot
constexpr size_t kMemberBytes = 48;     // per ':': a map node (its key counted as a string)
constexpr size_t kStringBytes = 48;     // per string: a heap std::string
constexpr size_t kShortString = 15;     // libstdc++ keeps up to 15 characters inline

// Offset at which the DOM of `text` would pass `budget` bytes, by the costs
// above, found by a flat scan: text made of empty containers, empty strings
// or one-character members costs 20-30x its size, a real manifest (long
// arrays of integers, a few objects) a few times its size.
size_t find_costly_structure(const std::string& text, size_t budget) {
  size_t cost = 0;
  return scan_outside_strings(text, [&](size_t, char c, size_t string_length) {
    if (c == '"') {  // counted; the budget is judged at the next structural byte
      cost += kStringBytes + (string_length > kShortString ? string_length + 1 : 0);
      return false;
    }
    if (c == '[' || c == '{') {
      cost += kContainerBytes;
    } else if (c == ',') {
      cost += kElementBytes;
    } else if (c == ':') {
      cost += kMemberBytes;
    } else {
      return false;
    }
    return cost > budget;
  });
}

// nlohmann prefixes "[json.exception.parse_error.101] "; users need the rest.
std::string strip_nlohmann_prefix(const std::string& message) {
  if (!message.empty() && message[0] == '[') {
    const size_t close = message.find("] ");
    if (close != kNotFound) return message.substr(close + 2);
  }
  return message;
}

std::string lower_ascii(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return text;
}

// The spellings Python, JavaScript and C print for non-finite floats.
std::optional<double> special_number(const std::string& text) {
  const std::string word = lower_ascii(text);
  const double inf = std::numeric_limits<double>::infinity();
  if (word == "nan" || word == "-nan" || word == "+nan") {
    return std::numeric_limits<double>::quiet_NaN();
  }
  if (word == "inf" || word == "+inf" || word == "infinity" || word == "+infinity") return inf;
  if (word == "-inf" || word == "-infinity") return -inf;
  return std::nullopt;
}

// Finds where a text the DOM parser refused for a reason other than syntax
// (a number no double can hold: out_of_range.406 carries no offset) stops
// being acceptable, by re-reading it with a SAX handler that only records the
// position nlohmann hands to parse_error.
class ErrorLocator : public nlohmann::json_sax<nlohmann::json> {
 public:
  std::optional<size_t> position;

  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return true; }
  bool key(string_t&) override { return true; }
  bool end_object() override { return true; }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t at, const std::string&, const nlohmann::detail::exception&) override {
    position = at;
    return false;
  }
};

}  // namespace

nlohmann::json parse_json_guarded(const std::string& text, const std::string& file_label,
                                  int max_depth, uint64_t byte_base) {
  if (text.size() > kMaxJsonBytes) {
    throw InputError(file_label, byte_key(byte_base + kMaxJsonBytes),
                     "expected at most " + std::to_string(kMaxJsonBytes >> 20) +
                         " MiB of JSON, got " + std::to_string(text.size()) + " bytes");
  }
  const size_t bad_utf8 = find_invalid_utf8(text);
  if (bad_utf8 != kNotFound) {
    throw InputError(file_label, byte_key(byte_base + bad_utf8),
                     "expected UTF-8 text, found an invalid byte sequence");
  }
  const size_t too_deep = find_excess_nesting(text, max_depth);
  if (too_deep != kNotFound) {
    throw InputError(file_label, byte_key(byte_base + too_deep),
                     "expected JSON nested at most " + std::to_string(max_depth) +
                         " levels deep, found deeper nesting");
  }
  const size_t costly = find_costly_structure(text, kMaxJsonDomBytes);
  if (costly != kNotFound) {
    throw InputError(file_label, byte_key(byte_base + costly),
                     "expected JSON whose parsed form fits " + std::to_string(kMaxJsonDomBytes >> 20) +
                         " MiB; by here it would need more (text dense with empty or tiny values)");
  }
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& error) {
    // error.byte is 1-based (the last character read).
    const uint64_t offset = error.byte > 0 ? error.byte - 1 : 0;
    throw InputError(file_label, byte_key(byte_base + offset),
                     "invalid JSON: " + strip_nlohmann_prefix(error.what()));
  } catch (const nlohmann::json::exception& error) {
    // Valid syntax nlohmann still refuses, such as 1e400 (out_of_range.406).
    ErrorLocator locator;
    nlohmann::json::sax_parse(text, &locator);
    const size_t at = locator.position.value_or(1);
    throw InputError(file_label, byte_key(byte_base + (at > 0 ? at - 1 : 0)),
                     "invalid JSON: " + strip_nlohmann_prefix(error.what()));
  }
}

std::string json_describe(const nlohmann::json& value) {
  constexpr size_t kMaxShown = 40;
  switch (value.type()) {
    case nlohmann::json::value_t::array:
      return "an array";
    case nlohmann::json::value_t::object:
      return "an object";
    case nlohmann::json::value_t::string: {
      std::string shown = value.get_ref<const std::string&>();
      if (shown.size() > kMaxShown) shown = shown.substr(0, kMaxShown) + "...";
      // `replace` keeps a string cut inside a UTF-8 sequence printable.
      return nlohmann::json(shown).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    }
    case nlohmann::json::value_t::binary:
    case nlohmann::json::value_t::discarded:
      return "an invalid value";
    default:
      return value.dump();  // null, booleans and numbers print as written
  }
}

double number_from_json(const nlohmann::json& value, const std::string& file_label,
                   const std::string& key_path) {
  if (value.is_number()) return value.get<double>();
  if (value.is_string()) {
    if (auto special = special_number(value.get_ref<const std::string&>())) return *special;
  }
  throw InputError(file_label, key_path,
                   "expected a number (or \"nan\", \"inf\", \"-inf\"), got " +
                       json_describe(value));
}

int64_t json_integer(const nlohmann::json& value, const std::string& file_label,
                     const std::string& key_path) {
  if (value.is_number_unsigned()) {
    const uint64_t unsigned_value = value.get<uint64_t>();
    if (unsigned_value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      throw InputError(file_label, key_path,
                       "expected an integer below 2^63, got " + json_describe(value));
    }
    return static_cast<int64_t>(unsigned_value);
  }
  if (value.is_number_integer()) return value.get<int64_t>();
  throw InputError(file_label, key_path, "expected an integer, got " + json_describe(value));
}

JsonReader::JsonReader(const nlohmann::json& obj, std::string file_label, std::string path)
    : obj_(obj), file_(std::move(file_label)), path_(std::move(path)) {
  if (!obj_.is_object()) {
    throw InputError(file_, path_, "expected a JSON object, got " + json_describe(obj_));
  }
}

std::string JsonReader::key_path(const std::string& key) const {
  return path_.empty() ? key : path_ + "." + key;
}

bool JsonReader::has(const std::string& key) const {
  const auto it = obj_.find(key);
  return it != obj_.end() && !it->is_null();
}

const nlohmann::json& JsonReader::get(const std::string& key) const {
  const auto it = obj_.find(key);
  if (it == obj_.end()) throw InputError(file_, key_path(key), "required key is missing");
  return *it;
}

JsonReader JsonReader::object(const std::string& key) const {
  return JsonReader(get(key), file_, key_path(key));
}

std::optional<JsonReader> JsonReader::optional_object(const std::string& key) const {
  if (!has(key)) return std::nullopt;
  return object(key);
}

const nlohmann::json& JsonReader::array(const std::string& key) const {
  const nlohmann::json& value = get(key);
  if (!value.is_array()) {
    throw InputError(file_, key_path(key), "expected an array, got " + json_describe(value));
  }
  return value;
}

std::string JsonReader::string(const std::string& key) const {
  const nlohmann::json& value = get(key);
  if (!value.is_string()) {
    throw InputError(file_, key_path(key), "expected a string, got " + json_describe(value));
  }
  return value.get<std::string>();
}

std::optional<std::string> JsonReader::optional_string(const std::string& key) const {
  if (!has(key)) return std::nullopt;
  return string(key);
}

int64_t JsonReader::integer(const std::string& key) const {
  return json_integer(get(key), file_, key_path(key));
}

std::optional<int64_t> JsonReader::optional_integer(const std::string& key) const {
  if (!has(key)) return std::nullopt;
  return integer(key);
}

double JsonReader::number(const std::string& key) const {
  return number_from_json(get(key), file_, key_path(key));
}

std::optional<double> JsonReader::optional_number(const std::string& key) const {
  if (!has(key)) return std::nullopt;
  return number(key);
}

bool JsonReader::boolean(const std::string& key) const {
  const nlohmann::json& value = get(key);
  if (!value.is_boolean()) {
    throw InputError(file_, key_path(key),
                     "expected true or false, got " + json_describe(value));
  }
  return value.get<bool>();
}

std::optional<bool> JsonReader::optional_boolean(const std::string& key) const {
  if (!has(key)) return std::nullopt;
  return boolean(key);
}

}  // namespace nanreplay
