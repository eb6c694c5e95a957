// The incident entry points of `run`, `demo` and `bisect`; see incident.h.
#include "replay/workflows/incident.h"

#include <algorithm>

#include "loaders/bundle/bundle_paths.h"
#include "loaders/base/error.h"
#include "loaders/base/mapped_file.h"
#include "nanreplay_version.h"
#include "replay/step/bundle_structure.h"
#include "replay/step/ranks/distributed.h"
#include "replay/probing/probe_retention.h"
#include "replay/step/runtime.h"

namespace nanreplay {

namespace {

// The process-wide settings, before the bundle is opened.
const IncidentSettings& prepare_process(const IncidentSettings& settings, IncidentUse use) {
  set_compute_threads(settings.threads);
  validate_devices(settings.devices, settings.cross_check);
  if (use == IncidentUse::kReplay) tune_heap_for_replay();
  return settings;
}

// Where the scratch directory goes: an existing directory outside the bundle
// (the tool never writes into one), on one device.
std::filesystem::path checked_scratch(const IncidentSettings& settings, const std::filesystem::path& bundle) {
  namespace fs = std::filesystem;
  if (settings.devices.size() > 1 && !settings.cross_check) {
    throw UsageError("--device " + settings.devices[0] + "," + settings.devices[1] +
                     ": a layer-streamed replay computes on one device (it streams the layers from host memory)");
  }
  const fs::path parent = settings.scratch ? *settings.scratch : fs::temp_directory_path();
  std::error_code error;
  if (!fs::is_directory(parent, error)) {
    throw UsageError("--scratch " + parent.string() + ": not a directory");
  }
  if (lies_inside_directory(parent, bundle)) {
    throw UsageError("--scratch " + parent.string() + ": inside the bundle, which the tool never writes into");
  }
  return parent;
}

// "none", "3" or "0-15", as the terminal shows a process's layers or ranks.
std::string range_text(const IndexRange& r) {
  if (r.first == r.end) return "none";
  return r.first + 1 == r.end ? std::to_string(r.first) : std::to_string(r.first) + "-" + std::to_string(r.end - 1);
}

size_t count_selected_steps(const Bundle& bundle, const std::optional<std::set<int64_t>>& only_steps) {
  size_t count = 0;
  for (const StepFiles& files : bundle.steps()) {
    if (!only_steps || only_steps->count(files.step)) ++count;
  }
  return count;
}

// "0-3, 7, 9-10" for sorted steps; the first eight runs and "..." for more.
std::string step_ranges_text(const std::vector<int64_t>& steps) {
  std::string text;
  size_t runs = 0;
  for (size_t i = 0; i < steps.size();) {
    size_t last = i;
    while (last + 1 < steps.size() && steps[last + 1] == steps[last] + 1) ++last;
    if (++runs > 8) return text + ", ...";
    text += (text.empty() ? "" : ", ") + std::to_string(steps[i]) +
            (last > i ? "-" + std::to_string(steps[last]) : "");
    i = last + 1;
  }
  return text;
}

// A --steps selection that names no step of the bundle would replay nothing
// and report "not reproduced": refused, naming what the bundle has.
void refuse_empty_selection(const Bundle& bundle, const std::optional<std::set<int64_t>>& only_steps) {
  if (!only_steps || count_selected_steps(bundle, only_steps) > 0) return;
  std::vector<int64_t> present;
  for (const StepFiles& files : bundle.steps()) present.push_back(files.step);
  const std::vector<int64_t> asked(only_steps->begin(), only_steps->end());
  throw UsageError("--steps " + step_ranges_text(asked) + ": selects no step of the bundle, which has step(s) " +
                   step_ranges_text(present));
}

}  // namespace

Incident::Incident(const IncidentSettings& settings, IncidentUse use)
    : settings_(prepare_process(settings, use)),
      bundle_(settings_.bundle),
      steps_to_replay_(count_selected_steps(bundle_, settings_.only_steps)) {
  refuse_empty_selection(bundle_, settings_.only_steps);
  for (const WhatIf& w : settings_.what_ifs) check_what_if(w, bundle_.manifest());
  // Refused before any checkpoint is opened or any output directory created.
  // `run` streams each step's probe records to the trace and keeps only the steps that matter.
  const size_t steps_with_probes = std::min(steps_to_replay_, ProbeRetention::kMostStepsHeld);
  const size_t held = use == IncidentUse::kReplay ? steps_with_probes : 1;
  const bool probes = use == IncidentUse::kBisect || settings_.probes;
  const Manifest& m = bundle_.manifest();
  const MemoryEstimate in_memory = estimate_replay_memory(m, held, probes, bundle_.rolls_forward());
  const MemoryLimit limit = settings_.max_memory ? *settings_.max_memory : default_memory_limit();
  const MemoryEstimate streamed = estimate_streamed_memory(m, held, probes, bundle_.rolls_forward());
  if (ProcessWorld* world = default_world()) {
    share_across_processes(*world, in_memory, streamed, limit);
  } else if (choose_layer_streaming(in_memory, streamed, limit, settings_.stream)) {
    scratch_parent_ = checked_scratch(settings_, bundle_.root());
    mode_note_ = "replaying layer by layer (" +
                      (settings_.stream ? std::string("--stream")
                                        : "in memory it needs an estimated " + format_bytes(in_memory.total()) +
                                              ", more than the limit of " +
                                              format_bytes(static_cast<double>(limit.bytes))) +
                      "); scratch files in " + scratch_parent_->string();
  }
  // Every structural fault `inspect` reports, before any work or output.
  validate_bundle_structure(bundle_);
}

// Across processes each replays whole data-parallel ranks of the bundle (in
// memory or streamed, as one process would), or computes its own layers of
// every pass (replay/step/ranks/distributed.h).
void Incident::share_across_processes(ProcessWorld& world, const MemoryEstimate& in_memory,
                                      const MemoryEstimate& streamed, const MemoryLimit& limit) {
  if (settings_.devices.size() > 1) {
    throw UsageError("--device " + settings_.devices[0] + "," + settings_.devices[1] +
                     ": a replay split across processes computes on one device in each");
  }
  const int data_ranks = static_cast<int>(bundle_.manifest().data.world_size);
  const bool fits = in_memory.total() <= static_cast<double>(limit.bytes);
  const bool by_ranks = settings_.split ? *settings_.split == ProcessSplit::kRanks : data_ranks >= 2 && fits;
  mode_note_ = "replaying across " + std::to_string(world.size()) + " processes, ";
  if (by_ranks) {
    world.set_split(ProcessSplit::kRanks, data_ranks);
    mode_note_ += "the bundle's data-parallel ranks:";
    for (int p = 0; p < world.size(); ++p) {
      mode_note_ += (p == 0 ? " " : ", ") + range_text(rank_block(data_ranks, world.size(), p)) + " on " + world.who(p);
    }
    if (choose_layer_streaming(in_memory, streamed, limit, settings_.stream)) {
      scratch_parent_ = checked_scratch(settings_, bundle_.root());
      mode_note_ += "; each streams layer by layer, scratch files in " + scratch_parent_->string();
    }
    return;
  }
  // By layers: a process keeps its blocks in memory between passes when its
  // share of the in-memory estimate fits its limit, else streams them
  // (--stream: always); its gradients go to scratch files.
  world.set_split(ProcessSplit::kLayers);
  const int layers = static_cast<int>(bundle_.manifest().model.num_layers);
  const std::vector<IndexRange> ranges = world.layer_ranges(layers);
  const IndexRange& mine = ranges.at(static_cast<size_t>(world.rank()));
  const double share = in_memory.total() * (mine.end - mine.first) / std::max(layers, 1);
  world.set_keep_blocks(!settings_.stream && share <= static_cast<double>(limit.bytes));
  scratch_parent_ = checked_scratch(settings_, bundle_.root());
  mode_note_ += "layers";
  for (size_t p = 0; p < ranges.size(); ++p) {
    mode_note_ += (p == 0 ? " " : ", ") + range_text(ranges[p]) + " on " + world.who(static_cast<int>(p));
  }
  const char* blocks = world.keep_blocks() ? "keeps its blocks in memory" : "streams its blocks";
  mode_note_ += "; this process " + std::string(blocks) + ", its gradients on scratch files in " +
                scratch_parent_->string();
}

std::function<bool()> Incident::poll(const IncidentHooks& hooks) const {
  return [stop = hooks.stop_requested] {
    throw_if_mapped_file_changed();
    return stop && stop();
  };
}

ReplayReport Incident::replay(const IncidentHooks& hooks) const {
  ReplayOptions options;
  options.probes = settings_.probes;
  options.only_steps = settings_.only_steps;
  options.tool_version = NANREPLAY_VERSION;
  options.on_progress = hooks.on_replay_progress;
  options.devices = settings_.devices;
  options.cross_check = settings_.cross_check;
  options.native_low_precision = settings_.native_low_precision;
  options.should_stop = poll(hooks);
  options.on_step_probes = hooks.on_step_probes;
  options.stream_scratch = scratch_parent_;
  options.spike = settings_.spike;
  ReplayReport report = replay_bundle(bundle_, options);
  if (!settings_.what_ifs.empty()) {
    const auto before_pass = [&] {
      if (options.should_stop()) throw Interrupted(interrupted_after_steps(steps_to_replay_, steps_to_replay_));
    };
    const PhaseTimer timer(report.timings, TimedPhase::kWhatIfs);
    report.what_if = evaluate_what_ifs(bundle_, report.first_nonfinite, settings_.what_ifs, before_pass,
                                       {settings_.devices.front()}, settings_.native_low_precision, scratch_parent_);
  }
  throw_if_mapped_file_changed();
  return report;
}

BisectReport Incident::bisect(const IncidentHooks& hooks, bool minimize_samples) const {
  BisectOptions options;
  options.minimize_samples = minimize_samples;
  options.what_ifs = settings_.what_ifs;
  options.on_progress = hooks.on_bisect_progress;
  options.should_stop = poll(hooks);
  options.tool_version = NANREPLAY_VERSION;
  options.devices = settings_.devices;
  options.native_low_precision = settings_.native_low_precision;
  options.stream_scratch = scratch_parent_;
  BisectReport report = bisect_bundle(bundle_, options);
  throw_if_mapped_file_changed();
  return report;
}

}  // namespace nanreplay
