// See optimizer_state_file.h.
#include "replay/optim/optimizer_state_file.h"

#include <cstring>

#include <torch/torch.h>

#include "loaders/base/error.h"

namespace nanreplay {

namespace {

torch::Tensor owned_fp32(const TensorInfo& info, const std::string& label) {
  torch::ScalarType type;
  switch (info.dtype) {
    case DType::kF32: type = torch::kFloat32; break;
    case DType::kBF16: type = torch::kBFloat16; break;
    case DType::kF16: type = torch::kHalf; break;
    case DType::kF64: type = torch::kFloat64; break;
    default:
      throw InputError(label, info.name,
                       std::string("dtype ") + dtype_name(info.dtype) + " is not a state type (expected F32, BF16 or F16)");
  }
  torch::Tensor copy = torch::empty({info.numel()}, torch::TensorOptions().dtype(type));
  if (info.numel() > 0) std::memcpy(copy.data_ptr(), info.data, info.nbytes());
  return copy.to(torch::kFloat32);
}

int64_t product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

int64_t stored_update_count(const SafetensorsFile& optimizer, const std::string& name) {
  const TensorInfo* own = optimizer.find(name + ".step");
  if (own == nullptr && optimizer.find("step") == nullptr) return -1;
  const TensorInfo& step = own != nullptr ? *own : optimizer.at("step");
  if (step.numel() != 1) throw InputError(optimizer.label(), step.name, "expected a scalar update count");
  switch (step.dtype) {
    case DType::kI64: {
      int64_t value = 0;
      std::memcpy(&value, step.data, 8);
      return value;
    }
    case DType::kF32: {
      float value = 0;
      std::memcpy(&value, step.data, 4);
      return static_cast<int64_t>(value);
    }
    case DType::kF64: {
      double value = 0;
      std::memcpy(&value, step.data, 8);
      return static_cast<int64_t>(value);
    }
    default: throw InputError(optimizer.label(), step.name, "expected an I64, F32 or F64 scalar");
  }
}

ParamState read_param_state(const SafetensorsFile& optimizer, const std::string& name,
                            const std::vector<int64_t>& shape, const OptimizerRule& rule) {
  ParamState state;
  state.step = stored_update_count(optimizer, name);
  // torch.optim.Muon keeps no step count (its update does not read one).
  if (state.step < 0 && rule.kind == OptimizerKind::kMuon) state.step = 0;
  if (state.step < 0) (void)optimizer.at("step");  // missing: the error names it
  for (const auto& [key, key_shape] : state_layout(rule, shape)) {
    const TensorInfo& info = optimizer.at(name + "." + key);
    if (info.numel() != product(key_shape)) {
      throw InputError(optimizer.label(), info.name,
                       "holds " + std::to_string(info.numel()) + " elements, expected " +
                           std::to_string(product(key_shape)) + " (" + optimizer_kind_name(rule.kind) + " state of " +
                           name + ")");
    }
    state.tensors[key] = owned_fp32(info, optimizer.label()).reshape(key_shape);
    optimizer.release(info);
  }
  return state;
}

void add_param_state(SafetensorsWriter& writer, const std::string& name, const ParamState& state) {
  for (const auto& [key, tensor] : state.tensors) {
    const torch::Tensor t = tensor.detach().to(torch::kCPU, torch::kFloat32).contiguous();
    writer.add(name + "." + key, DType::kF32, t.sizes().vec(), t.data_ptr(), static_cast<size_t>(t.numel()) * sizeof(float));
  }
  writer.add(name + ".step", DType::kI64, {}, &state.step, sizeof(int64_t));
}

}  // namespace nanreplay
