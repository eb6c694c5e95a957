// A step's model checkpoint as fp32 master tensors ready for autograd.
// F32 tensors already aligned in the mapping are used in place (no copy);
// BF16/F16 are upcast. Every parameter the architecture needs must be present
// with the right shape; one error lists everything missing or mismatched.
#pragma once

#include <string>
#include <vector>

#include "loaders/bundle.h"
#include "loaders/safetensors.h"
#include "replay/model.h"

namespace nanreplay {

// Where a replay computes: one device, or two with the layers split.
struct ComputePlacement {
  std::vector<torch::Device> devices{torch::Device(torch::kCPU)};
  bool native_low_precision = false;  // bf16/fp16 matmuls in the low type (GPU)
};

// --device names ("cpu", "cuda:N", one or two) checked and turned into a
// placement; UsageError names a malformed value. `native_allowed`: bf16/fp16
// run natively when a GPU is involved.
ComputePlacement placement_for(const std::vector<std::string>& names, bool native_allowed, Compute compute);

class ModelCheckpoint {
 public:
  // Opens `files.model` and validates it against `model`.
  ModelCheckpoint(const StepFiles& files, const ModelConfig& model);
  // Parameters the replay derived itself (rolling forward): leaves shared
  // with `params`, in `order`, no file behind them.
  ModelCheckpoint(ParamMap params, std::vector<std::string> order);

  // Leaf tensors with requires_grad, keyed by safetensors name, on the host.
  ParamMap& params() { return params_; }
  const ParamMap& params() const { return params_; }
  // Copies the parameters to `devices` as new leaves: all on one device, or
  // split by layer over two (layers [0, L/2) and the embeddings on the first,
  // the rest, the final norm and the head on the second). The host tensors
  // stay for the system checks.
  void place(const std::vector<torch::Device>& devices, int num_layers);
  void place(const ComputePlacement& placement, int num_layers) { place(placement.devices, num_layers); }
  // What the replay computes with: the placed leaves, else the host ones.
  ParamMap& compute_params() { return placed_.empty() ? params_ : placed_; }
  // Parameter names in the spec's order.
  const std::vector<std::string>& order() const { return order_; }

 private:
  SafetensorsFile file_;  // must outlive params_ (in-place tensors point into it)
  ParamMap params_;
  ParamMap placed_;
  std::vector<std::string> order_;
};

// fp32 view (or upcast copy) of one safetensors tensor.
torch::Tensor tensor_from_safetensors(const TensorInfo& info, const std::string& label);

}  // namespace nanreplay
