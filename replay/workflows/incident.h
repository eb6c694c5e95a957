// An incident bundle opened for `nanreplay run`, `demo` or `bisect`: every
// check those commands make before any work, in one order for all three (the
// thread count, the devices, the bundle, the what-ifs against its manifest,
// the memory estimate against its limit, the structure `inspect` checks),
// then the replay itself into a report. Never prints and never exits: a stop
// request ends a replay with Interrupted (loaders/base/error.h). No LibTorch types here.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "loaders/bundle/bundle.h"
#include "replay/workflows/bisect.h"
#include "replay/step/ranks/distributed.h"
#include "replay/step/memory_estimate.h"
#include "replay/workflows/replay_engine.h"
#include "replay/workflows/what_if.h"

namespace nanreplay {


struct IncidentSettings {
  std::filesystem::path bundle;
  // "cpu", "cuda:N", or two devices: the layers split across them (or, with
  // cross_check, the step of interest replayed on each and compared).
  std::vector<std::string> devices{"cpu"};
  bool cross_check = false;
  bool native_low_precision = true;       // bf16/fp16 natively on a GPU
  int threads = 0;                        // compute threads, 0: all cores
  std::optional<MemoryLimit> max_memory;  // unset: default_memory_limit()
  std::vector<WhatIf> what_ifs;           // replayed at the first non-finite step
  bool probes = true;                     // replay: probes on every site
  std::optional<std::set<int64_t>> only_steps;  // replay: default every step
  // Replay layer by layer (replay/step/layer_stream.h) even when the model fits in
  // memory; unset, only when it does not.
  bool stream = false;
  // Where a streamed replay's scratch directory goes (default: the system's
  // temporary directory; `run` passes the directory beside --out).
  std::optional<std::filesystem::path> scratch;
  // Across processes (replay/step/ranks/distributed.h): split the layers or the
  // bundle's data-parallel ranks; unset: the ranks when the bundle has
  // several and the model fits each process's memory, else the layers.
  std::optional<ProcessSplit> split;
  SpikeOverrides spike;  // run's --incident-kind and --spike-* (docs/spikes.md)
};

// What the incident is opened for. A replay keeps every step's probe records
// (the memory estimate counts the steps it replays) and tunes the heap for
// it; bisect holds one step at a time, with probes.
enum class IncidentUse { kReplay, kBisect };

struct IncidentHooks {
  // Polled before every pass, after the check that no mapped bundle file
  // changed (InputError): true ends the replay with Interrupted.
  std::function<bool()> stop_requested;
  std::function<void(const ReplayProgress&)> on_replay_progress;
  std::function<void(const BisectProgress&)> on_bisect_progress;
  // A replay's probe records, step by step, for the trace (ReplayOptions::on_step_probes).
  std::function<void(const std::vector<ProbeRecord>&)> on_step_probes;
};

class Incident {
 public:
  // Opens the bundle and makes every check before any checkpoint is loaded:
  // UsageError for devices, what-ifs and the memory limit, InputError for
  // the bundle. Sets the process's compute threads (and, for a replay, its
  // heap settings).
  Incident(const IncidentSettings& settings, IncidentUse use);
  Incident(const Incident&) = delete;
  Incident& operator=(const Incident&) = delete;

  const Bundle& bundle() const { return bundle_; }
  // The bundle's steps the replay selects (all, or only_steps).
  size_t steps_to_replay() const { return steps_to_replay_; }
  // What the terminal says about how it replays: "replaying layer by layer
  // (...)", "replaying across N processes, ...", or "" (in memory, one process).
  const std::string& mode_note() const { return mode_note_; }

  // `run`: every selected step with probes (replay_bundle), the what-ifs at
  // its first non-finite value, then the mapped-file check the checks after
  // the last pass need (they read checkpoints too).
  ReplayReport replay(const IncidentHooks& hooks) const;
  // `bisect`: bisect_bundle with the settings' devices and what-ifs, then the
  // mapped-file check.
  BisectReport bisect(const IncidentHooks& hooks, bool minimize_samples) const;

 private:
  std::function<bool()> poll(const IncidentHooks& hooks) const;
  void share_across_processes(ProcessWorld& world, const MemoryEstimate& in_memory, const MemoryEstimate& streamed,
                              const MemoryLimit& limit);

  IncidentSettings settings_;
  Bundle bundle_;
  size_t steps_to_replay_ = 0;
  std::optional<std::filesystem::path> scratch_parent_;  // set: streamed
  std::string mode_note_;
};

}  // namespace nanreplay
