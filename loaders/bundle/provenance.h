// The manifest's optional "provenance" block: for each value a writer settled
// (nanreplay import, the capture helper), where it came from. A value "from"
// "default" is one no checkpoint, config or flag gave: the first suspect when
// the replay does not reproduce the run.
#pragma once

#include <string>
#include <vector>

#include "loaders/base/json_util.h"
#include "loaders/bundle/manifest.h"

namespace nanreplay {

// Bounded: at most kMaxProvenanceEntries entries, each text at most
// kMaxProvenanceText bytes; a wrong type throws InputError naming the key.
constexpr size_t kMaxProvenanceEntries = 4096;
constexpr size_t kMaxProvenanceText = 2000;
std::vector<ValueSource> parse_provenance(const JsonReader& block);

// The entries whose value was defaulted ("from": "default"), in manifest order.
std::vector<ValueSource> defaulted_values(const std::vector<ValueSource>& provenance);

// "model.norm_eps = 1e-05 (llama2.c's default ...); ...": one line for a report.
std::string describe_defaulted(const std::vector<ValueSource>& defaulted);

}  // namespace nanreplay
