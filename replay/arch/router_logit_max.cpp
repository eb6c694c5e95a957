// See router_logit_max.h. One recorder at a time, shared by the threads that
// run a step's ranks.
#include "replay/arch/router_logit_max.h"

#include <atomic>
#include <cmath>
#include <limits>

#include <torch/torch.h>

#include "probes/nan_max.h"

namespace nanreplay {

namespace {
std::atomic<RouterLogitRecorder*> active_router_logit_recorder{nullptr};
}  // namespace

RouterLogitRecorder::RouterLogitRecorder(int64_t num_layers, int64_t num_experts)
    : maxima_(static_cast<size_t>(num_layers),
              std::vector<double>(static_cast<size_t>(num_experts), -std::numeric_limits<double>::infinity())) {
  active_router_logit_recorder.store(this);
}

RouterLogitRecorder::~RouterLogitRecorder() { active_router_logit_recorder.store(nullptr); }

std::vector<std::vector<double>> RouterLogitRecorder::maxima() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return maxima_;
}

void RouterLogitRecorder::record(int layer, const torch::Tensor& logits) {
  RouterLogitRecorder* recorder = active_router_logit_recorder.load();
  if (recorder == nullptr) return;
  torch::NoGradGuard no_grad;
  const torch::Tensor flat = logits.detach().to(torch::kFloat32).reshape({-1, logits.size(-1)});
  const torch::Tensor per_expert = flat.amax(0).to(torch::kCPU, torch::kFloat64).contiguous();
  std::lock_guard<std::mutex> lock(recorder->mutex_);
  std::vector<double>& row = recorder->maxima_.at(static_cast<size_t>(layer));
  const double* values = per_expert.data_ptr<double>();
  for (size_t e = 0; e < row.size() && e < static_cast<size_t>(per_expert.numel()); ++e) {
    fold_nan_max(row[e], values[e]);
  }
}

}  // namespace nanreplay
