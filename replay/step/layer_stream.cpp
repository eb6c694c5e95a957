// Layer-streamed replay; see layer_stream.h. Why the values match the
// in-memory replay bit for bit: each piece runs the same ops on the same
// inputs; autograd sums a tensor's gradient contributions in an order fixed
// by the piece's own graph, which is the same whether the piece's input is a
// leaf or the output of the piece before it; and where a gradient is summed
// across pieces (a tied embedding, a router's outputs read by the router
// losses) there are exactly two terms, whose sum does not depend on order.
#include "replay/step/layer_stream.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <unordered_map>

#include <torch/torch.h>

#include "loaders/base/error.h"
#include "probes/param_table.h"
#include "probes/sites.h"
#include "replay/arch/experts.h"
#include "replay/arch/forward_recompute.h"
#include "replay/arch/multi_token_prediction.h"
#include "replay/step/abandoned_scratch.h"
#include "replay/step/ranks/pass_wire.h"

namespace nanreplay {

namespace {

// A scratch file that cannot be made, written or read (a full disk, a
// read-only one): exit 2 like a failing --out, naming the file and the reason.
OutputError scratch_error(const std::string& what, const std::filesystem::path& path) {
  return OutputError(path.string(), what + ": " + std::strerror(errno));
}

std::atomic<int64_t> expert_tensors_loaded{0};
std::atomic<int64_t> expert_tensors_of{0};

// [layer][expert]: the slots in `order` of each expert's parameters (none in a dense layer).
std::vector<std::vector<std::vector<size_t>>> expert_slots_of(const ModelConfig& model,
                                                              const std::vector<std::string>& order) {
  std::vector<std::vector<std::vector<size_t>>> out(static_cast<size_t>(model.num_layers));
  if (!model.moe) return out;
  std::unordered_map<std::string, size_t> slot_of;
  for (size_t i = 0; i < order.size(); ++i) slot_of.emplace(order[i], i);
  for (int layer = 0; layer < static_cast<int>(model.num_layers); ++layer) {
    if (!model.moe_layer(layer)) continue;
    std::vector<std::vector<size_t>>& experts = out[static_cast<size_t>(layer)];
    experts.resize(static_cast<size_t>(model.moe->num_experts));
    for (const ParamDef& def : param_table(model.arch)) {
      if (!is_per_expert(def) || !has_parameter(def, model, layer)) continue;
      for (int e = 0; e < model.moe->num_experts; ++e) {
        experts[static_cast<size_t>(e)].push_back(slot_of.at(param_key(model.arch, def.role, layer, e)));
      }
    }
  }
  return out;
}

}  // namespace

ExpertLoads streamed_expert_loads() { return {expert_tensors_loaded.load(), expert_tensors_of.load()}; }

StreamScratch::StreamScratch(const std::filesystem::path& parent) {
  // Under the parent's lock, so that a run clearing abandoned scratch cannot
  // take ours for one between its creation and its lock.
  const DirectoryLock parent_lock(parent, true);
  remove_abandoned_scratch(parent);
  std::string pattern = (parent / (std::string(kScratchPrefix) + "XXXXXX")).string();
  if (mkdtemp(pattern.data()) == nullptr) {
    throw scratch_error("cannot create a scratch directory here", parent);
  }
  dir = pattern;
  lock.emplace(dir, false);
  exit_cleanup.emplace(dir);
}

ComputePlacement streamed_if(ComputePlacement placement, const std::optional<std::filesystem::path>& scratch_parent) {
  if (scratch_parent) placement.stream = std::make_shared<StreamScratch>(*scratch_parent);
  return placement;
}

StreamScratch::~StreamScratch() {
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

ScratchTensors::ScratchTensors(std::shared_ptr<StreamScratch> scratch, const std::string& name,
                               std::vector<std::vector<int64_t>> shapes)
    : scratch_(std::move(scratch)), shapes_(std::move(shapes)), held_(shapes_.size(), false) {
  static std::atomic<int> serial{0};
  path_ = scratch_->dir / (name + "-" + std::to_string(serial++) + ".f32");
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd_ < 0) throw scratch_error("cannot create scratch file", path_);
  uint64_t offset = 0;
  for (const std::vector<int64_t>& shape : shapes_) {
    offsets_.push_back(offset);
    uint64_t numel = 1;
    for (int64_t d : shape) numel *= static_cast<uint64_t>(d);
    offset += numel * sizeof(float);
  }
}

ScratchTensors::~ScratchTensors() {
  ::close(fd_);
  ::unlink(path_.c_str());
}

void ScratchTensors::write(size_t slot, const torch::Tensor& value) {
  const torch::Tensor host = value.detach().to(torch::kCPU, torch::kFloat32).contiguous();
  const char* data = static_cast<const char*>(host.data_ptr());
  const size_t bytes = static_cast<size_t>(host.numel()) * sizeof(float);
  for (size_t done = 0; done < bytes;) {
    const ssize_t n = ::pwrite(fd_, data + done, bytes - done, static_cast<off_t>(offsets_.at(slot) + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw scratch_error("cannot write scratch file", path_);
    done += static_cast<size_t>(n);
  }
  held_.at(slot) = true;
}

torch::Tensor ScratchTensors::read(size_t slot) const {
  if (!held_.at(slot)) throw std::logic_error("scratch slot read before it was written");
  torch::Tensor out = torch::empty(shapes_.at(slot), torch::kFloat32);
  char* data = static_cast<char*>(out.data_ptr());
  const size_t bytes = static_cast<size_t>(out.numel()) * sizeof(float);
  for (size_t done = 0; done < bytes;) {
    const ssize_t n = ::pread(fd_, data + done, bytes - done, static_cast<off_t>(offsets_[slot] + done));
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) errno = EIO;  // shorter than written: something else truncated it
    if (n <= 0) throw scratch_error("cannot read scratch file", path_);
    done += static_cast<size_t>(n);
  }
  return out;
}

void ScratchTensors::forget_all() { held_.assign(held_.size(), false); }

StreamedModel::StreamedModel(ModelCheckpoint& checkpoint, const ModelConfig& model, const torch::Device& device,
                             std::shared_ptr<StreamScratch> scratch)
    : checkpoint_(checkpoint), device_(device), scratch_(std::move(scratch)), order_(checkpoint.order()) {
  blocks_.resize(static_cast<size_t>(model.num_layers));
  const std::vector<ParamSpec> specs = expected_parameters(model);
  for (size_t i = 0; i < order_.size(); ++i) {
    // model.mtp's blocks (past the decoder's layers) run inside the head: loaded with it.
    const int layer = layer_of_parameter(order_[i]);
    const bool outer = layer < 0 || is_mtp_layer(model, layer);
    (outer ? outer_ : blocks_.at(static_cast<size_t>(layer))).push_back(i);
    shapes_.push_back(specs.at(i).shape);
  }
  expert_slots_ = expert_slots_of(model, order_);
  for (size_t layer = 0; layer < blocks_.size(); ++layer) {
    std::vector<bool> of_expert(order_.size(), false);
    for (const std::vector<size_t>& slots : expert_slots_[layer]) {
      for (size_t slot : slots) of_expert[slot] = true;
    }
    block_cores_.emplace_back();
    for (size_t slot : blocks_[layer]) {
      if (!of_expert[slot]) block_cores_.back().push_back(slot);
    }
  }
  world_ = default_world();
  if (world_ && world_->split() != ProcessSplit::kLayers) world_ = nullptr;  // each process replays whole ranks
  if (world_) {
    ranges_ = world_->layer_ranges(static_cast<int>(model.num_layers));
    keep_blocks_ = world_->keep_blocks();
    for (const std::string& name : order_) slot_owner_.push_back(owner(layer_of_parameter(name)));
  }
  begin_step();
}

void StreamedModel::begin_step() {
  rank_grads_ = std::make_shared<ScratchTensors>(scratch_, "rank-gradients", shapes_);
  zero_pass_.assign(order_.size(), false);
  step_grads_.reset();
}

StreamedModel::~StreamedModel() = default;

ParamMap StreamedModel::load(const std::vector<size_t>& slots, bool leaves) const {
  ParamMap params;
  for (size_t slot : slots) {
    torch::Tensor t = checkpoint_.param(order_[slot]).detach();
    if (device_ != t.device()) t = t.to(device_);
    if (leaves) t.requires_grad_(true);
    params.emplace(order_[slot], t);
  }
  return params;
}

// The block's parameters but its experts', then (replay/arch/experts.h) the
// experts its router sends a token to, as it asks for them.
torch::Tensor StreamedModel::compute_block(ModelPass& pass, int layer, const torch::Tensor& x, bool leaves,
                                           BlockLoad& held) {
  const size_t l = static_cast<size_t>(layer);
  held.slots = block_cores_[l];
  held.params = load(held.slots, leaves);
  const ExpertSource source([&](int at, const std::vector<int>& experts) {
    ParamMap fetched;
    for (int e : experts) {
      const std::vector<size_t>& slots = expert_slots_.at(static_cast<size_t>(at)).at(static_cast<size_t>(e));
      held.slots.insert(held.slots.end(), slots.begin(), slots.end());
      expert_tensors_loaded += static_cast<int64_t>(slots.size());
      fetched.merge(load(slots, leaves));
    }
    held.experts.insert(fetched.begin(), fetched.end());
    return fetched;
  });
  for (const std::vector<size_t>& slots : expert_slots_[l]) expert_tensors_of += static_cast<int64_t>(slots.size());
  return pass.block(held.params, layer, x);
}

void StreamedModel::release(const std::vector<size_t>& slots) const {
  for (size_t slot : slots) checkpoint_.release(order_[slot]);
}

void StreamedModel::release_block(const std::vector<size_t>& slots) const {
  if (!keep_blocks_) release(slots);
}

int StreamedModel::owner(int layer) const {
  if (!world_ || layer < 0) return 0;
  for (size_t p = 0; p < ranges_.size(); ++p) {
    if (ranges_[p].holds(layer)) return static_cast<int>(p);
  }
  return 0;
}

torch::Tensor StreamedModel::arriving(const torch::Tensor& here, int from) const {
  if (!world_ || from == world_->rank()) return here;
  return world_->receive(from).to(device_);
}

void StreamedModel::leaving(const torch::Tensor& value, int to) const {
  if (world_ && to != world_->rank()) world_->send(value, to);
}

RouterOutputs StreamedModel::gather_routers(const RouterOutputs& own, const ModelConfig& model) const {
  if (!world_ || !model.moe) return own;
  RouterOutputs all;
  size_t next_own = 0;
  for (int layer = 0; layer < static_cast<int>(model.num_layers); ++layer) {
    if (!model.moe_layer(layer)) continue;  // a dense layer has no router (model.moe.layers)
    const int from = owner(layer);
    if (from == world_->rank()) {
      all.logits.push_back(own.logits.at(next_own));
      all.probs.push_back(own.probs.at(next_own));
      all.expert_tokens.push_back(own.expert_tokens.at(next_own++));
      continue;
    }
    all.logits.push_back(world_->receive(from).to(device_));
    all.probs.push_back(world_->receive(from).to(device_));
    all.expert_tokens.push_back(world_->receive(from).to(device_));
  }
  return all;
}

void StreamedModel::share_pass(ProbeSession& probes, ForwardResult& result) const {
  WireWriter out;
  write_harvest(out, probes.take_harvest());
  if (world_->rank() == 0) {
    write_tensor(out, result.loss);
    write_tensor(out, result.sample_loss);
    write_tensors(out, result.mtp_losses);  // model.mtp: each depth's loss
  }
  const std::vector<std::string> all = world_->all_gather(out.take());
  for (size_t r = 0; r < all.size(); ++r) {
    WireReader in(all[r]);
    probes.absorb(read_harvest(in));
    if (r != 0) continue;
    torch::Tensor loss = read_tensor(in);
    torch::Tensor sample_loss = read_tensor(in);
    const std::vector<torch::Tensor> mtp_losses = read_tensors(in);
    if (world_->rank() == 0) continue;
    result = ForwardResult{loss, sample_loss, mtp_losses};
    MtpLossRecorder::record(mtp_losses);  // rank 0 recorded them as it computed them
  }
}

void StreamedModel::share_rank_gradients() {
  for (size_t slot = 0; slot < order_.size(); ++slot) {
    const bool mine = slot_owner_[slot] == world_->rank();
    torch::Tensor grad = mine ? rank_gradient(slot) : torch::zeros(shapes_[slot], torch::kFloat32);
    world_->broadcast(grad, slot_owner_[slot]);
    if (!mine || !rank_grads_->holds(slot)) rank_grads_->write(slot, grad);
  }
}

// As AccumulateGrad across passes: the first pass's gradient, then old + new.
void StreamedModel::accumulate(const std::vector<size_t>& slots, const ParamMap& leaves) {
  for (size_t slot : slots) {
    const torch::Tensor grad = leaves.at(order_[slot]).grad();
    if (!grad.defined()) continue;
    rank_grads_->write(slot, rank_grads_->holds(slot) ? rank_grads_->read(slot) + grad.cpu() : grad);
  }
}

void StreamedModel::clear_gradients() {
  rank_grads_->forget_all();
  zero_pass_.assign(order_.size(), false);
}

// An expert no token reached in some pass was not loaded there; in memory its
// zero gradient was added to .grad, which changes nothing but a -0.0 (to
// +0.0: x + 0 is x otherwise, and adding zero again changes nothing more), so
// adding zeros once here gives the same bits whichever pass it was.
torch::Tensor StreamedModel::rank_gradient(size_t slot) const {
  if (!rank_grads_->holds(slot)) return torch::zeros(shapes_[slot], torch::kFloat32);
  const torch::Tensor grad = rank_grads_->read(slot);
  return zero_pass_[slot] ? grad + torch::zeros_like(grad) : grad;
}

// What one pass holds between its stages.
struct StreamedModel::PassState {
  PassState(const ModelConfig& model_config, const Numerics& numerics, ProbeSession& session, IndexRange layers_here,
            bool computes_outer)
      : model(model_config), probes(session), pass(model_config, numerics, session), mine(layers_here),
        outer_here(computes_outer), stream(static_cast<size_t>(model_config.num_layers) + 1),
        router_logit_grads(static_cast<size_t>(model_config.num_layers)),
        router_prob_grads(static_cast<size_t>(model_config.num_layers)) {}
  const ModelConfig& model;
  ProbeSession& probes;
  ModelPass pass;
  IndexRange mine;        // this process's layers
  bool outer_here;        // the embeddings, the head and the loss are computed here
  ParamMap outer;         // loaded for the whole pass where outer_here
  std::vector<torch::Tensor> stream;  // what enters each block, then the head
  RouterOutputs routers;  // every layer's, where outer_here
  std::vector<torch::Tensor> router_logit_grads, router_prob_grads;
};

// The blocks of this process, without a graph (it is built again per block
// in the backward); the residual stream arrives from the previous layer's
// process and leaves for the next one's.
void StreamedModel::forward_blocks(PassState& s, const torch::Tensor& inputs, const BlockHook& on_block) {
  const int layers = static_cast<int>(s.model.num_layers);
  torch::Tensor x = s.outer_here ? s.pass.embed(s.outer, inputs) : torch::Tensor();
  if (s.mine.first < s.mine.end) {
    x = arriving(x, s.mine.first == 0 ? 0 : owner(s.mine.first - 1));
    for (int layer = s.mine.first; layer < s.mine.end; ++layer) {
      if (on_block) on_block(layer, "forward");
      s.stream[static_cast<size_t>(layer)] = x;
      BlockLoad held;
      x = compute_block(s.pass, layer, x, /*leaves=*/false, held);
      release_block(held.slots);
    }
    leaving(x, s.mine.end == layers ? 0 : owner(s.mine.end));
  }
  s.stream.back() = x;
}

// The head and the loss where they are computed (the router losses read
// every layer's routers); elsewhere this process's routers go to rank 0.
ForwardResult StreamedModel::forward_head(PassState& s, const torch::Tensor& targets) {
  const int layers = static_cast<int>(s.model.num_layers);
  if (s.outer_here) {
    const torch::Tensor x = s.stream.back() = arriving(s.stream.back(), owner(layers - 1));
    s.routers = s.pass.router() = gather_routers(s.pass.router(), s.model);
    return s.pass.head(s.outer, x, targets);
  }
  if (s.model.moe) {
    for (size_t i = 0; i < s.pass.router().logits.size(); ++i) {
      world_->send(s.pass.router().logits[i], 0);
      world_->send(s.pass.router().probs[i], 0);
      world_->send(s.pass.router().expert_tokens[i], 0);
    }
  }
  return {};
}

// The head again, from the last block's output and the routers' outputs as
// leaves: the gradient entering the last block, and each router's.
torch::Tensor StreamedModel::backward_head(PassState& s, const torch::Tensor& targets, double backward_scale) {
  const int layers = static_cast<int>(s.model.num_layers);
  s.probes.begin_recompute();
  const torch::Tensor head_input = s.stream.back().detach().requires_grad_(true);
  RouterOutputs& head_routers = s.pass.router();
  head_routers.expert_tokens = s.routers.expert_tokens;
  head_routers.logits.clear();
  head_routers.probs.clear();
  for (const torch::Tensor& t : s.routers.logits) head_routers.logits.push_back(t.detach().requires_grad_(true));
  for (const torch::Tensor& t : s.routers.probs) head_routers.probs.push_back(t.detach().requires_grad_(true));
  const RouterOutputs router_leaves = head_routers;
  (s.pass.head(s.outer, head_input, targets).loss * backward_scale).backward();
  const torch::Tensor grad = head_input.grad();
  std::vector<size_t> router_layers;  // the layers with experts, in order: one router entry each
  for (int layer = 0; layer < layers; ++layer) {
    if (s.model.moe_layer(layer)) router_layers.push_back(static_cast<size_t>(layer));
  }
  for (size_t l = 0; l < router_leaves.logits.size(); ++l) {
    s.router_logit_grads[router_layers.at(l)] = router_leaves.logits[l].grad();
    s.router_prob_grads[router_layers.at(l)] = router_leaves.probs[l].grad();
  }
  leaving(grad, owner(layers - 1));
  for (int layer = layers - 1; world_ && s.model.moe && layer >= 0; --layer) {  // in the order the owners need them
    if (owner(layer) == 0 || !s.model.moe_layer(layer)) continue;
    world_->send(s.router_logit_grads[static_cast<size_t>(layer)], owner(layer));
    world_->send(s.router_prob_grads[static_cast<size_t>(layer)], owner(layer));
  }
  return grad;
}

// This process's blocks, last first, each forward again with its graph and
// then backward; returns the gradient entering its first block.
torch::Tensor StreamedModel::backward_blocks(PassState& s, torch::Tensor grad, const BlockHook& on_block) {
  const int layers = static_cast<int>(s.model.num_layers);
  if (s.mine.first >= s.mine.end) return grad;
  grad = arriving(grad, s.mine.end == layers ? 0 : owner(s.mine.end));
  for (int layer = s.mine.end - 1; layer >= s.mine.first; --layer) {
    if (on_block) on_block(layer, "backward");
    const size_t l = static_cast<size_t>(layer);
    if (s.model.moe_layer(layer) && !s.outer_here) {
      s.router_logit_grads[l] = world_->receive(0);
      s.router_prob_grads[l] = world_->receive(0);
    }
    s.probes.begin_recompute();
    s.pass.router() = RouterOutputs{};
    const torch::Tensor input = s.stream[l].detach().requires_grad_(true);
    BlockLoad held;
    std::vector<torch::Tensor> roots{compute_block(s.pass, layer, input, /*leaves=*/true, held)};
    std::vector<torch::Tensor> grads{grad};
    if (s.model.moe_layer(layer)) {  // the router losses' gradients enter at the block's router outputs
      for (const auto& [leaf_grad, again] : {std::pair(s.router_logit_grads[l], s.pass.router().logits.at(0)),
                                             std::pair(s.router_prob_grads[l], s.pass.router().probs.at(0))}) {
        if (!leaf_grad.defined()) continue;
        roots.push_back(again);
        grads.push_back(leaf_grad.to(again.device()));
      }
    }
    torch::autograd::backward(roots, grads);
    grad = input.grad();
    s.stream[l] = torch::Tensor();
    accumulate(block_cores_[l], held.params);
    for (const std::vector<size_t>& slots : expert_slots_[l]) {
      const bool fetched = held.experts.count(order_[slots.front()]) != 0;
      if (fetched) accumulate(slots, held.experts);
      for (size_t slot : slots) zero_pass_[slot] = zero_pass_[slot] || !fetched;
    }
    release_block(held.slots);
  }
  leaving(grad, s.mine.first == 0 ? 0 : owner(s.mine.first - 1));
  return grad;
}

// Across processes (distributed.h) the same pieces run where their layers
// are: the residual stream goes to the next layer's process, the last
// block's output back to rank 0 for the head, and the gradients the reverse
// way; each value is the one a single process computes.
ForwardResult StreamedModel::forward_backward(const ModelConfig& model, const Numerics& numerics, ProbeSession& probes,
                                              const torch::Tensor& inputs, const torch::Tensor& targets,
                                              double backward_scale, const std::function<void()>& before_backward,
                                              const BlockHook& on_block) {
  const int layers = static_cast<int>(model.num_layers);
  const int me = world_ ? world_->rank() : 0;
  PassState s(model, numerics, probes, world_ ? ranges_.at(static_cast<size_t>(me)) : IndexRange{0, layers}, me == 0);
  // The embeddings and the head stay for the whole pass: a tied head and the
  // embedding are one leaf, whose gradient sums both uses as autograd's would.
  if (s.outer_here) s.outer = load(outer_, /*leaves=*/true);
  ForwardResult result;
  {
    torch::NoGradGuard no_grad;  // the forward's values and statistics; its graph is built again per block
    forward_blocks(s, inputs, on_block);
    result = forward_head(s, targets);
  }
  if (before_backward) before_backward();
  {
    const ForwardRecompute recompute;  // what the forward counted is not counted again
    torch::Tensor grad;                // the gradient leaving the block being computed
    if (s.outer_here) grad = backward_head(s, targets, backward_scale);
    grad = backward_blocks(s, grad, on_block);
    if (s.outer_here) {  // the embeddings again, from the gradient entering the first block
      probes.begin_recompute();
      torch::autograd::backward({s.pass.embed(s.outer, inputs)}, {grad});
      accumulate(outer_, s.outer);
      release(outer_);
      result.loss = result.loss.detach();
    }
  }
  if (world_) share_pass(probes, result);
  return result;
}

torch::Tensor StreamedModel::add_rank_gradients(double inv_scale, int64_t world_size) {
  if (world_) share_rank_gradients();
  // One rank: the step's gradients are the rank's, unscaled in their own slots.
  if (world_size == 1) {
    step_grads_ = rank_grads_;
  } else if (!step_grads_) {
    step_grads_ = std::make_shared<ScratchTensors>(scratch_, "step-gradients", shapes_);
  }
  std::vector<torch::Tensor> norms;
  for (size_t slot = 0; slot < order_.size(); ++slot) {
    // Whether the slot holds the rank's gradient as it is (else zeros, or a zero added, made here).
    const bool as_written = rank_grads_->holds(slot) && !zero_pass_[slot];
    const torch::Tensor grad = rank_gradient(slot);
    // The arithmetic of add_rank_gradients (replay/step/gradients.cpp).
    const torch::Tensor own = inv_scale == 1.0 ? grad : grad * inv_scale;
    norms.push_back(own.norm(2));
    if (world_size == 1) {
      if (inv_scale != 1.0 || !as_written) rank_grads_->write(slot, own);
      continue;
    }
    const torch::Tensor share = own / world_size;
    step_grads_->write(slot, step_grads_->holds(slot) ? step_grads_->read(slot) + share : share);
  }
  return torch::stack(norms).norm(2);
}

GradientSet StreamedModel::step_gradients() const { return GradientSet(std::shared_ptr<const ScratchTensors>(step_grads_)); }

torch::Tensor StreamedModel::step_grad_norm() const {
  std::vector<torch::Tensor> norms;
  for (size_t slot = 0; slot < order_.size(); ++slot) norms.push_back(step_grads_->read(slot).norm(2));
  return torch::stack(norms).norm(2);
}

}  // namespace nanreplay
