// A step's model checkpoint as fp32 master tensors ready for autograd.
// F32 tensors already aligned in the mapping are used in place (no copy);
// BF16/F16 are upcast. Every parameter the architecture needs must be present
// with the right shape and a parameter dtype; one error lists everything
// missing or mismatched. Nothing is loaded until asked for: all of it by
// params(), or a few tensors at a time (the layer-streamed replay).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loaders/bundle/bundle.h"
#include "loaders/formats/safetensors.h"
#include "replay/arch/model.h"

namespace nanreplay {

struct StreamScratch;  // replay/step/layer_stream.h

// Where a replay computes: one device, or two with the layers split; in
// memory, or streamed layer by layer (replay/step/layer_stream.h).
struct ComputePlacement {
  std::vector<torch::Device> devices{torch::Device(torch::kCPU)};
  bool native_low_precision = false;  // bf16/fp16 matmuls in the low type (GPU)
  // Set: the layer-streamed replay, its scratch files in this directory.
  std::shared_ptr<StreamScratch> stream;
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
  // Derived parameters kept elsewhere (a layer-streamed replay's scratch
  // files): `read(i)` gives parameter order[i] as a new fp32 host tensor.
  ModelCheckpoint(std::function<torch::Tensor(size_t)> read, std::vector<std::string> order);

  // Leaf tensors with requires_grad, keyed by safetensors name, on the host
  // (every one loaded on the first call).
  ParamMap& params();
  const ParamMap& params() const { return const_cast<ModelCheckpoint*>(this)->params(); }
  // Derived parameters only: another checkpoint over the same tensors (or
  // the same scratch file), to replay them again.
  ModelCheckpoint share() const;
  // One parameter in fp32 without loading the others: the leaf when params()
  // has loaded them, else a tensor made for this call (in place in the
  // mapping where it can be). release() then drops its pages again.
  torch::Tensor param(const std::string& name) const;
  // Lets the mapped pages behind `name` go (derived parameters have none;
  // loaded leaves used in place keep theirs): a pass over a checkpoint larger
  // than memory keeps only what it is using resident.
  void release(const std::string& name) const;
  // Copies the parameters to `devices` as new leaves: all on one device, or
  // split by layer over two (layers [0, L/2) and the embeddings on the first,
  // the rest, the final norm and the head on the second), each copied as
  // stored and widened to fp32 there. The host tensors are loaded only if
  // the system checks ask for them.
  void place(const std::vector<torch::Device>& devices, int num_layers);
  void place(const ComputePlacement& placement, int num_layers) { place(placement.devices, num_layers); }
  // What the replay computes with: the placed leaves, else the host ones.
  ParamMap& compute_params() { return placed_.empty() ? params() : placed_; }
  // Parameter names in the spec's order.
  const std::vector<std::string>& order() const { return order_; }

 private:
  std::optional<SafetensorsFile> file_;  // must outlive params_ (in-place tensors point into it)
  ParamMap params_;
  bool loaded_ = false;
  ParamMap placed_;
  std::vector<std::string> order_;
  std::function<torch::Tensor(size_t)> read_;  // the derived parameters' reader, if that is the source
};

// fp32 view (or upcast copy) of one safetensors tensor.
torch::Tensor tensor_from_safetensors(const TensorInfo& info, const std::string& label);
// Rows [row, row + rows) of a stored tensor (along its first dimension), as a
// TensorInfo of its own: checks that walk a checkpoint a slice at a time.
TensorInfo tensor_rows(const TensorInfo& info, int64_t row, int64_t rows);
// The tensor as stored (F32, BF16 or F16): a view of the mapping, or a copy where it is unaligned.
torch::Tensor stored_tensor(const TensorInfo& info, const std::string& label);

}  // namespace nanreplay
