// See head_logit_max.h. One recorder at a time, shared by the threads that
// run a step's ranks.
#include "replay/arch/head_logit_max.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>

#include <torch/torch.h>

#include "probes/nan_max.h"

namespace nanreplay {

namespace {
std::atomic<HeadLogitRecorder*> active_head_logit_recorder{nullptr};
}  // namespace

HeadLogitRecorder::HeadLogitRecorder(int64_t num_layers, int64_t num_heads)
    : maxima_(static_cast<size_t>(num_layers),
              std::vector<double>(static_cast<size_t>(num_heads), -std::numeric_limits<double>::infinity())) {
  active_head_logit_recorder.store(this);
}

HeadLogitRecorder::~HeadLogitRecorder() { active_head_logit_recorder.store(nullptr); }

std::vector<std::vector<double>> HeadLogitRecorder::maxima() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return maxima_;
}

void HeadLogitRecorder::record(int layer, const torch::Tensor& scores, const torch::Tensor& hidden) {
  HeadLogitRecorder* recorder = active_head_logit_recorder.load();
  // The recorder's rows span every layer with sites, model.mtp's blocks included; anything past them is no layer.
  if (recorder == nullptr || layer < 0 || static_cast<size_t>(layer) >= recorder->maxima_.size()) return;
  torch::NoGradGuard no_grad;
  const torch::Tensor visible = scores.detach().to(torch::kFloat32).masked_fill(hidden, -std::numeric_limits<float>::infinity());
  const torch::Tensor per_head = visible.amax({0, 2, 3}).to(torch::kCPU, torch::kFloat64).contiguous();
  std::lock_guard<std::mutex> lock(recorder->mutex_);
  std::vector<double>& row = recorder->maxima_.at(static_cast<size_t>(layer));
  const double* values = per_head.data_ptr<double>();
  for (size_t h = 0; h < row.size() && h < static_cast<size_t>(per_head.numel()); ++h) {
    // A NaN logit is kept: it is what the run saw, and no clip follows from it.
    fold_nan_max(row[h], values[h]);
  }
}

}  // namespace nanreplay
