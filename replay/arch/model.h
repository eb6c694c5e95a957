// The replayed transformer: llama and gpt2 of the bundle spec, written as one
// op per line with a probe at every site, parameters looked up by their
// safetensors keys. Returns the micro-batch's mean next-token cross-entropy.
#pragma once

#include <string>
#include <utility>
#include <unordered_map>
#include <vector>

#include <torch/types.h>

#include "loaders/bundle/manifest.h"
#include "replay/probing/numerics.h"
#include "replay/probing/probe_session.h"

namespace nanreplay {

using ParamMap = std::unordered_map<std::string, torch::Tensor>;

struct ForwardResult {
  torch::Tensor loss;         // scalar: mean next-token cross-entropy
  torch::Tensor sample_loss;  // (batch,) per-row mean, no grad; undefined with probes off
  // model.mtp: each depth's mean cross-entropy, unscaled, no grad. Their scaled
  // mean reaches the gradients through `loss`, whose value stays the LM loss
  // (Megatron-LM's MTPLossAutoScaler; replay/arch/multi_token_prediction.h).
  std::vector<torch::Tensor> mtp_losses;
};

// What a mixture of experts' router losses read, one entry per layer in order.
struct RouterOutputs {
  std::vector<torch::Tensor> logits;         // (tokens, E) fp32, as the mlp.router site holds them
  std::vector<torch::Tensor> probs;          // (tokens, E) softmax in fp32
  std::vector<torch::Tensor> expert_tokens;  // (E) int64: tokens routed to each expert (no grad)
};

// One forward through the model in three kinds of piece: the embeddings,
// each block, the head with the loss. forward_loss runs them in a row over
// every parameter; the layer-streamed replay (replay/step/layer_stream.h) runs
// each with only its own parameters loaded, and again from its saved input
// for the backward. The arithmetic is the same either way.
class ModelPass {
 public:
  ModelPass(const ModelConfig& model, const Numerics& numerics, ProbeSession& probes);
  // inputs: [batch, seq] int64; returns the residual stream (B, T, C).
  torch::Tensor embed(const ParamMap& params, const torch::Tensor& inputs);
  // Block `layer` from the residual stream entering it.
  torch::Tensor block(const ParamMap& params, int layer, const torch::Tensor& x);
  // The final norm, the logits and the loss (with a mixture of experts'
  // router losses over `router()`), from the last block's output.
  ForwardResult head(const ParamMap& params, const torch::Tensor& x, const torch::Tensor& targets);
  // The routers' outputs the blocks appended, in layer order.
  RouterOutputs& router() { return router_; }

 private:
  // The rotary tables of `layer`'s kind, made on first use and moved to `device`.
  std::pair<torch::Tensor, torch::Tensor> rotary_for(int layer, int64_t seq, const torch::Device& device);
  torch::Tensor llama_block(const ParamMap& params, int layer, torch::Tensor x);
  torch::Tensor gpt2_block(const ParamMap& params, int layer, torch::Tensor x);
  // model.mtp's block `layer` (a pass over with_mtp_blocks' model) from its depth's eh_proj output.
  torch::Tensor mtp_block(const ParamMap& params, int layer, const torch::Tensor& x);
  // model.mtp's depths from the final norm's output `hidden` and the output head `head`:
  // their losses into result.mtp_losses, their scaled mean into result.loss's gradient.
  void add_mtp_loss(const ParamMap& params, const torch::Tensor& hidden, const torch::Tensor& head,
                    const torch::Tensor& targets, ForwardResult& result);

  const ModelConfig& m_;
  const Numerics& numerics_;
  ProbeSession& probes_;
  torch::Tensor cos_, sin_;  // rotary tables (llama), made by the first block and moved along with it
  torch::Tensor cos_local_, sin_local_;  // the local rotary's (ModelConfig::local_rotary), likewise
  RouterOutputs router_;
  torch::Tensor inputs_;  // embed()'s token ids: multi-token prediction embeds them again, rolled
};

// inputs, targets: [batch, seq] int64. Every forward site goes through `probes`.
ForwardResult forward_loss(const ModelConfig& model, const ParamMap& params,
                           const torch::Tensor& inputs, const torch::Tensor& targets,
                           const Numerics& numerics, ProbeSession& probes);

}  // namespace nanreplay
