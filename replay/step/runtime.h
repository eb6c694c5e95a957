// The process a replay runs in: which devices it may use, how many threads
// its tensor math takes, and heap settings that keep a long replay's memory
// at one step's. No LibTorch types here.
#pragma once

#include <string>
#include <vector>

namespace nanreplay {

// Checks --device values before anything is loaded: UsageError naming the
// value when it is malformed, asks for CUDA in a build or on a machine
// without it, names a device that does not exist, or combines --cross-check
// with anything but two devices of one kind.
void validate_devices(const std::vector<std::string>& devices, bool cross_check);

// Threads the replay's tensor math uses (0: all cores): LibTorch's, and a
// BLAS thread pool of its own (OpenBLAS pthreads) where there is one.
void set_compute_threads(int threads);

// The BLAS LibTorch's matrix products run on, as `nanreplay version` names
// it: OpenBLAS's own description and threading model ("OpenMP": LibTorch's
// libgomp pool, the one the build links first; "pthreads": a pool of its
// own beside it, docs/performance.md) and the file it was loaded from.
struct BlasInUse {
  std::string description = "unknown (not OpenBLAS)";
  std::string threading = "unknown";
  std::string path;
};
BlasInUse blas_in_use();

// Process-wide heap settings for replaying (glibc; elsewhere a no-op): the
// steady state glibc's adaptive thresholds reach only after LibTorch has freed
// a few large tensors (blocks below 32 MiB from the heap, up to 64 MiB of free
// top kept) set from the start. The first step then does not map and fault in
// every activation afresh, and every step peaks alike, so memory is the same
// for one step or many. Call once, before the first replay.
void tune_heap_for_replay();

// glibc keeps freed heap memory for reuse, and the activations and gradients
// of one step, freed in a different order than allocated, fragment its heap:
// without handing the free pages back, the resident set creeps up step after
// step. Called between steps, so a 10-step replay peaks where one step does.
void return_freed_memory();

}  // namespace nanreplay
