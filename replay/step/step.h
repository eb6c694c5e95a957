// One training step replayed, the one way every caller replays a step: `run`
// (full probes), bisect's cheap pass (one all-finite flag per site, stopping
// once the step is known bad), what-ifs (with overrides), the determinism and
// cross-device re-runs, the synthetic trainer and the benchmarks (no probes).
// Every rank's micro-batches forward and backward as DDP with gradient
// accumulation and a loss scaler computes them, gradients accumulated over
// micro-batches, averaged over ranks and unscaled (before clipping); then
// the parameter-gradient probes. One rule (judge_step) says whether the step
// holds the incident, so "bisect names what run names" holds by construction.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "loaders/bundle/bundle.h"
#include "replay/step/checkpoint.h"
#include "replay/step/gradients.h"
#include "replay/step/layer_stream.h"
#include "replay/probing/probe_session.h"
#include "reports/results/report.h"

namespace nanreplay {

// What a what-if changes in a step's replay; default: nothing. Each what-if
// is a row of replay/workflows/what_if.cpp that fills these.
struct StepOverrides {
  std::set<int64_t> dropped_samples;  // rows removed from their micro-batches
  // Edits the model the step computes (a norm eps, a soft cap, QK-norm, a
  // router loss coefficient), applied to a copy of the manifest's.
  std::function<void(ModelConfig&)> change_model;
  NumericsOverrides numerics;
  std::optional<std::map<std::string, Fp8ModuleScales>> fp8_scales;  // replace the step's
};

// Called before each forward and each backward: (rank, micro-batch, "forward" | "backward").
// May throw to stop the replay (interrupts).
using PassProgress = std::function<void(int rank, int micro_batch, const char* phase)>;

// One forward and backward of a step: a rank's micro-batch.
struct PassRef {
  int rank = 0;
  int micro_batch = 0;
};

struct StepRequest {
  ProbeLevel probes = ProbeLevel::kFull;
  // Only this pass (the determinism check's re-run): its forward and
  // backward records; no step gradients, so `complete` is false.
  std::optional<PassRef> only_pass;
  StepOverrides overrides;
  // kFlags: skip the passes after the first micro-batch whose flags settle
  // that the step is bad (in fp16 only a forward flag settles it: the loss
  // scaler's verdict needs the whole step otherwise).
  bool stop_at_first_bad = false;
  // bf16/fp16 matmuls in the low type on a GPU instead of emulated by rounding fp32.
  bool native_low_precision = false;
  // Probe host tensors as device ones are (statistics left where they are,
  // read back once at the step's end): the tests' way to that path on a CPU.
  bool defer_host_probes = false;
  // A spike incident: forward records also name their largest element's
  // sample and position (replay/probing/largest_element.h).
  bool locate_largest = false;
  // A mixture of experts: StepResult::router_logit_max and ::router_tokens (a spike incident's
  // evidence, report.json's per-step maxima). The tokens are also taken whenever the model
  // derives its correction bias (model.moe.score_bias_update): rolling forward reads them.
  bool router_logit_max = false;
  // StepResult::attn_logit_max whatever the optimizer (report.json's per-step
  // maxima, the qk-clip what-if), and StepResult::expert_activation_max.
  bool attn_logit_max = false;
  bool expert_activation_max = false;
  PassProgress before_pass;
  // A layer-streamed replay: called before each block of each pass,
  // (rank, micro-batch, layer, "forward" | "backward"). May throw to stop.
  std::function<void(int rank, int micro_batch, int layer, const char* phase)> on_block;
};

struct StepResult {
  double loss = 0.0;                 // mean over ranks of the mean over micro-batches
  std::vector<double> rank_losses;
  // [rank][micro-batch]: each pass's own loss, in pass order (what a job that
  // prints its last micro-batch's loss logs, nanoGPT and llama2.c among them).
  std::vector<std::vector<double>> micro_batch_losses;
  std::vector<double> rank_grad_norms;
  double grad_norm = 0.0;            // global norm before clipping (clip_grad_norm_'s)
  // Per parameter in the checkpoint's order: on the host (in memory or on
  // the layer-streamed replay's scratch files), or where computed at kFlags.
  GradientSet grads;
  // Forward and backward records of every pass, then the parameter
  // gradients' (every one at kFull, the non-finite ones at kFlags).
  std::vector<ProbeRecord> probes;
  std::vector<NormCheck> norm_checks;     // kFull
  std::vector<SampleLoss> sample_losses;  // kFull
  int64_t passes = 0;
  bool complete = true;  // every pass ran: loss, gradients and grad_norm hold
  std::map<std::pair<int, int>, std::vector<int64_t>> rows_of_pass;  // (micro-batch, rank) -> samples
  // [layer][query head]: the largest scaled pre-softmax logit over every pass,
  // recorded only when the optimizer asks for MuonClip (qk_clip).
  std::vector<std::vector<double>> attn_logit_max;
  // [layer][expert]: the largest raw router logit over every pass, when the
  // request asks (-inf for a layer without experts; every process's under --nproc).
  std::vector<std::vector<double>> router_logit_max;
  // [layer][expert]: the tokens each router sent to each expert over every
  // pass, micro-batch, rank and process, when router_logit_max is asked for or
  // the model derives its correction bias; empty otherwise. Counted per
  // forward of a block: a layer-streamed replay, whose backward computes each
  // block again, counts every token twice (as torchtitan does under activation
  // checkpointing; the bias update reads only the sign of mean - count).
  // report.json's expert_tokens come from the probe records instead.
  std::vector<std::vector<int64_t>> router_tokens;
  // The correction bias the step's router added (DeepSeek-V3's
  // e_score_correction_bias, after any what-if); none for another router.
  std::optional<RouterScoreBias> score_bias;
  // [layer]: per expert, max |input| and |output| of its MLP over every pass,
  // when the request asks (none: a layer without experts, or another process's).
  std::vector<std::optional<std::vector<ExpertActivationMax>>> expert_activation_max;
};

// The step's arithmetic under overrides: model config, fp8 scales, numerics, loss scale.
struct StepArithmetic {
  ModelConfig model;
  std::map<std::string, Fp8ModuleScales> fp8_scales;
  Numerics numerics;
  double loss_scale = 1.0;
  std::optional<RouterScoreBias> score_bias;  // model.moe->step_score_bias, where it came from

