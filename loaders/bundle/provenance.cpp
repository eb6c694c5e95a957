// The manifest's "provenance" block (docs/bundle-format.md, "Provenance").
#include "loaders/bundle/provenance.h"

#include <optional>
#include <utility>

#include "loaders/base/error.h"

namespace nanreplay {
namespace {

std::string bounded_text(const JsonReader& entry, const std::string& key, bool required) {
  const std::optional<std::string> text =
      required ? std::optional<std::string>(entry.string(key)) : entry.optional_string(key);
  if (text && text->size() > kMaxProvenanceText) {
    throw InputError(entry.file(), entry.key_path(key),
                     "longer than " + std::to_string(kMaxProvenanceText) + " bytes");
  }
  return text.value_or("");
}

}  // namespace

std::vector<ValueSource> parse_provenance(const JsonReader& block) {
  const nlohmann::json& items = block.json();
  if (items.size() > kMaxProvenanceEntries) {
    throw InputError(block.file(), "provenance", "more than " + std::to_string(kMaxProvenanceEntries) + " entries");
  }
  std::vector<ValueSource> out;
  for (auto it = items.begin(); it != items.end(); ++it) {
    const JsonReader entry = block.object(it.key());
    ValueSource source;
    source.key = it.key();
    source.from = bounded_text(entry, "from", true);
    source.detail = bounded_text(entry, "detail", false);
    if (entry.has("value")) {
      const nlohmann::json& value = entry.json().at("value");
      if (value.is_object() || (value.is_array() && value.size() > 16)) {
        throw InputError(entry.file(), entry.key_path("value"), "expected a number, string, boolean or short list");
      }
      source.value = value.dump();
      if (source.value.size() > kMaxProvenanceText) {
        throw InputError(entry.file(), entry.key_path("value"),
                         "longer than " + std::to_string(kMaxProvenanceText) + " bytes");
      }
    }
    out.push_back(std::move(source));
  }
  return out;
}

std::vector<ValueSource> defaulted_values(const std::vector<ValueSource>& provenance) {
  std::vector<ValueSource> out;
  for (const ValueSource& source : provenance) {
    if (source.from == "default") out.push_back(source);
  }
  return out;
}

std::string describe_defaulted(const std::vector<ValueSource>& defaulted) {
  std::string out;
  for (const ValueSource& source : defaulted) {
    if (!out.empty()) out += "; ";
    out += source.key + (source.value.empty() ? "" : " = " + source.value);
    if (!source.detail.empty()) out += " (" + source.detail + ")";
  }
  return printable(out);
}

}  // namespace nanreplay
