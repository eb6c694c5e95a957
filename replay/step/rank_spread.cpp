// Data-parallel ranks spread over processes; see rank_spread.h.
#include "replay/step/rank_spread.h"

#include <algorithm>
#include <map>
#include <optional>

#include <torch/torch.h>

#include "replay/arch/multi_token_prediction.h"
#include "replay/step/ranks/distributed.h"
#include "replay/step/ranks/pass_wire.h"

namespace nanreplay {

namespace {

class RankSpreadModel final : public StepModel {
 public:
  RankSpreadModel(std::unique_ptr<StepModel> inner, ProcessWorld& world, std::vector<std::vector<int64_t>> shapes,
                  std::shared_ptr<StreamScratch> scratch)
      : inner_(std::move(inner)), world_(world), shapes_(std::move(shapes)), scratch_(std::move(scratch)) {}

  ForwardResult forward_backward(const ModelConfig& model, const Numerics& numerics, ProbeSession& probes,
                                 const torch::Tensor& inputs, const torch::Tensor& targets, double backward_scale,
                                 const std::function<void()>& before_backward,
                                 const StreamedModel::BlockHook& on_block) override {
    if (!spreading_) {
      return inner_->forward_backward(model, numerics, probes, inputs, targets, backward_scale, before_backward,
                                      on_block);
    }
    if (owned(rank_)) {
      ForwardResult result = inner_->forward_backward(model, numerics, probes, inputs, targets, backward_scale,
                                                      before_backward, on_block);
      ProbeHarvest harvest = probes.take_harvest();
      write_harvest(sent_, harvest);
      write_tensor(sent_, result.loss);
      write_tensor(sent_, result.sample_loss);
      write_tensors(sent_, result.mtp_losses);  // model.mtp: each depth's loss
      probes.absorb(std::move(harvest));
      events_.push_back({rank_, nullptr, {}, {}, false, std::nullopt});
      return result;
    }
    // Another process's pass: filled in at the end of the step, before anything reads it.
    if (before_backward) before_backward();
    // Its MTP losses too: their place in the step's mean is this pass's.
    const Event pass{rank_, &probes, torch::zeros({}, torch::kFloat64),
                     probes.enabled() ? torch::zeros({inputs.size(0)}, torch::kFloat64) : torch::Tensor(), false,
                     MtpLossRecorder::reserve()};
    events_.push_back(pass);
    return ForwardResult{pass.value, pass.sample_loss, {}};
  }

  void begin_step(bool whole_step) override {
    spreading_ = whole_step && world_.size() > 1;
    events_.clear();
    sent_ = WireWriter();
    shares_.clear();
    inner_->begin_step(false);
  }

  void begin_rank(int rank) override {
    rank_ = rank;
    if (spreading_ && !owned(rank)) return;
    if (spreading_) inner_->begin_step(false);  // the step's gradients are this rank's share alone
    inner_->begin_rank(rank);
  }

  torch::Tensor end_rank(double inv_scale, int64_t world_size) override {
    if (!spreading_) return inner_->end_rank(inv_scale, world_size);
    Event end{rank_, nullptr, torch::zeros({}, torch::kFloat64), {}, true, std::nullopt};
    if (owned(rank_)) {
      end.value = inner_->end_rank(inv_scale, world_size);
      inner_->end_ranks();
      const GradientSet& share = shares_[rank_] = inner_->step_gradients(/*where_computed=*/true);
      write_tensor(sent_, end.value);
      for (size_t i = 0; i < share.size(); ++i) sent_.pod<int8_t>(static_cast<int8_t>(share[i].scalar_type()));
    }
    events_.push_back(end);
    return end.value;
  }

  void end_ranks() override {
    if (!spreading_) {
      inner_->end_ranks();
      return;
    }
    const std::vector<std::string> streams = world_.all_gather(sent_.take());
    std::vector<WireReader> readers(streams.begin(), streams.end());
    std::vector<std::pair<int, std::vector<c10::ScalarType>>> ranks;  // every ended rank with its gradients' types
    for (Event& e : events_) {
      if (!e.rank_end && owned(e.rank)) continue;  // this process's pass: its probes are here already
      WireReader& in = readers.at(static_cast<size_t>(owner(e.rank)));
      if (!e.rank_end) {
        e.probes->absorb(read_harvest(in));
        e.value.copy_(read_tensor(in));
        const torch::Tensor sample_loss = read_tensor(in);
        if (sample_loss.defined()) e.sample_loss.copy_(sample_loss);
        std::vector<double> depths;
        for (const torch::Tensor& loss : read_tensors(in)) depths.push_back(loss.to(torch::kFloat64).item<double>());
        if (e.mtp_slot) MtpLossRecorder::fill(*e.mtp_slot, std::move(depths));
        continue;
      }
      std::vector<c10::ScalarType> types;
      if (owned(e.rank)) {
        for (size_t i = 0; i < shapes_.size(); ++i) types.push_back(shares_[e.rank][i].scalar_type());
      } else {
        e.value.copy_(read_tensor(in));
        for (size_t i = 0; i < shapes_.size(); ++i) types.push_back(static_cast<c10::ScalarType>(in.pod<int8_t>()));
      }
      ranks.emplace_back(e.rank, std::move(types));
    }
    sum_shares(ranks);
  }

