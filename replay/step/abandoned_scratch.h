// The layer-streamed replay's scratch directories (layer_stream.h's
// StreamScratch) once their run is gone. Each is named kScratchPrefix...
// and locked by its live owner (loaders/base/directory_lock.h); one whose
// lock can be taken was left by a process killed outright (SIGKILL, the OOM
// killer), which could not remove it, and may be removed by anyone.
#pragma once

#include <filesystem>
#include <vector>

namespace nanreplay {

constexpr const char* kScratchPrefix = "nanreplay-scratch-";

// Each scratch directory in `parent` whose lock is free, removed. Never
// throws (other runs add and remove theirs meanwhile).
void remove_abandoned_scratch(const std::filesystem::path& parent);

// The scratch directories process `pid` holds open (their locks), read from
// /proc/PID/fd: what a launcher about to kill a worker outright notes, to
// remove once it has reaped it. Empty when they cannot be read.
std::vector<std::filesystem::path> scratch_dirs_held_by(int pid);

// Each of `dirs` whose lock is free (its owner gone), removed. Never throws.
void remove_if_abandoned(const std::vector<std::filesystem::path>& dirs);

}  // namespace nanreplay
