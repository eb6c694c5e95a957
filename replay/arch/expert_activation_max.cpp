// See expert_activation_max.h. One recorder at a time, shared by the threads
// that run a step's ranks.
#include "replay/arch/expert_activation_max.h"

#include <atomic>
#include <cmath>

#include <torch/torch.h>

#include "probes/nan_max.h"

namespace nanreplay {

namespace {

std::atomic<ExpertActivationRecorder*> active_expert_activation_recorder{nullptr};

// max |x| of each routed row (NaN where a row holds one), on the host.
std::vector<double> row_max_abs(const torch::Tensor& rows) {
  if (rows.numel() == 0) return std::vector<double>(static_cast<size_t>(rows.size(0)), 0.0);
  const torch::Tensor flat = rows.detach().reshape({rows.size(0), -1}).to(torch::kFloat32).abs();
  const torch::Tensor per_row = flat.amax(1).to(torch::kCPU, torch::kFloat64).contiguous();
  return std::vector<double>(per_row.data_ptr<double>(), per_row.data_ptr<double>() + per_row.numel());
}

}  // namespace

ExpertActivationRecorder::ExpertActivationRecorder(int64_t num_layers, int64_t num_experts)
    : num_experts_(num_experts), maxima_(static_cast<size_t>(num_layers)) {
  active_expert_activation_recorder.store(this);
}

ExpertActivationRecorder::~ExpertActivationRecorder() { active_expert_activation_recorder.store(nullptr); }

std::vector<std::optional<std::vector<ExpertActivationMax>>> ExpertActivationRecorder::maxima() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return maxima_;
}

void ExpertActivationRecorder::record(int layer, const torch::Tensor& input, const torch::Tensor& output,
                                      const std::vector<int64_t>& offsets) {
  ExpertActivationRecorder* recorder = active_expert_activation_recorder.load();
  if (recorder == nullptr) return;
  torch::NoGradGuard no_grad;
  const std::vector<double> in = row_max_abs(input), out = row_max_abs(output);
  std::lock_guard<std::mutex> lock(recorder->mutex_);
  if (static_cast<size_t>(layer) >= recorder->maxima_.size()) return;  // past the recorder's layers
  std::optional<std::vector<ExpertActivationMax>>& row = recorder->maxima_.at(static_cast<size_t>(layer));
  if (!row) row.emplace(static_cast<size_t>(recorder->num_experts_));
  for (size_t e = 0; e < row->size() && e + 1 < offsets.size(); ++e) {
    ExpertActivationMax& m = (*row)[e];
    for (int64_t r = offsets[e]; r < offsets[e + 1] && static_cast<size_t>(r) < in.size(); ++r) {
      // rows 0 until now: the first row sets the maxima (a NaN included).
      if (m.rows == 0) {
        m.input = in[static_cast<size_t>(r)];
        m.output = out[static_cast<size_t>(r)];
      } else {
        fold_nan_max(m.input, in[static_cast<size_t>(r)]);
        fold_nan_max(m.output, out[static_cast<size_t>(r)]);
      }
      m.rows += 1;
    }
  }
}

}  // namespace nanreplay