  GradientSet step_gradients(bool) override { return step_; }
  torch::Tensor step_grad_norm() override { return step_norm_; }

 private:
  struct Event {
    int rank;
    ProbeSession* probes;       // another process's pass: where its probes go
    torch::Tensor value;        // a pass's loss, or a rank's gradient norm
    torch::Tensor sample_loss;  // a pass's
    bool rank_end;
    std::optional<size_t> mtp_slot;  // another process's pass: its MTP losses' place (MtpLossRecorder)
  };

  int owner(int rank) const {
    for (int p = 0; p < world_.size(); ++p) {
      if (rank_block(world_.data_ranks(), world_.size(), p).holds(rank)) return p;
    }
    return 0;
  }
  bool owned(int rank) const { return owner(rank) == world_.rank(); }

  // The step's gradients: the ranks' shares added in rank order
  // (replay/step/gradients.cpp's add_rank_gradients). Each process owns a
  // contiguous block of ranks, so the running sum visits each process once:
  // it adds its shares to the sum the process before handed it, hands the
  // sum on, and the last one broadcasts the whole.
  void sum_shares(const std::vector<std::pair<int, std::vector<c10::ScalarType>>>& ranks) {
    std::vector<int> holders;  // the processes holding ended ranks, in rank order
    for (const auto& [rank, types] : ranks) {
      if (holders.empty() || holders.back() != owner(rank)) holders.push_back(owner(rank));
    }
    const auto mine = std::find(holders.begin(), holders.end(), world_.rank());
    std::shared_ptr<ScratchTensors> on_scratch =
        scratch_ ? std::make_shared<ScratchTensors>(scratch_, "step-gradients", shapes_) : nullptr;
    std::vector<torch::Tensor> in_memory;
    std::vector<torch::Tensor> norms;
    for (size_t i = 0; i < shapes_.size(); ++i) {
      torch::Tensor sum;
      if (mine != holders.end()) {
        if (mine != holders.begin()) sum = world_.receive(*(mine - 1));
        for (const auto& [rank, types] : ranks) {
          if (!owned(rank)) continue;
          const torch::Tensor share = shares_.at(rank)[i];
          sum = sum.defined() ? sum + share.to(sum.device()) : share;
        }
        if (mine + 1 != holders.end()) world_.send(sum, *(mine + 1));
      }
      if (mine + 1 != holders.end() || mine == holders.end()) {
        sum = torch::empty(shapes_[i], torch::TensorOptions().dtype(ranks.back().second[i]));
      }
      world_.broadcast(sum, holders.back());
      norms.push_back(sum.norm(2));
      if (on_scratch) {
        on_scratch->write(i, sum);
      } else {
        in_memory.push_back(sum);
      }
    }
    step_ = on_scratch ? GradientSet(std::shared_ptr<const ScratchTensors>(on_scratch)) : GradientSet(in_memory);
    step_norm_ = torch::stack(norms).norm(2);
    shares_.clear();
  }

  std::unique_ptr<StepModel> inner_;
  ProcessWorld& world_;
  std::vector<std::vector<int64_t>> shapes_;
  std::shared_ptr<StreamScratch> scratch_;
  bool spreading_ = false;
  int rank_ = 0;
  std::vector<Event> events_;  // the step's passes and rank ends, in the order every process saw them
  WireWriter sent_;            // this process's passes and rank ends, in that order
  std::map<int, GradientSet> shares_;  // this process's ranks' shares of the step's gradients
  GradientSet step_;
  torch::Tensor step_norm_;
};

}  // namespace

std::unique_ptr<StepModel> spread_ranks(std::unique_ptr<StepModel> inner, ProcessWorld& world,
                                        std::vector<std::vector<int64_t>> shapes,
                                        std::shared_ptr<StreamScratch> scratch) {
  return std::make_unique<RankSpreadModel>(std::move(inner), world, std::move(shapes), std::move(scratch));
}

}  // namespace nanreplay
