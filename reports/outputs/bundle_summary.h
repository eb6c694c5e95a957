// `nanreplay inspect`: what an incident bundle holds, validated without
// replaying: model and parameter count, precision, steps (optimizer state,
// logged loss), shards with their checksums, sampler, incident.
// Computes plain JSON; the terminal rendering is a separate pure function.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "loaders/bundle/bundle.h"

namespace nanreplay {

// Opens every step's state and model header (throws InputError on a bad one)
// and verifies the shard checksums; "valid" is false when one mismatches.
// "validated": "structure" and "faithfulness" say what valid does not mean.
// Call validate_bundle_structure first: that is what makes "valid" true.
nlohmann::json summarize_bundle(const Bundle& bundle);
std::string render_bundle_summary(const nlohmann::json& summary);

}  // namespace nanreplay
