// The machinery under bisection and what-ifs, on real tensors: flags set
// exactly where full statistics see a non-finite value (causal mask
// included), full probes restricted to one block (with the stream feeding
// it, so the block's `input` keeps its backward record), and the numerics
// overrides: an fp32 layer and fp32 attention scores stop rounding, nothing
// else changes.
#include <catch2/catch.hpp>

#include <torch/torch.h>

#include "replay/probing/numerics.h"
#include "replay/probing/probe_session.h"

using namespace nanreplay;

namespace {

ModelConfig two_layers() {
  ModelConfig m;
  m.arch = Arch::kLlama;
  m.vocab_size = 16;
  m.hidden_size = 8;
  m.num_layers = 2;
  m.num_heads = 2;
  m.num_kv_heads = 2;
  m.intermediate_size = 8;
  m.max_seq_len = 8;
  return m;
}

std::vector<std::string> names(const std::vector<ProbeRecord>& records) {
  std::vector<std::string> out;
  for (const ProbeRecord& r : records) {
    if (r.head == -1) out.push_back(std::string(phase_name(r.phase)) + ":" + probe_name(r));
  }
  return out;
}

// embed -> layers.0 (input, attn_norm, output) -> layers.1 (input, attn_norm) -> loss
std::vector<ProbeRecord> chain(const ProbeScope& scope, const torch::Tensor& poison) {
  const Numerics fp32(Compute::kFp32);
  ProbeSession probes({3, 1, 0, {9}}, fp32, scope, two_layers());
  const torch::Tensor w = torch::ones({1, 2, 4}).requires_grad_(true);
  const torch::Tensor e = probes.site({SiteId::kEmbed, -1}, w * 2);
  probes.alias({SiteId::kInput, 0}, {SiteId::kEmbed, -1});
  const torch::Tensor n0 = probes.site({SiteId::kAttnNorm, 0}, e * 3);
  const torch::Tensor o0 = probes.site({SiteId::kOutput, 0}, e + n0);
  probes.alias({SiteId::kInput, 1}, {SiteId::kOutput, 0});
  const torch::Tensor n1 = probes.site({SiteId::kAttnNorm, 1}, o0 * poison);
  probes.site({SiteId::kLoss, -1}, (n1 + o0).sum()).backward();
  return probes.take_records();
}

}  // namespace

TEST_CASE("flags record exactly the sites full statistics find non-finite", "[torch][bisect]") {
  const torch::Tensor inf = torch::tensor(std::numeric_limits<float>::infinity());
  const auto full = chain({ProbeLevel::kFull, {}}, inf);
  const auto flags = chain({ProbeLevel::kFlags, {}}, inf);
  std::vector<ProbeRecord> bad_full;
  for (const ProbeRecord& r : full) {
    if (r.head == -1 && !r.stats.all_finite()) bad_full.push_back(r);
  }
  CHECK(names(flags) == names(bad_full));
  REQUIRE_FALSE(flags.empty());
  CHECK(probe_name(flags.front()) == "layers.1.attn_norm");
  CHECK(flags.front().stats.inf_count == 8);
  CHECK(flags.front().micro_batch == 1);
  CHECK(flags.front().step == 3);
  CHECK(chain({ProbeLevel::kFlags, {}}, torch::tensor(1.0f)).empty());
}

TEST_CASE("flags ignore what the causal mask removes, as the statistics do", "[torch][bisect]") {
  const Numerics fp32(Compute::kFp32);
  ProbeSession probes({0, 0, 0, {0}}, fp32, ProbeScope{ProbeLevel::kFlags, {}}, two_layers());
  torch::Tensor scores = torch::zeros({1, 2, 3, 3});
  scores[0][1][0][2] = std::nanf("");  // above the diagonal
  probes.site({SiteId::kAttnScores, 0}, scores);
  CHECK(probes.take_records().empty());
  scores[0][1][2][0] = std::nanf("");  // causal
  probes.site({SiteId::kAttnScores, 0}, scores);
  const auto records = probes.take_records();
  REQUIRE(records.size() == 1);
  CHECK(records[0].stats.nan_count == 1);
  CHECK(records[0].stats.count == 12);
}

TEST_CASE("full probes on one block keep the stream feeding it for the block's input", "[torch][bisect]") {
  const torch::Tensor one = torch::tensor(1.0f);
  CHECK(names(chain({ProbeLevel::kFull, 1}, one)) ==
        std::vector<std::string>{"forward:layers.0.output", "forward:layers.1.input", "forward:layers.1.attn_norm",
                                 "backward:layers.1.attn_norm", "backward:layers.1.input", "backward:layers.0.output"});
  CHECK(names(chain({ProbeLevel::kFull, -1}, one)) ==
        std::vector<std::string>{"forward:embed", "forward:loss", "backward:loss", "backward:embed"});
  CHECK(names(chain({ProbeLevel::kFull, 0}, one)) ==
        std::vector<std::string>{"forward:embed", "forward:layers.0.input", "forward:layers.0.attn_norm",
                                 "forward:layers.0.output", "backward:layers.0.output",
                                 "backward:layers.0.attn_norm", "backward:layers.0.input", "backward:embed"});
}

TEST_CASE("an fp32 layer stops rounding its sites and linears, other layers still round", "[torch][what-if]") {
  Numerics fp16(Compute::kFp16);
  fp16.set_overrides({{1}, false});
  CHECK(fp16.rounds_site({SiteId::kMlpUp, 0}));
  CHECK_FALSE(fp16.rounds_site({SiteId::kMlpUp, 1}));
  CHECK(fp16.rounds_site({SiteId::kLogits, -1}));
  CHECK_FALSE(fp16.rounds_site({SiteId::kLoss, -1}));
  const torch::Tensor x = torch::full({1, 2}, 300.0f);
  const torch::Tensor w = torch::full({1, 2}, 200.0f);  // 300 * 200 * 2 = 120000 > 65504
  CHECK(std::isinf(fp16.in_layer(0).round(fp16.in_layer(0).linear(x, w, {}, "m"))[0][0].item<float>()));
  CHECK(fp16.in_layer(1).linear(x, w, {}, "m")[0][0].item<float>() == 120000.0f);
  CHECK_FALSE(fp16.in_layer(1).reduced());
}

TEST_CASE("stable softmax keeps q k^T in fp32 where fp16 overflows", "[torch][what-if]") {
  const torch::Tensor q = torch::full({1, 1, 2, 4}, 200.0f);  // q.k = 160000, / sqrt(4) = 80000
  Numerics plain(Compute::kFp16);
  Numerics stable(Compute::kFp16);
  stable.set_overrides({{}, true});
  CHECK(std::isinf(plain.attention_scores(q, q)[0][0][0][0].item<float>()));
  CHECK(stable.attention_scores(q, q)[0][0][0][0].item<float>() == 80000.0f);
  CHECK(plain.rounds_site({SiteId::kAttnScores, 0}));
  CHECK_FALSE(stable.rounds_site({SiteId::kAttnScores, 0}));
  CHECK(stable.rounds_site({SiteId::kAttnProbs, 0}));  // probs are rounded before probs @ v, as in flash attention
  // Without overrides the numerics are the bundle's: same tensor, bit for bit.
  const torch::Tensor k = torch::randn({1, 1, 3, 4});
  Numerics untouched(Compute::kFp16);
  untouched.set_overrides({});
  CHECK(torch::equal(untouched.attention_scores(k, k), plain.attention_scores(k, k)));
}
