// What `nanreplay synth` and `nanreplay demo` share: they create a bundle
// directory, never inside an existing bundle, and never leave half of one.
#pragma once

#include <filesystem>

#include "synth/synthetic_bundle.h"

namespace nanreplay {

// UsageError when `dir` is or would lie inside a bundle.
void refuse_inside_a_bundle(const std::filesystem::path& dir);

// Writes a synthetic bundle into `dir` (absent or empty). A stop signal waits
// for the writer, which builds the bundle under a temporary name; then what
// it wrote is removed and Interrupted thrown: nothing half-written.
SyntheticOutcome write_bundle_for_user(const std::filesystem::path& dir, const SyntheticSpec& spec);

}  // namespace nanreplay
