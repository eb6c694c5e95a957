// steps/<step>/state.json: the per-step scalars and what the job logged.
// Numbers may be given as the strings "nan", "inf", "-inf" (JSON has no NaN).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "loaders/arch/model_config.h"

namespace nanreplay {

struct Fp8ModuleScales {
  std::optional<double> input;
  std::optional<double> weight;
  std::optional<double> grad_output;
};

// What the run logged of one forward site: the largest finite |x| and the
// root mean square of its finite elements over the step's micro-batches and
// ranks, and the same pair per head or per expert where the site has them.
struct LoggedSiteStat {
  double max_abs = 0.0;
  double rms = 0.0;
};
struct LoggedSiteStats {
  LoggedSiteStat whole;
  std::vector<LoggedSiteStat> per_head;
  std::vector<LoggedSiteStat> per_expert;
};

struct LoggedMetrics {
  // logged.site_stats, keyed by site name ("layers.1.attn.scores").
  std::map<std::string, LoggedSiteStats> site_stats;
  std::optional<double> loss;
  std::optional<double> grad_norm;
  std::vector<double> rank_losses;
  std::vector<double> rank_grad_norms;
};

struct StepState {
  int64_t step = 0;
  // lr: a number for every group; or an object keyed by optimizer group name
  // ("default": the top level), kept in lr_by_group, with `lr` its "default"
  // entry or else its largest (only a tolerance and a presence mark: every
  // update reads lr_of its parameter's group).
  std::optional<double> lr;
  std::map<std::string, double> lr_by_group;
  // The lr of optimizer group `group`; none when state.json gives none for it.
  std::optional<double> lr_of(const std::string& group) const {
    if (lr_by_group.empty()) return lr;
    const auto it = lr_by_group.find(group);
    if (it == lr_by_group.end()) return std::nullopt;
    return it->second;
  }
  double loss_scale = 1.0;
  bool loss_scale_given = false;  // state.json names it (a rolled-forward step otherwise carries the scale on)
  std::map<std::string, Fp8ModuleScales> fp8_scales;  // key: module prefix
  // router_score_bias: DeepSeek-V3's e_score_correction_bias as the job held it for this step, by
  // buffer name ("model.layers.3.mlp.gate.e_score_correction_bias"), one number per expert.
  std::map<std::string, std::vector<double>> router_score_bias;
  // A rolled-forward step's correction bias as the replay derived it from the step before (the
  // manifest's model.moe.score_bias_update; replay/step/trajectory.h), by layer; not read from the
  // file. Replayed only where the file logs none (a logged one wins and is compared with it).
  std::map<int, std::vector<double>> derived_router_score_bias;
  std::string file;  // the state.json's label, for a refusal that needs the model (router_score_bias_of)
  LoggedMetrics logged;
  std::optional<bool> skipped;
};

StepState parse_step_state(const std::string& json_text, const std::string& file_label);

// The state.json key of layer `layer`'s correction bias: model.layers.<layer>.mlp.gate.e_score_correction_bias.
std::string router_score_bias_key(int layer);
// The step's correction bias by layer with experts, as MoeConfig::step_score_bias holds it: empty
// unless the model's router adds one (sigmoid_grouped with router_score_bias). The logged one, or the
// derived one when the file logs none (router_score_bias_derived). Throws InputError naming the
// state.json and the key when a layer's bias is missing (and none was derived) or has not
// num_experts numbers, or when the file gives one for a layer without experts.
std::map<int, std::vector<double>> router_score_bias_of(const StepState& state, const ModelConfig& model);
// Whether router_score_bias_of gives the derived bias: the file logs none and the replay derived one.
bool router_score_bias_derived(const StepState& state);

}  // namespace nanreplay
