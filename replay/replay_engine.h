// Replays every step of a bundle, forward and backward, on this machine:
// each rank's micro-batches in turn, with probes on every site, and names the
// first non-finite tensor in execution order (step, micro-batch, phase, site,
// rank). Holds at most one step's checkpoint at a time. No LibTorch types here.
#pragma once

#include <functional>
#include <optional>
#include <set>
#include <string>

#include "loaders/bundle.h"
#include "reports/report.h"
#include "reports/triage_rules.h"

namespace nanreplay {

struct ReplayProgress {
  size_t step_index = 0;  // 0-based among the steps being replayed
  size_t step_count = 0;
  int64_t step = 0;
  int rank = 0;
  int micro_batch = 0;
  std::string phase;  // "forward", "backward", "grad"
};

struct ReplayOptions {
  bool probes = true;
  std::optional<std::set<int64_t>> only_steps;  // default: every step
  std::function<void(const ReplayProgress&)> on_progress;
  std::function<bool()> should_stop;  // polled between micro-batches
  std::string tool_version;
  std::optional<TriageThresholds> thresholds;  // default: for the bundle's precision
  bool check_updates = true;      // model(s+1) against AdamW(model(s)): flipped bits
  bool check_determinism = true;  // one step replayed twice, compared bitwise
  // "cpu", "cuda:N", or two devices: the layers split across them, or with
  // cross_check the same step replayed on each and compared bit for bit.
  std::vector<std::string> devices{"cpu"};
  bool cross_check = false;
  // bf16/fp16 in the low type on a GPU ("native"); emulated by rounding fp32
  // elsewhere and when false.
  bool native_low_precision = true;
};

// Checks --device values before anything is loaded: UsageError naming the
// value when it is malformed, asks for CUDA in a build or on a machine
// without it, names a device that does not exist, or combines --cross-check
// with anything but two devices of one kind.
void validate_devices(const std::vector<std::string>& devices, bool cross_check);

// Thrown when should_stop() returned true; nothing has been written.
struct ReplayInterrupted {
  size_t steps_done = 0;
};

ReplayReport replay_bundle(const Bundle& bundle, const ReplayOptions& options);

}  // namespace nanreplay

namespace nanreplay {
// Threads the replay's tensor math uses (0: all cores): LibTorch's, and a
// BLAS thread pool of its own (OpenBLAS pthreads) where there is one.
void set_compute_threads(int threads);

// Whether LibTorch's BLAS runs matrix products on a thread pool of its own
// (OpenBLAS built with pthreads, as Debian's libopenblas0-pthread), beside
// LibTorch's OpenMP pool.
bool blas_has_own_thread_pool();

// Process-wide heap settings for replaying (glibc; elsewhere a no-op): the
// steady state glibc's adaptive thresholds reach only after LibTorch has freed
// a few large tensors (blocks below 32 MiB from the heap, up to 64 MiB of free
// top kept) set from the start. The first step then does not map and fault in
// every activation afresh, and every step peaks alike, so memory is the same
// for one step or many. Call once, before the first replay.
void tune_heap_for_replay();
}  // namespace nanreplay
