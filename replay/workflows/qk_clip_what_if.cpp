// See qk_clip_what_if.h.
#include "replay/workflows/qk_clip_what_if.h"

#include <cmath>
#include <limits>
#include <vector>

#include <torch/torch.h>

#include "probes/nan_max.h"
#include "replay/optim/optimizer.h"
#include "reports/results/number_text.h"

namespace nanreplay {

namespace {

// The step's per-head maxima with `overrides` (probes off: the forward only matters).
HeadLogitMax measured_logit_max(LoadedStep& step, const StepOverrides& overrides, const PassHook& before_pass,
                                int64_t& passes) {
  StepRequest request;
  request.probes = ProbeLevel::kOff;
  request.overrides = overrides;
  request.attn_logit_max = true;
  if (before_pass) request.before_pass = [&](int, int, const char* phase) {
    if (std::string(phase) == "forward") before_pass();
  };
  const StepResult result = replay_loaded_step(step, request);
  passes += result.passes;
  return result.attn_logit_max;
}

}  // namespace

std::string qk_clip_step(LoadedStep& step, double tau, const ComputePlacement& placement, const PassHook& before_pass,
                         std::optional<LoadedStep>& clipped, int64_t& passes) {
  const Manifest& m = step.bundle().manifest();
  HeadLogitMax maxima = measured_logit_max(step, {}, before_pass, passes);
  bool refined = false;  // some head overflowed its precision: measured again in fp32
  for (const std::vector<double>& row : maxima) {
    for (double v : row) refined = refined || (!std::isfinite(v) && v != -std::numeric_limits<double>::infinity());
  }
  if (refined) {
    StepOverrides fp32_scores;
    fp32_scores.numerics.stable_softmax = true;
    const HeadLogitMax exact = measured_logit_max(step, fp32_scores, before_pass, passes);
    for (size_t l = 0; l < maxima.size(); ++l) {
      for (size_t h = 0; h < maxima[l].size(); ++h) {
        if (!std::isfinite(maxima[l][h])) maxima[l][h] = exact.at(l).at(h);
      }
    }
  }
  // Which heads MuonClip at tau rescales, and the largest logit of all.
  std::string heads;
  int clipped_heads = 0;
  double largest = -std::numeric_limits<double>::infinity();
  for (size_t l = 0; l < maxima.size(); ++l) {
    for (size_t h = 0; h < maxima[l].size(); ++h) {
      const double v = maxima[l][h];
      fold_nan_max(largest, v);
      if (!(v > tau)) continue;
      if (++clipped_heads <= 8) {
        heads += std::string(heads.empty() ? "" : ", ") + "layer " + std::to_string(l) + " head " + std::to_string(h) +
                 " (" + format_number(v) + ", x" + format_number(std::sqrt(tau / v)) + ")";
      }
    }
  }
  const std::string at = "MuonClip at tau " + format_number(tau) + " on step " + std::to_string(step.step()) +
                         "'s own largest logits" + (refined ? " (a head over its precision measured in fp32)" : "");
  if (clipped_heads == 0) {
    return "no change: " + at + ": every head's largest logit is at most tau (largest " + format_number(largest) + ")";
  }
  // The optimizer's own rule: every q/k weight as if its group had qk_clip tau.
  OptimizerConfig clip;
  clip.qk_clip_tau = tau;
  const std::vector<std::string>& order = step.checkpoint().order();
  const ParamMap& original = step.checkpoint().params();
  ParamMap params;
  for (const std::string& name : order) {
    params[name] = original.at(name).detach().clone().requires_grad_(true);
  }
  apply_qk_clip(clip, m.model, maxima, order, [&](size_t i) { return params.at(order[i]); },
                [](size_t, const torch::Tensor&) {});
  clipped.emplace(step.bundle(), step.step(), ModelCheckpoint(std::move(params), order), step.state(), placement);
  if (clipped_heads > 8) heads += " and " + std::to_string(clipped_heads - 8) + " more";
  return at + ": q and k rows of " + std::to_string(clipped_heads) + (clipped_heads == 1 ? " head" : " heads") +
         " rescaled by sqrt(tau / max): " + heads;
}

}  // namespace nanreplay
