// Multi-token prediction's arithmetic outside the blocks (model.mtp), as
// Megatron-LM computes it in megatron/core/transformer/multi_token_prediction.py;
// ModelPass (model.h) runs the depths with these. docs/bundle-format.md,
// "Multi-token prediction", has the whole formula.
#pragma once

#include <mutex>
#include <optional>
#include <vector>

#include <torch/types.h>

#include "loaders/arch/model_config.h"

namespace nanreplay {

// roll_tensor(t, shifts=-1, dims=-1) without context parallelism: every row
// moved one position left, the position rolled in at the end set to 0.
torch::Tensor roll_left(const torch::Tensor& t);

// One depth's loss as process_mtp_loss computes it (calculate_per_token_loss
// off): sum(loss_mask * cross_entropy) / max(loss_mask.sum(), 1), in fp32 from
// the logits (B, T, V). The mask multiplies, as Megatron's does: a non-finite
// cross-entropy at a masked position still makes the sum non-finite.
torch::Tensor masked_mean_cross_entropy(const torch::Tensor& logits, const torch::Tensor& labels,
                                        const torch::Tensor& loss_mask);

// MTPLossAutoScaler.apply(loss, mtp): the value of `loss` unchanged (the LM
// loss Megatron logs), while the backward hands `mtp` the gradient `loss`
// receives (main_loss_backward_scale is the main loss's own scale), so the
// MTP term reaches every gradient without entering the logged loss.
torch::Tensor with_mtp_gradient(const torch::Tensor& loss, const torch::Tensor& mtp);

// The model the MTP blocks run in: the decoder's with num_layers counting them too,
// so a ModelPass runs block num_layers + k - 1 with its rotary, attention span and
// parameters (param_table.h's mtp_block_layer). Their probe sites are the decoder
// model's own: forward_sites (probes/sites.h) lists them after `loss`.
ModelConfig with_mtp_blocks(const ModelConfig& model);

// Each depth's loss over a step's passes (report.json's steps[].mtp_loss),
// as HeadLogitRecorder records: only while one is alive, one at a time. The
// passes are summed in the order they were recorded or reserved, so a step
// whose ranks are spread over processes (--nproc) gives the bits one
// process gives.
class MtpLossRecorder {
 public:
  MtpLossRecorder();   // starts recording
  ~MtpLossRecorder();  // stops
  MtpLossRecorder(const MtpLossRecorder&) = delete;
  MtpLossRecorder& operator=(const MtpLossRecorder&) = delete;

  // Per depth, the mean over the passes recorded (a non-finite one stays so); empty when none.
  std::vector<double> means() const;

  // One pass's depth losses (scalars, in depth order). A no-op when no recorder is alive.
  static void record(const std::vector<torch::Tensor>& depth_losses);
  // The place of a pass another process computes, in pass order (none: no recorder alive);
  // fill() gives its losses once they arrive.
  static std::optional<size_t> reserve();
  static void fill(size_t slot, std::vector<double> depth_losses);

 private:
  mutable std::mutex mutex_;
  std::vector<std::vector<double>> passes_;  // each pass's depth losses (empty: reserved, not yet filled)
};

}  // namespace nanreplay
