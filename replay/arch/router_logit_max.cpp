// See router_logit_max.h. One recorder at a time, shared by the threads that
// run a step's ranks.
#include "replay/arch/router_logit_max.h"

#include <atomic>
#include <limits>

#include <torch/torch.h>

#include "replay/arch/forward_recompute.h"

namespace nanreplay {

namespace {
std::atomic<RouterLogitRecorder*> active_router_logit_recorder{nullptr};

// [layer][expert] on the host from per-layer (E) tensors; `unseen` where a layer has none.
template <typename T>
std::vector<std::vector<T>> rows_on_host(const std::vector<torch::Tensor>& layers, int64_t experts, T unseen,
                                         torch::ScalarType type) {
  std::vector<std::vector<T>> rows(layers.size(), std::vector<T>(static_cast<size_t>(experts), unseen));
  for (size_t l = 0; l < layers.size(); ++l) {
    if (!layers[l].defined()) continue;
    const torch::Tensor host = layers[l].to(torch::kCPU, type).contiguous();
    const T* values = host.data_ptr<T>();
    for (size_t e = 0; e < rows[l].size() && e < static_cast<size_t>(host.numel()); ++e) rows[l][e] = values[e];
  }
  return rows;
}
}  // namespace

RouterLogitRecorder::RouterLogitRecorder(int64_t num_layers, int64_t num_experts)
    : num_experts_(num_experts), maxima_(static_cast<size_t>(num_layers)), tokens_(static_cast<size_t>(num_layers)) {
  active_router_logit_recorder.store(this);
}

RouterLogitRecorder::~RouterLogitRecorder() { active_router_logit_recorder.store(nullptr); }

std::vector<std::vector<double>> RouterLogitRecorder::maxima() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return rows_on_host<double>(maxima_, num_experts_, -std::numeric_limits<double>::infinity(), torch::kFloat64);
}

std::vector<std::vector<int64_t>> RouterLogitRecorder::tokens() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return rows_on_host<int64_t>(tokens_, num_experts_, 0, torch::kInt64);
}

void RouterLogitRecorder::record(int layer, const torch::Tensor& logits) {
  RouterLogitRecorder* recorder = active_router_logit_recorder.load();
  if (recorder == nullptr) return;
  torch::NoGradGuard no_grad;
  const torch::Tensor flat = logits.detach().to(torch::kFloat32).reshape({-1, logits.size(-1)});
  if (flat.size(0) == 0) return;
  const torch::Tensor per_expert = flat.amax(0);  // amax and maximum propagate a NaN: it wins
  std::lock_guard<std::mutex> lock(recorder->mutex_);
  if (static_cast<size_t>(layer) >= recorder->maxima_.size()) return;  // past the recorder's layers
  torch::Tensor& kept = recorder->maxima_.at(static_cast<size_t>(layer));
  kept = kept.defined() ? torch::maximum(kept, per_expert.to(kept.device())) : per_expert;
}

void RouterLogitRecorder::record_tokens(int layer, const torch::Tensor& counts) {
  if (ForwardRecompute::active()) return;  // the streamed backward's second computation: counted once
  RouterLogitRecorder* recorder = active_router_logit_recorder.load();
  if (recorder == nullptr) return;
  torch::NoGradGuard no_grad;
  const torch::Tensor mine = counts.detach().to(torch::kInt64);
  std::lock_guard<std::mutex> lock(recorder->mutex_);
  if (static_cast<size_t>(layer) >= recorder->tokens_.size()) return;  // past the recorder's layers
  torch::Tensor& kept = recorder->tokens_.at(static_cast<size_t>(layer));
  kept = kept.defined() ? kept + mine.to(kept.device()) : mine.clone();
}

}  // namespace nanreplay
