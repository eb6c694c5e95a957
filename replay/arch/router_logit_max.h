// What the routers of a mixture of experts did over every pass of a step, per
// layer and expert, over its micro-batches and ranks: the largest raw router
// logit (the mlp.router site, before the softmax or sigmoid: report.json's
// steps[].router_logit_max and a spike incident's MoE evidence, docs/spikes.md
// "What changed") and the tokens routed to each expert (what DeepSeek-V3's
// correction bias update reads, replay/step/trajectory.h). The mlp.router
// site's records are of the whole tensor only, so this is taken beside them,
// and only while a RouterLogitRecorder is alive: a replay that does not need
// it pays nothing. Kept where computed until read, so a GPU step does not
// synchronise per layer.
#pragma once

#include <mutex>
#include <vector>

#include <torch/types.h>

namespace nanreplay {

class RouterLogitRecorder {
 public:
  // num_layers: every layer with sites (layers_with_sites, probes/sites.h), model.mtp's blocks after
  // the decoder's, each row the layer its sites name.
  RouterLogitRecorder(int64_t num_layers, int64_t num_experts);  // starts recording
  ~RouterLogitRecorder();                                        // stops
  RouterLogitRecorder(const RouterLogitRecorder&) = delete;
  RouterLogitRecorder& operator=(const RouterLogitRecorder&) = delete;

  // [layer][expert]: -inf where nothing was seen (a layer without experts, or
  // one another process replayed); a NaN among the logits is kept.
  std::vector<std::vector<double>> maxima() const;
  // [layer][expert]: tokens routed (each token counted once per expert it
  // chose, once per pass: the streamed backward's recomputation of a block,
  // inside a ForwardRecompute, is not counted); 0 where nothing was seen.
  std::vector<std::vector<int64_t>> tokens() const;

  // The router of `layer` computed `logits` (..., E). A no-op when no recorder is alive.
  static void record(int layer, const torch::Tensor& logits);
  // The router of `layer` sent `counts` (E) int64 tokens to each expert. A no-op likewise.
  static void record_tokens(int layer, const torch::Tensor& counts);

 private:
  mutable std::mutex mutex_;
  int64_t num_experts_ = 0;
  std::vector<torch::Tensor> maxima_;  // [layer]: (E) fp32 where computed; undefined until seen
  std::vector<torch::Tensor> tokens_;  // [layer]: (E) int64 likewise
};

}  // namespace nanreplay
