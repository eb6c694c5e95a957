// The layer-streamed replay: a model larger than memory replayed one block
// at a time. The forward loads each block's parameters from the mapped
// checkpoint, keeps only the residual stream entering it and lets the
// parameters go; the backward loads each block again, last first, computes
// it again from its saved input (replay/arch/model.h's ModelPass, the same
// arithmetic) and runs autograd through that block alone, from the gradient
// the block above handed down. Parameter gradients accumulate on scratch
// files, so a step's gradients are never all in memory at once. A block with
// experts loads only the experts its router sent a token to (ExpertSource,
// replay/arch/experts.h), in the forward and again in the backward; an
// expert no token reached has a zero gradient, written without loading it.
// model.mtp's depths run in the head's piece (ModelPass::head), their
// parameters loaded with the embeddings and the head for the whole pass.
// The values, the probe records and the gradients are those of the in-memory
// replay bit for bit (tests/py/test_stream_presets.py shows it on every preset).
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/types.h>

#include "loaders/base/directory_lock.h"
#include "loaders/base/exit_cleanup.h"
#include "replay/step/checkpoint.h"
#include "replay/step/ranks/distributed.h"
#include "replay/arch/model.h"

namespace nanreplay {

// A directory of scratch files, made inside `parent` as
// nanreplay-scratch-XXXXXX and removed with everything in it when the last
// owner lets go (at the end, on an error or an interrupt: unwinding). A run
// killed outright (SIGKILL, the OOM killer) cannot remove it; its lock goes
// with the process, so the next streamed run into the same parent finds the
// directory unlocked and removes it.
struct StreamScratch {
  explicit StreamScratch(const std::filesystem::path& parent);
  ~StreamScratch();
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  std::filesystem::path dir;
  std::optional<DirectoryLock> lock;        // held while this process lives: "not abandoned"
  std::optional<ExitCleanup> exit_cleanup;  // removed too on an exit without unwinding
};

// fp32 tensors of fixed shapes in one scratch file, a slot each, read and
// written whole (pread/pwrite: nothing stays mapped, so nothing stays
// resident). Keeps its directory while it lives.
class ScratchTensors {
 public:
  ScratchTensors(std::shared_ptr<StreamScratch> scratch, const std::string& name,
                 std::vector<std::vector<int64_t>> shapes);
  ~ScratchTensors();
  ScratchTensors(const ScratchTensors&) = delete;
  ScratchTensors& operator=(const ScratchTensors&) = delete;

  size_t size() const { return shapes_.size(); }
  bool holds(size_t slot) const { return held_.at(slot); }
  void write(size_t slot, const torch::Tensor& value);
  torch::Tensor read(size_t slot) const;  // a new host tensor; the slot must hold a value
  void forget_all();                      // every slot empty again (the file keeps its size)

 private:
  std::shared_ptr<StreamScratch> scratch_;
  std::filesystem::path path_;
  int fd_ = -1;
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<uint64_t> offsets_;
  std::vector<bool> held_;
};

// A step's parameter gradients: in memory, or on a scratch file (read one at
// a time: a caller that walks them holds one at once).
class GradientSet {
 public:
  GradientSet() = default;
  GradientSet(std::vector<torch::Tensor> in_memory) : memory_(std::move(in_memory)) {}  // NOLINT: implicit on purpose
  explicit GradientSet(std::shared_ptr<const ScratchTensors> scratch) : scratch_(std::move(scratch)) {}
  size_t size() const { return scratch_ ? scratch_->size() : memory_.size(); }
  bool empty() const { return size() == 0; }
  torch::Tensor operator[](size_t i) const { return scratch_ ? scratch_->read(i) : memory_[i]; }
  torch::Tensor at(size_t i) const { return scratch_ ? scratch_->read(i) : memory_.at(i); }
  // Every gradient at once (a model small enough: the synthetic trainer's).
  std::vector<torch::Tensor> all() const {
    if (!scratch_) return memory_;
    std::vector<torch::Tensor> out;
    for (size_t i = 0; i < size(); ++i) out.push_back(scratch_->read(i));
    return out;
  }

 private:
  std::vector<torch::Tensor> memory_;
  std::shared_ptr<const ScratchTensors> scratch_;
};

// `placement`, streamed layer by layer with its scratch files in a new
// directory inside `scratch_parent` when that is set.
ComputePlacement streamed_if(ComputePlacement placement, const std::optional<std::filesystem::path>& scratch_parent);

// Expert parameter tensors the layer-streamed replays of this process have
// loaded, and how many they would have loaded had each block they computed
// loaded all its experts: a mixture-of-experts block loads only the experts
// its router sent a token to (replay/arch/experts.h's ExpertSource), so
// `loaded` stays below `of` when some expert got none (tests, the bench).
struct ExpertLoads {
  int64_t loaded = 0;
  int64_t of = 0;
};
ExpertLoads streamed_expert_loads();

// A checkpoint replayed layer by layer on `device`, its gradients on scratch
// files in `scratch`. Passes accumulate gradients as autograd's .grad does
// across micro-batches; add_rank_gradients reduces them as DDP does
// (replay/step/gradients.h, the same arithmetic).
class StreamedModel {
 public:
  StreamedModel(ModelCheckpoint& checkpoint, const ModelConfig& model, const torch::Device& device,
                std::shared_ptr<StreamScratch> scratch);
  ~StreamedModel();

