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

class ModelCheckpoint {
 public:
  // Opens `files.model` and validates it against `model`.
  ModelCheckpoint(const StepFiles& files, const ModelConfig& model);

  // Leaf tensors with requires_grad, keyed by safetensors name.
  ParamMap& params() { return params_; }
  const ParamMap& params() const { return params_; }
  // Parameter names in the spec's order.
  const std::vector<std::string>& order() const { return order_; }

 private:
  SafetensorsFile file_;  // must outlive params_ (in-place tensors point into it)
  ParamMap params_;
  std::vector<std::string> order_;
};

// fp32 view (or upcast copy) of one safetensors tensor.
torch::Tensor tensor_from_safetensors(const TensorInfo& info, const std::string& label);

}  // namespace nanreplay