  StepArithmetic(const Manifest& m, const StepState& state, const StepOverrides& overrides, bool native);
  StepArithmetic(const StepArithmetic&) = delete;  // numerics points into fp8_scales
  StepArithmetic& operator=(const StepArithmetic&) = delete;
};

// What the step inputs are, whatever holds the parameters.
struct StepInputs {
  const Manifest& manifest;
  const TokenStream& tokens;
  int64_t step;
  const StepState& state;
  const StepBatch& batch;
};

class StepModel;  // replay/step/step_model.h

// The step on parameters held as `model` says, named in `order`.
StepResult replay_step(const StepInputs& inputs, StepModel& model, const std::vector<std::string>& order,
                       const StepRequest& request);
// The step from parameters in memory (the synthetic trainer's).
StepResult replay_step(const StepInputs& inputs, ParamMap& params, const std::vector<std::string>& order,
                       const StepRequest& request);
// The step from its checkpoint, computed where `placement` says.
StepResult replay_step(const StepInputs& inputs, ModelCheckpoint& checkpoint, const ComputePlacement& placement,
                       const StepRequest& request);

// Whether a replayed step holds the incident: its earliest non-finite value
// in execution order (micro-batch, phase, site, rank; the parameter gradients
// last), except that in fp16 a step whose forward and loss stayed finite and
// whose gradients are non-finite is the loss scaler's handled overflow.
struct StepJudgement {
  const ProbeRecord* first = nullptr;  // the origin, when bad
  const ProbeRecord* handled_first = nullptr;  // the first non-finite value the scaler absorbs
  bool bad = false;
  bool scaler_skips = false;     // fp16: non-finite gradients, GradScaler skips the step
  bool handled_overflow = false;
};
StepJudgement judge_step(const StepResult& result, Compute compute);

// The rows of one rank's micro-batch, less the dropped samples.
std::vector<int64_t> micro_batch_rows(const StepBatch& batch, const DataConfig& data, int rank, int micro,
                                      const std::set<int64_t>& dropped);

}  // namespace nanreplay
