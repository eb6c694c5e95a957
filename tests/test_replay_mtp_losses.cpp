// What a step records once per pass: multi-token prediction's depth losses
// (MtpLossRecorder, replay/arch/multi_token_prediction.h) summed in pass order
// whichever process computed a pass, and nothing recorded twice by the
// layer-streamed backward's recomputation (ForwardRecompute).
#include <catch2/catch.hpp>

#include <vector>

#include <torch/torch.h>

#include "replay/arch/forward_recompute.h"
#include "replay/arch/multi_token_prediction.h"
#include "replay/arch/router_logit_max.h"

namespace nanreplay {

namespace {

std::vector<torch::Tensor> depth_losses_of(std::vector<double> values) {
  std::vector<torch::Tensor> out;
  for (const double v : values) out.push_back(torch::tensor(v, torch::kFloat64));
  return out;
}

}  // namespace

TEST_CASE("MtpLossRecorder: the mean over passes, per depth", "[mtp]") {
  const MtpLossRecorder recorder;
  MtpLossRecorder::record(depth_losses_of({1.0, 4.0}));
  MtpLossRecorder::record(depth_losses_of({3.0, 8.0}));
  CHECK(recorder.means() == std::vector<double>{2.0, 6.0});
}

TEST_CASE("MtpLossRecorder: nothing recorded without a recorder, or inside a ForwardRecompute", "[mtp]") {
  MtpLossRecorder::record(depth_losses_of({100.0}));  // no recorder alive: dropped
  CHECK_FALSE(MtpLossRecorder::reserve().has_value());
  const MtpLossRecorder recorder;
  MtpLossRecorder::record(depth_losses_of({1.0}));
  {
    const ForwardRecompute recompute;
    CHECK(ForwardRecompute::active());
    MtpLossRecorder::record(depth_losses_of({100.0}));  // the streamed backward's second computation
  }
  CHECK_FALSE(ForwardRecompute::active());
  MtpLossRecorder::record(depth_losses_of({3.0}));
  CHECK(recorder.means() == std::vector<double>{2.0});
}

TEST_CASE("ForwardRecompute: a nested scope leaves the outer one open", "[mtp]") {
  {
    const ForwardRecompute outer;
    { const ForwardRecompute inner; }
    CHECK(ForwardRecompute::active());
  }
  CHECK_FALSE(ForwardRecompute::active());
}

TEST_CASE("MtpLossRecorder: a pass another process computed counts in its place, not on arrival", "[mtp]") {
  // Pass order 1, 1e17, -1e17 sums to 0 in doubles ((1 + 1e17) rounds to 1e17);
  // summed as the values arrive (the first pass last) it would be 1.
  const MtpLossRecorder recorder;
  const std::optional<size_t> first = MtpLossRecorder::reserve();
  REQUIRE(first.has_value());
  MtpLossRecorder::record(depth_losses_of({1e17}));
  MtpLossRecorder::record(depth_losses_of({-1e17}));
  MtpLossRecorder::fill(*first, {1.0});
  CHECK(recorder.means() == std::vector<double>{0.0});
}

TEST_CASE("RouterLogitRecorder: a block recomputed for the streamed backward counts its tokens once", "[mtp]") {
  const RouterLogitRecorder recorder(1, 2);
  const torch::Tensor counts = torch::tensor(std::vector<int64_t>{3, 5}, torch::kInt64);
  RouterLogitRecorder::record_tokens(0, counts);
  {
    const ForwardRecompute recompute;
    RouterLogitRecorder::record_tokens(0, counts);
  }
  CHECK(recorder.tokens() == std::vector<std::vector<int64_t>>{{3, 5}});
}

}  // namespace nanreplay
