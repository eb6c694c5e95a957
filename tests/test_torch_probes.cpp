// Probe mechanics on real tensors: rounding of values and gradients, causal
// masking, decoding of the first non-finite element, backward ordering.
#include <catch2/catch.hpp>

#include <torch/torch.h>

#include "replay/probing/numerics.h"
#include "replay/probing/probe_session.h"

using namespace nanreplay;

namespace {
ModelConfig one_layer() {
  ModelConfig m;
  m.arch = Arch::kLlama;
  m.vocab_size = 16;
  m.hidden_size = 8;
  m.num_layers = 1;
  m.num_heads = 2;
  m.num_kv_heads = 2;
  m.intermediate_size = 8;
  m.max_seq_len = 8;
  return m;
}
const ProbeRecord& find(const std::vector<ProbeRecord>& records, const std::string& site, Phase phase,
                        int head = -1) {
  for (const auto& r : records) {
    if (probe_name(r) == site && r.phase == phase && r.head == head) return r;
  }
  FAIL("no record for " << site);
  throw std::logic_error("unreachable");
}
}  // namespace

TEST_CASE("fp16 rounding overflows at the site and rounds the gradient too", "[torch][numerics]") {
  const Numerics fp16(Compute::kFp16);
  const ModelConfig m = one_layer();
  ProbeSession probes({7, 0, 0, {11}}, fp16, true, m);
  torch::Tensor x = torch::tensor({1.0f, 70000.0f, 1.0f / 3.0f}).view({1, 1, 3}).requires_grad_(true);
  const torch::Tensor y = probes.site({SiteId::kEmbed, -1}, x * 1.0);
  CHECK(std::isinf(y[0][0][1].item<float>()));
  CHECK(y[0][0][2].item<float>() == static_cast<float>(c10::Half(1.0f / 3.0f)));
  // Gradient 1/3 per element: the site's backward record sees it rounded to fp16.
  (y.index({0, 0, 0}) / 3.0).backward();
  const auto records = probes.take_records();
  const ProbeRecord fwd = find(records, "embed", Phase::kForward);
  CHECK(fwd.stats.inf_count == 1);
  CHECK(fwd.stats.first_nonfinite == 1);
  CHECK(fwd.stats.first_kind == NonfiniteKind::kPosInf);
  CHECK(fwd.sample == 11);
  CHECK(fwd.position == 0);
  const ProbeRecord bwd = find(records, "embed", Phase::kBackward);
  CHECK(bwd.stats.max_abs == Approx(static_cast<float>(c10::Half(1.0f / 3.0f))).epsilon(0));
  CHECK(x.grad()[0][0][0].item<float>() == static_cast<float>(c10::Half(1.0f / 3.0f)));
}

TEST_CASE("the loss site is never rounded", "[torch][numerics]") {
  const Numerics bf16(Compute::kBf16);
  ProbeSession probes({0, 0, 0, {0}}, bf16, true, one_layer());
  const torch::Tensor loss = torch::tensor(1.0f / 3.0f);
  CHECK(probes.site({SiteId::kLoss, -1}, loss).item<float>() == 1.0f / 3.0f);
}

TEST_CASE("causal positions only: the mask's -inf never counts, a NaN above it neither", "[torch][probes]") {
  torch::Tensor scores = torch::zeros({1, 2, 3, 3});
  const torch::Tensor future = torch::ones({3, 3}, torch::kBool).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
  scores[0][1][0][2] = std::nanf("");  // above the diagonal: masked, never reaches the loss
  const auto records = describe_tensor(scores, &site_def(SiteId::kAttnScores), {5});
  REQUIRE(records.size() == 3);  // whole tensor + 2 heads
  CHECK(records[0].stats.all_finite());
  CHECK(records[0].stats.count == 12);  // 6 causal elements per head

  scores[0][1][2][1] = std::numeric_limits<float>::infinity();
  const auto bad = describe_tensor(scores, &site_def(SiteId::kAttnScores), {5});
  CHECK(bad[0].stats.inf_count == 1);
  CHECK(bad[0].first_head == 1);
  CHECK(bad[0].position == 2);
  CHECK(bad[0].sample == 5);
  CHECK(bad[0].first_index == std::vector<int64_t>{0, 1, 2, 1});
  CHECK(bad[1].stats.all_finite());  // head 0
  CHECK(bad[2].stats.inf_count == 1);  // head 1
}

TEST_CASE("backward records come in the strict reverse of the forward order", "[torch][probes]") {
  const Numerics fp32(Compute::kFp32);
  ProbeSession probes({0, 0, 0, {0}}, fp32, true, one_layer());
  torch::Tensor w = torch::ones({1, 1, 2}).requires_grad_(true);
  const torch::Tensor e = probes.site({SiteId::kEmbed, -1}, w * 2);
  probes.alias({SiteId::kInput, 0}, {SiteId::kEmbed, -1});
  const torch::Tensor n = probes.site({SiteId::kAttnNorm, 0}, e * 3);
  const torch::Tensor loss = probes.site({SiteId::kLoss, -1}, (n + e).sum());
  loss.backward();
  std::vector<std::string> order;
  for (const auto& r : probes.take_records()) {
    order.push_back(std::string(phase_name(r.phase)) + ":" + probe_name(r));
  }
  CHECK(order == std::vector<std::string>{"forward:embed", "forward:layers.0.input", "forward:layers.0.attn_norm",
                                          "forward:loss", "backward:loss", "backward:layers.0.attn_norm",
                                          "backward:layers.0.input", "backward:embed"});
}

TEST_CASE("probes off computes identical numbers", "[torch][probes]") {
  const Numerics bf16(Compute::kBf16);
  const torch::Tensor x = torch::randn({2, 3, 4});
  ProbeSession on({0, 0, 0, {0, 1}}, bf16, true, one_layer());
  ProbeSession off({0, 0, 0, {0, 1}}, bf16, false, one_layer());
  CHECK(torch::equal(on.site({SiteId::kEmbed, -1}, x), off.site({SiteId::kEmbed, -1}, x)));
  CHECK(off.take_records().empty());
}

TEST_CASE("a forward that produces a site out of the site table's order is refused", "[torch][probes]") {
  const Numerics fp32(Compute::kFp32);
  const ModelConfig m = one_layer();
  const torch::Tensor x = torch::ones({1, 2, 8});
  {
    ProbeSession probes({1, 0, 0, {0}}, fp32, true, m);
    probes.site({SiteId::kEmbed, -1}, x);
    probes.alias({SiteId::kInput, 0}, {SiteId::kEmbed, -1});
    probes.site({SiteId::kAttnNorm, 0}, x);
    CHECK_THROWS_AS(probes.site({SiteId::kEmbed, -1}, x), std::logic_error);  // again, behind attn_norm
  }
  {
    ProbeSession probes({1, 0, 0, {0}}, fp32, false, m);  // even with probes off: the order is the forward's
    probes.site({SiteId::kAttnQ, 0}, x);
    CHECK_THROWS_AS(probes.site({SiteId::kAttnNorm, 0}, x), std::logic_error);
  }
}
