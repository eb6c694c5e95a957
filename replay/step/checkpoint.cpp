// Loading a checkpoint into fp32 master tensors, in place where possible.
#include "replay/step/checkpoint.h"

#include <algorithm>
#include <cstdlib>

#include <torch/torch.h>

#include "loaders/base/error.h"
#include "replay/step/bundle_structure.h"

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
    // As stored (bf16 is half the bytes to copy), widened to fp32 on the device:
    // the same values, since widening is exact.
    const torch::Tensor stored = file_ && !loaded_ ? stored_tensor(file_->at(name), file_->label())
                                                   : params().at(name).detach();
    torch::Tensor leaf = stored.to(device, /*non_blocking=*/false, /*copy=*/true).to(torch::kFloat32);
    leaf.requires_grad_(true);
    placed_.emplace(name, leaf);
  }
}

TensorInfo tensor_rows(const TensorInfo& info, int64_t row, int64_t rows) {
  TensorInfo slice = info;
  if (info.shape.empty()) return slice;
  const uint64_t row_bytes = info.nbytes() / static_cast<uint64_t>(std::max<int64_t>(1, info.shape[0]));
  slice.shape[0] = rows;
  slice.data = info.data + static_cast<uint64_t>(row) * row_bytes;
  slice.begin = info.begin + static_cast<uint64_t>(row) * row_bytes;
  slice.end = slice.begin + static_cast<uint64_t>(rows) * row_bytes;
  return slice;
}

torch::Tensor tensor_from_safetensors(const TensorInfo& info, const std::string& label) {
  const torch::Tensor stored = stored_tensor(info, label);
  return stored.scalar_type() == torch::kFloat32 ? stored : stored.to(torch::kFloat32);
}

torch::Tensor stored_tensor(const TensorInfo& info, const std::string& label) {
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
  if (info.numel() == 0) return torch::zeros(info.shape, torch::TensorOptions().dtype(type));
  if (!aligned) {
    torch::Tensor copy = torch::empty(info.shape, torch::TensorOptions().dtype(type));
    std::memcpy(copy.data_ptr(), data, info.nbytes());
    return copy;
  }
  return torch::from_blob(data, info.shape, torch::TensorOptions().dtype(type));
}

ModelCheckpoint::ModelCheckpoint(const StepFiles& files, const ModelConfig& model)
    : file_(SafetensorsFile::open(files.model.string(), files.label("model.safetensors"))) {
  check_checkpoint_matches_model(*file_, model);
  for (const ParamSpec& spec : expected_parameters(model)) {
    const TensorInfo& info = file_->at(spec.name);
    if (info.dtype != DType::kF32 && info.dtype != DType::kBF16 && info.dtype != DType::kF16) {
      throw InputError(file_->label(), info.name,
                       std::string("dtype ") + dtype_name(info.dtype) +
                           " is not a parameter type (expected F32, BF16 or F16)");
    }
    order_.push_back(spec.name);
  }
}

ModelCheckpoint::ModelCheckpoint(ParamMap params, std::vector<std::string> order)
    : params_(std::move(params)), loaded_(true), order_(std::move(order)) {}

ModelCheckpoint::ModelCheckpoint(std::function<torch::Tensor(size_t)> read, std::vector<std::string> order)
    : order_(std::move(order)), read_(std::move(read)) {}

ModelCheckpoint ModelCheckpoint::share() const {
  if (file_) throw std::logic_error("ModelCheckpoint::share: only derived parameters are shared");
  return read_ && !loaded_ ? ModelCheckpoint(read_, order_) : ModelCheckpoint(params_, order_);
}

ParamMap& ModelCheckpoint::params() {
  if (loaded_) return params_;
  for (const std::string& name : order_) {
    torch::Tensor master = param(name);
    if (read_) {
      params_.emplace(name, master.requires_grad_(true));
      continue;
    }
    // An upcast (or realigned) copy never reads the mapping again.
    const TensorInfo& info = file_->at(name);
    if (master.data_ptr() != static_cast<const void*>(info.data)) file_->release(info);
    master.requires_grad_(true);
    params_.emplace(name, master);
  }
  loaded_ = true;
  return params_;
}

torch::Tensor ModelCheckpoint::param(const std::string& name) const {
  if (loaded_) return params_.at(name);
  if (read_) {
    const auto it = std::find(order_.begin(), order_.end(), name);
    if (it == order_.end()) throw std::out_of_range("no parameter " + name);
    return read_(static_cast<size_t>(it - order_.begin()));
  }
  return tensor_from_safetensors(file_->at(name), file_->label());
}

void ModelCheckpoint::release(const std::string& name) const {
  if (loaded_ && file_) {
    // Loaded leaves in place still read the mapping: only copies may let it go.
    const TensorInfo& info = file_->at(name);
    if (params_.at(name).data_ptr() != static_cast<const void*>(info.data)) file_->release(info);
    return;
  }
  if (file_) file_->release(file_->at(name));
}

}  // namespace nanreplay
