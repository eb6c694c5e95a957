// The two kinds of StepModel; see step_model.h.
#include "replay/step/step_model.h"

#include <torch/torch.h>

#include "replay/step/ranks/distributed.h"
#include "replay/step/gradients.h"
#include "replay/step/rank_spread.h"

namespace nanreplay {

namespace {

class InMemoryModel final : public StepModel {
 public:
  InMemoryModel(ParamMap& params, const std::vector<std::string>& order) : params_(params), order_(order) {}
  ~InMemoryModel() override { clear_gradients(params_, order_); }

  ForwardResult forward_backward(const ModelConfig& model, const Numerics& numerics, ProbeSession& probes,
                                 const torch::Tensor& inputs, const torch::Tensor& targets, double backward_scale,
                                 const std::function<void()>& before_backward,
                                 const StreamedModel::BlockHook& on_block) override {
    (void)on_block;  // one piece: the whole model
    ForwardResult forward = forward_loss(model, params_, inputs, targets, numerics, probes);
    if (before_backward) before_backward();
    (forward.loss * backward_scale).backward();
    forward.loss = forward.loss.detach();
    return forward;
  }
  void begin_step(bool) override { step_grads_.clear(); }
  void begin_rank(int) override { clear_gradients(params_, order_); }
  torch::Tensor end_rank(double inv_scale, int64_t world_size) override {
    return total_grad_norm_tensor(add_rank_gradients(params_, order_, inv_scale, world_size, step_grads_));
  }
  void end_ranks() override { clear_gradients(params_, order_); }
  GradientSet step_gradients(bool where_computed) override {
    if (!where_computed) {
      for (torch::Tensor& grad : step_grads_) grad = grad.to(torch::kCPU);
    }
    return GradientSet(step_grads_);
  }
  torch::Tensor step_grad_norm() override { return total_grad_norm_tensor(step_grads_); }

 private:
  ParamMap& params_;
  const std::vector<std::string>& order_;
  std::vector<torch::Tensor> step_grads_;
};

class LayerStreamedModel final : public StepModel {
 public:
  LayerStreamedModel(ModelCheckpoint& checkpoint, const ModelConfig& model, const ComputePlacement& placement)
      : streamed_(checkpoint, model, placement.devices.front(), placement.stream) {}

  ForwardResult forward_backward(const ModelConfig& model, const Numerics& numerics, ProbeSession& probes,
                                 const torch::Tensor& inputs, const torch::Tensor& targets, double backward_scale,
                                 const std::function<void()>& before_backward,
                                 const StreamedModel::BlockHook& on_block) override {
    return streamed_.forward_backward(model, numerics, probes, inputs, targets, backward_scale, before_backward,
                                      on_block);
  }
  void begin_step(bool) override { streamed_.begin_step(); }
  void begin_rank(int) override { streamed_.clear_gradients(); }
  torch::Tensor end_rank(double inv_scale, int64_t world_size) override {
    return streamed_.add_rank_gradients(inv_scale, world_size);
  }
  void end_ranks() override {}
  GradientSet step_gradients(bool) override { return streamed_.step_gradients(); }
  torch::Tensor step_grad_norm() override { return streamed_.step_grad_norm(); }

 private:
  StreamedModel streamed_;
};

}  // namespace

std::unique_ptr<StepModel> in_memory_model(ParamMap& params, const std::vector<std::string>& order) {
  return std::make_unique<InMemoryModel>(params, order);
}

std::unique_ptr<StepModel> checkpoint_model(ModelCheckpoint& checkpoint, const ModelConfig& model,
                                            const ComputePlacement& placement) {
  std::unique_ptr<StepModel> step_model;
  if (placement.stream) {
    step_model = std::make_unique<LayerStreamedModel>(checkpoint, model, placement);
  } else {
    checkpoint.place(placement, static_cast<int>(model.num_layers));
    step_model = std::make_unique<InMemoryModel>(checkpoint.compute_params(), checkpoint.order());
  }
  ProcessWorld* world = default_world();
  if (world == nullptr || world->split() != ProcessSplit::kRanks) return step_model;
  std::vector<std::vector<int64_t>> shapes;
  for (const ParamSpec& spec : expected_parameters(model)) shapes.push_back(spec.shape);
  return spread_ranks(std::move(step_model), *world, std::move(shapes), placement.stream);
}

}  // namespace nanreplay
