// See multi_token_prediction.h; each function cites the Megatron-LM code it transcribes.
#include "replay/arch/multi_token_prediction.h"

#include <atomic>

#include <torch/torch.h>

#include "replay/arch/forward_recompute.h"

namespace nanreplay {

namespace {

std::atomic<MtpLossRecorder*> active_mtp_loss_recorder{nullptr};

// MTPLossAutoScaler (multi_token_prediction.py): forward returns `output`,
// backward returns (grad_output, ones_like(mtp_loss) * main_loss_backward_scale).
// The schedule sets that scale to the main loss's backward scale (loss scale /
// micro-batches), which here is the gradient the loss itself receives.
struct MtpLossAutoScaler : public torch::autograd::Function<MtpLossAutoScaler> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& output,
                               const torch::Tensor& mtp_loss) {
    ctx->saved_data["mtp_shape"] = mtp_loss.sizes().vec();
    return output.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const torch::Tensor& grad = grad_outputs[0];
    const std::vector<int64_t> shape = ctx->saved_data["mtp_shape"].toIntVector();
    return {grad, grad.expand(shape).clone()};
  }
};

}  // namespace

torch::Tensor roll_left(const torch::Tensor& t) {
  // roll_tensor's cp_size == 1 branch: torch.roll(t, -1, -1); rolled.select(-1, -1).fill_(0).
  torch::Tensor rolled = torch::roll(t, {-1}, {-1});
  rolled.select(-1, -1).fill_(0);
  return rolled;
}

torch::Tensor masked_mean_cross_entropy(const torch::Tensor& logits, const torch::Tensor& labels,
                                        const torch::Tensor& loss_mask) {
  const int64_t V = logits.size(-1);
  // compute_language_model_loss: per-token cross-entropy in fp32, reduction none.
  const torch::Tensor per_token =
      torch::nll_loss(torch::log_softmax(logits.to(torch::kFloat32).reshape({-1, V}), 1),
                      labels.to(logits.device()).reshape({-1}), {}, at::Reduction::None);
  const torch::Tensor mask = loss_mask.to(logits.device(), torch::kFloat32).reshape({-1});
  // process_mtp_loss: mtp_loss * loss_mask, then sum / num_tokens.clamp(min=1).
  return (per_token * mask).sum() / mask.sum().clamp_min(1);
}

torch::Tensor with_mtp_gradient(const torch::Tensor& loss, const torch::Tensor& mtp) {
  return MtpLossAutoScaler::apply(loss, mtp.to(loss.device()));
}

ModelConfig with_mtp_blocks(const ModelConfig& model) {
  ModelConfig blocks = model;
  blocks.num_layers += model.mtp ? model.mtp->num_layers : 0;
  return blocks;
}

MtpLossRecorder::MtpLossRecorder() { active_mtp_loss_recorder.store(this); }

MtpLossRecorder::~MtpLossRecorder() { active_mtp_loss_recorder.store(nullptr); }

std::vector<double> MtpLossRecorder::means() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<double> sums;
  for (const std::vector<double>& pass : passes_) {  // in pass order, whichever process computed each
    if (sums.size() < pass.size()) sums.resize(pass.size(), 0.0);
    for (size_t d = 0; d < pass.size(); ++d) sums[d] += pass[d];
  }
  std::vector<double> out;
  for (const double sum : sums) out.push_back(sum / static_cast<double>(passes_.size()));
  return out;
}

void MtpLossRecorder::record(const std::vector<torch::Tensor>& depth_losses) {
  if (ForwardRecompute::active()) return;  // the streamed backward's second computation: counted once
  MtpLossRecorder* recorder = active_mtp_loss_recorder.load();
  if (recorder == nullptr || depth_losses.empty()) return;
  std::vector<double> values;
  for (const torch::Tensor& loss : depth_losses) values.push_back(loss.detach().to(torch::kCPU, torch::kFloat64).item<double>());
  std::lock_guard<std::mutex> lock(recorder->mutex_);
  recorder->passes_.push_back(std::move(values));
}

std::optional<size_t> MtpLossRecorder::reserve() {
  MtpLossRecorder* recorder = active_mtp_loss_recorder.load();
  if (recorder == nullptr) return std::nullopt;
  std::lock_guard<std::mutex> lock(recorder->mutex_);
  recorder->passes_.emplace_back();
  return recorder->passes_.size() - 1;
}

void MtpLossRecorder::fill(size_t slot, std::vector<double> depth_losses) {
  MtpLossRecorder* recorder = active_mtp_loss_recorder.load();
  if (recorder == nullptr) return;
  std::lock_guard<std::mutex> lock(recorder->mutex_);
  recorder->passes_.at(slot) = std::move(depth_losses);
}

}  // namespace nanreplay
