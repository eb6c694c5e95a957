// The update rules of optimizer.kind (docs/optimizers.md): each parameter is
// updated by its group's rule with its group's lr, after one clip_grad_norm_
// over all gradients, then MuonClip rescales query and key heads. Each rule
// lives in its own file (adam.cpp, adafactor.cpp, adafactor_hf.cpp,
// muon.cpp); optimizer.cpp maps a kind to its rule.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <torch/types.h>

#include "loaders/bundle/manifest.h"
#include "loaders/bundle/optimizer_manifest.h"
#include "replay/optim/state_layout.h"
#include "reports/results/update_stats.h"

namespace nanreplay {

// One parameter's optimizer state: tensors under the spec table's names
// ("exp_avg", "row_var", "momentum_buffer", ...) and its update count.
struct ParamState {
  std::map<std::string, torch::Tensor> tensors;
  int64_t step = 0;  // updates already applied (the state's `step`)
};

// Every parameter's state, in the checkpoint's order.
struct OptimizerMoments {
  std::vector<ParamState> params;
};

// Zeros of that layout (a state PyTorch has not created yet), step 0.
ParamState zero_state(const OptimizerRule& rule, const torch::Tensor& param);

// True for rules whose every element updates on its own (Adam, AdamW): the
// update can be computed a slice of rows at a time.
bool elementwise_rule(const OptimizerRule& rule);

// One update of `param` in place by `rule`, its gradient already clipped;
// `decay` false for a parameter optimizer.no_decay excludes. Advances state.step.
void update_param(torch::Tensor& param, const torch::Tensor& grad, ParamState& state, double lr,
                  const OptimizerRule& rule, bool decay);

// update_param, measured (reports/results/update_stats.h): the update's RMS
// and, for Adam and Adafactor, g^2 against the second moment it starts from.
TensorUpdateStats update_param_measured(const std::string& name, torch::Tensor& param, const torch::Tensor& grad,
                                        ParamState& state, double lr, const OptimizerRule& rule, bool decay);

// Per layer, per query head: the largest scaled pre-softmax logit of a step
// (StepResult::attn_logit_max); empty when not recorded.
using HeadLogitMax = std::vector<std::vector<double>>;

// MuonClip after a step's update: for each q_proj/k_proj weight whose group
// has qk_clip, the rows of every head whose largest logit exceeded tau are
// multiplied by sqrt(g), g = tau / max_logit (a key head: the smallest g of
// the query heads that read it). Latent attention: q_proj or q_b_proj's nope
// rows by sqrt(g) and rope rows by g, kv_b_proj's k_nope rows by sqrt(g).
// `param_of(i)` gives the tensor to rescale in place, `store` takes it back.
void apply_qk_clip(const OptimizerConfig& config, const ModelConfig& model, const HeadLogitMax& logit_max,
                   const std::vector<std::string>& names,
                   const std::function<torch::Tensor(size_t)>& param_of,
                   const std::function<void(size_t, const torch::Tensor&)>& store);

// The lr of an optimizer group by name ("default": the top level).
using GroupLr = std::function<double(const std::string& group)>;

// One whole step over parameters held in memory: clip, each parameter's rule
// with its group's lr, then MuonClip. `moments.params` empty: zero state.
// `measured`, when given, receives each tensor's update statistics.
void optimizer_update(std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads, double grad_norm,
                      OptimizerMoments& moments, const GroupLr& lr_of, const OptimizerConfig& config,
                      const std::vector<std::string>& names, const ModelConfig& model,
                      const HeadLogitMax& logit_max, std::vector<TensorUpdateStats>* measured = nullptr);

}  // namespace nanreplay
