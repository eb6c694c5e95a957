// Loading a checkpoint into fp32 master tensors, in place where possible.
#include "replay/checkpoint.h"

#include <algorithm>
#include <cstdlib>

#include <torch/torch.h>

#include "loaders/error.h"
#include "replay/bundle_structure.h"

namespace nanreplay {

ComputePlacement placement_for(const std::vector<std::string>& names, bool native_allowed, Compute compute) {
  ComputePlacement placement;
  placement.devices.clear();
  for (const std::string& name : names) {
    const bool cuda = name.rfind("cuda:", 0) == 0 && name.size() > 5 &&
                      name.find_first_not_of("0123456789", 5) == std::string::npos;
    if (name != "cpu" && !cuda) {
      throw UsageError("--device " + name + ": expected cpu, cuda:N, or two of them separated by a comma");
    }
    placement.devices.emplace_back(name);
  }
  if (placement.devices.empty()) placement.devices.emplace_back(torch::kCPU);
  const bool on_gpu = std::any_of(placement.devices.begin(), placement.devices.end(),
                                  [](const torch::Device& d) { return d.is_cuda(); });
  const bool reduced = compute == Compute::kBf16 || compute == Compute::kFp16;
  placement.native_low_precision = native_allowed && on_gpu && reduced;
  return placement;
}

void ModelCheckpoint::place(const std::vector<torch::Device>& devices, int num_layers) {
  placed_.clear();
  if (devices.empty() || (devices.size() == 1 && devices[0].is_cpu())) return;
  const int first_half = num_layers / 2;
  for (const std::string& name : order_) {
    const int layer = layer_of_parameter(name);
    const bool embedding = name.find("embed_tokens") != std::string::npos ||
                           name.find(".wte.") != std::string::npos || name.find(".wpe.") != std::string::npos;
    const bool on_first = devices.size() == 1 || embedding || (layer >= 0 && layer < first_half);
    const torch::Device& device = on_first ? devices.front() : devices.back();
    torch::Tensor leaf = params_.at(name).detach().to(device, /*non_blocking=*/false, /*copy=*/true);
    leaf.requires_grad_(true);
    placed_.emplace(name, leaf);
  }
}

torch::Tensor tensor_from_safetensors(const TensorInfo& info, const std::string& label) {
  torch::ScalarType type;
  switch (info.dtype) {
    case DType::kF32: type = torch::kFloat32; break;
    case DType::kBF16: type = torch::kBFloat16; break;
    case DType::kF16: type = torch::kHalf; break;
    default:
      throw InputError(label, info.name,
                       std::string("dtype ") + dtype_name(info.dtype) +
                           " is not a parameter type (expected F32, BF16 or F16)");
  }
  void* data = const_cast<uint8_t*>(info.data);  // never written: the replay only reads leaves
  const bool aligned = reinterpret_cast<uintptr_t>(data) % dtype_size(info.dtype) == 0;
  if (info.numel() == 0) return torch::zeros(info.shape, torch::kFloat32);
  if (!aligned) {
    torch::Tensor copy = torch::empty(info.shape, torch::TensorOptions().dtype(type));
    std::memcpy(copy.data_ptr(), data, info.nbytes());
    return copy.to(torch::kFloat32);
  }
  torch::Tensor view = torch::from_blob(data, info.shape, torch::TensorOptions().dtype(type));
  return type == torch::kFloat32 ? view : view.to(torch::kFloat32);
}

ModelCheckpoint::ModelCheckpoint(const StepFiles& files, const ModelConfig& model)
    : file_(SafetensorsFile::open(files.model.string(), files.label("model.safetensors"))) {
  check_checkpoint_matches_model(file_, model);
  const std::vector<ParamSpec> expected = expected_parameters(model);
  for (const ParamSpec& spec : expected) {
    const TensorInfo& info = file_.at(spec.name);
    torch::Tensor master = tensor_from_safetensors(info, file_.label());
    // An upcast (or realigned) copy never reads the mapping again.
    if (master.data_ptr() != static_cast<const void*>(info.data)) file_.release(info);
    master.requires_grad_(true);
    params_.emplace(spec.name, master);
    order_.push_back(spec.name);
  }
}

ModelCheckpoint::ModelCheckpoint(ParamMap params, std::vector<std::string> order)
    : params_(std::move(params)), order_(std::move(order)) {}

}  // namespace nanreplay