  // One batch forward and backward (loss * backward_scale). `before_backward`
  // runs between the two; `on_block(layer, "forward" | "backward")` before
  // each block (progress within a long step).
  using BlockHook = std::function<void(int layer, const char* phase)>;
  ForwardResult forward_backward(const ModelConfig& model, const Numerics& numerics, ProbeSession& probes,
                                 const torch::Tensor& inputs, const torch::Tensor& targets, double backward_scale,
                                 const std::function<void()>& before_backward, const BlockHook& on_block = {});
  // Before a step: new scratch files for its gradients (a GradientSet of
  // an earlier step keeps its own until it is dropped).
  void begin_step();
  // Forgets the accumulated gradients (before a rank's first micro-batch).
  void clear_gradients();
  // The accumulated gradients unscaled by `inv_scale`, divided by the world
  // size and added to the step's; returns the rank's gradient norm (0-dim).
  torch::Tensor add_rank_gradients(double inv_scale, int64_t world_size);
  // After the last rank: the step's gradients (on scratch) and their global norm.
  GradientSet step_gradients() const;
  torch::Tensor step_grad_norm() const;

 private:
  ParamMap load(const std::vector<size_t>& slots, bool leaves) const;
  // What one computation of a block loaded: its parameters but the experts,
  // and the experts it routed a token to (fetched while it runs).
  struct BlockLoad {
    std::vector<size_t> slots;  // every one loaded
    ParamMap params;            // the block's but the experts'
    ParamMap experts;           // the experts' fetched
  };
  torch::Tensor compute_block(ModelPass& pass, int layer, const torch::Tensor& x, bool leaves, BlockLoad& held);
  // This rank's gradient of `slot` as the in-memory replay accumulates it (zeros: none written).
  torch::Tensor rank_gradient(size_t slot) const;
  void release(const std::vector<size_t>& slots) const;
  void release_block(const std::vector<size_t>& slots) const;  // unless this process keeps its blocks
  void accumulate(const std::vector<size_t>& slots, const ParamMap& leaves);
  // Across processes (null world_: all of it here, nothing sent).
  int owner(int layer) const;  // the process computing `layer`
  torch::Tensor arriving(const torch::Tensor& here, int from) const;  // `here`, or what `from` sends
  void leaving(const torch::Tensor& value, int to) const;              // sent unless `to` is this process
  RouterOutputs gather_routers(const RouterOutputs& own, const ModelConfig& model) const;
  void share_pass(ProbeSession& probes, ForwardResult& result) const;  // every process's probes, rank 0's loss
  void share_rank_gradients();                                         // each from its owner to every process
  // The stages of forward_backward, on what one pass holds (layer_stream.cpp).
  struct PassState;
  void forward_blocks(PassState& s, const torch::Tensor& inputs, const BlockHook& on_block);
  ForwardResult forward_head(PassState& s, const torch::Tensor& targets);
  torch::Tensor backward_head(PassState& s, const torch::Tensor& targets, double backward_scale);
  torch::Tensor backward_blocks(PassState& s, torch::Tensor grad, const BlockHook& on_block);

  ModelCheckpoint& checkpoint_;
  torch::Device device_;
  std::shared_ptr<StreamScratch> scratch_;
  std::vector<std::string> order_;
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<size_t> outer_;                // embeddings, final norm, head: loaded once a pass
  std::vector<std::vector<size_t>> blocks_;  // each block's parameters
  std::vector<std::vector<size_t>> block_cores_;               // each block's but its experts'
  std::vector<std::vector<std::vector<size_t>>> expert_slots_;  // [layer][expert]: its parameters
  // Expert parameters some pass of this rank gave a zero gradient, not loaded
  // (no token reached the expert): in memory that zero was added.
  std::vector<bool> zero_pass_;
  std::shared_ptr<ScratchTensors> rank_grads_;  // this rank's, accumulated over its micro-batches
  std::shared_ptr<ScratchTensors> step_grads_;  // the step's: the ranks' reduced (the rank's own with one rank)
  ProcessWorld* world_ = nullptr;               // set: the layers split across processes
  std::vector<IndexRange> ranges_;              // each process's layers
  std::vector<int> slot_owner_;                 // each parameter's process
  bool keep_blocks_ = false;
};

}  // namespace nanreplay
