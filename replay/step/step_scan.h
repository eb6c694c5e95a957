// One step of a bundle replayed pass by pass, for bisection and what-if
// replays: the cheap any-non-finite scan of a step (one all-finite flag per
// site), full statistics on one block of one pass to name the element, and
// one pass over any subset of the step's samples. A pass, the unit of every
// replay count, is one forward and backward of one batch: a rank's
// micro-batch, or the rows a bisection picks. The arithmetic is the run's
// (replay_pass), so a flag is set exactly where `nanreplay run` sees a
// non-finite value.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "loaders/bundle/bundle.h"
#include "replay/step/checkpoint.h"
#include "replay/step/step.h"
#include "replay/step/step_model.h"
#include "reports/results/report.h"

namespace nanreplay {

// Called before every pass; may throw to stop the replay (interrupts, progress).
using PassHook = std::function<void()>;

// The manifest's entry of `step` (it must be listed).
const StepEntry& step_entry(const Manifest& manifest, int64_t step);

// The samples a step reads, per rank (the recorded ones where the manifest has them).
StepBatch batch_of_step(const Bundle& bundle, int64_t step);

// A token id >= vocab_size that a batch reads: the step cannot be replayed.
struct BatchToken {
  int rank = 0;
  int64_t sample = 0;
  int64_t position = 0;  // in the sample's window of seq_len + 1 tokens
  int64_t token = 0;
};
// The first `max_listed` of them, rank by rank, sample by sample.
std::vector<BatchToken> out_of_range_in_batch(const Bundle& bundle, const StepBatch& batch, size_t max_listed);

// Why a step cannot be replayed (a token id >= vocab_size in its batch), or none.
std::optional<std::string> unreplayable_reason(const Bundle& bundle, const StepBatch& batch);

// A step's checkpoint, state and batch, opened once and replayed many times.
class LoadedStep {
 public:
  // The checkpoint's parameters go where `placement` says (default: the host).
  // A step of a rolled-forward bundle is rolled to (replay/step/trajectory.h).
  LoadedStep(const Bundle& bundle, int64_t step, const ComputePlacement& placement = {});
  // A step whose parameters and state the caller already has (bisect rolling forward).
  LoadedStep(const Bundle& bundle, int64_t step, ModelCheckpoint checkpoint, StepState state,
             const ComputePlacement& placement = {});

  const Bundle& bundle() const { return bundle_; }
  int64_t step() const { return files_.step; }
  const StepState& state() const { return state_; }
  const StepBatch& batch() const { return batch_; }
  ModelCheckpoint& checkpoint() { return checkpoint_; }
  // The checkpoint as the replay computes with it (placed, or streamed).
  StepModel& model() { return *model_; }
  LoadedStep(const LoadedStep&) = delete;  // model_ refers to checkpoint_
  LoadedStep& operator=(const LoadedStep&) = delete;
  bool native_low_precision() const { return native_; }
  // Every sample of the step: rank by rank, micro-batch by micro-batch.
  std::vector<int64_t> samples() const;
  // Parameters already non-finite in this checkpoint, in the spec's order.
  std::vector<std::string> nonfinite_params() const;

 private:
  LoadedStep(const Bundle& bundle, int64_t step, struct RolledStart start, const ComputePlacement& placement);

  const Bundle& bundle_;
  const StepFiles& files_;
  StepState state_;
  StepBatch batch_;
  ModelCheckpoint checkpoint_;
  std::unique_ptr<StepModel> model_;
  bool native_ = false;
};

struct StepScan {
  int64_t step = 0;
  bool bad = false;             // holds a non-finite value `run` would name
  bool scaler_skips = false;    // fp16: the gradient norm is non-finite, GradScaler skips the step
  bool handled_overflow = false;  // fp16: only the backward overflowed; handled, not the incident
  std::optional<ProbeRecord> first;         // the earliest flag in execution order, when bad
  std::vector<int64_t> first_pass_samples;  // the rows of the pass holding `first`
  bool complete = false;        // every pass ran: loss and grad_norm hold
  double loss = 0.0;
  double grad_norm = 0.0;
  int64_t passes = 0;
};

// The step's replay as LoadedStep holds it, any probe level.
StepResult replay_loaded_step(LoadedStep& step, const StepRequest& request);

// The cheap pass over a step: every pass with one flag per site, ranks and
// micro-batches in `run`'s order. With `stop_at_first_bad`, passes after the
// first micro-batch whose flags settle the question are skipped.
// `result`, when given, receives the step's replay (its gradients roll a trajectory forward).
StepScan scan_step(LoadedStep& step, const StepOverrides& overrides, bool stop_at_first_bad,
                   const PassHook& before_pass, StepResult* result = nullptr);

// Full statistics on the block of `scan.first`, in the one pass that holds it
// (no pass for a parameter gradient): the element, head, sample and position.
// Adds the passes it ran to `passes`.
FirstNonfinite locate_first(LoadedStep& step, const StepOverrides& overrides, const StepScan& scan,
                            int64_t& passes, const PassHook& before_pass);

// One pass over `samples` with flags: whether it holds a non-finite value the
// loss scaler would not absorb (the scan's rule, for a one-pass step).
bool pass_fails(LoadedStep& step, const std::vector<int64_t>& samples, const PassHook& before_pass);

}  // namespace nanreplay
