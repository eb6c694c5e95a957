// DeepSeek-V3's correction bias moved by model.moe.score_bias_update
// (replay/step/score_bias_update.h), against hand-computed values of
// torchtitan's _update_expert_bias ("sign_centred") and the DeepSeek-V3
// paper's rule ("sign"); rate 0.5 keeps every value exact in fp32; and a step
// the fp16 loss scaler skips (no optimizer step, so no update).
#include <catch2/catch.hpp>

#include "replay/step/score_bias_update.h"

using nanreplay::MoeConfig;
using nanreplay::updated_score_bias;
using Rule = MoeConfig::ScoreBiasUpdate::Rule;

namespace {

const std::map<int, std::vector<double>> kBias = {{1, {0.125, 0.0, -0.25, 1.0}}};
// Layer 0 is dense: its (zero) counts are not read. Layer 1: mean 1.5, expert 0 overloaded.
const std::vector<std::vector<int64_t>> kTokens = {{0, 0, 0, 0}, {3, 1, 1, 1}};

}  // namespace

TEST_CASE("sign_centred moves each bias by rate * sign(mean - tokens) less its mean, as torchtitan does",
          "[score_bias_update]") {
  const auto next = updated_score_bias({Rule::kSignCentred, 0.5}, kBias, kTokens);
  // delta = 0.5 * {-1, 1, 1, 1} = {-0.5, 0.5, 0.5, 0.5}, mean 0.25: {-0.75, 0.25, 0.25, 0.25}
  CHECK(next == std::map<int, std::vector<double>>{{1, {-0.625, 0.25, 0.0, 1.25}}});
}

TEST_CASE("sign is the DeepSeek-V3 paper's rule: nothing subtracted", "[score_bias_update]") {
  const auto next = updated_score_bias({Rule::kSign, 0.5}, kBias, kTokens);
  CHECK(next == std::map<int, std::vector<double>>{{1, {-0.375, 0.5, 0.25, 1.5}}});
}

TEST_CASE("an expert at exactly the mean load keeps its bias; a balanced layer changes nothing",
          "[score_bias_update]") {
  const std::vector<std::vector<int64_t>> balanced = {{}, {2, 2, 2, 2}};
  CHECK(updated_score_bias({Rule::kSignCentred, 0.5}, kBias, balanced) == kBias);
  const std::vector<std::vector<int64_t>> one_at_mean = {{}, {3, 2, 1, 2}};  // mean 2
  CHECK(updated_score_bias({Rule::kSign, 0.5}, kBias, one_at_mean) ==
        std::map<int, std::vector<double>>{{1, {-0.375, 0.0, 0.25, 1.0}}});
}

TEST_CASE("counts missing for a layer with a bias are a logic error", "[score_bias_update]") {
  CHECK_THROWS_AS(updated_score_bias({Rule::kSign, 0.5}, kBias, {{1, 1, 1, 1}}), std::logic_error);
}

TEST_CASE("a step the scaler skips keeps its bias and its tokens count in the next update", "[score_bias_update]") {
  nanreplay::ScoreBiasSteps steps({Rule::kSignCentred, 0.5});
  // Skipped: no optimizer step, so no pre-hook: the bias stays.
  CHECK(steps.after_step(kBias, kTokens, /*optimizer_stepped=*/false) == kBias);
  // The next update reads {3, 1, 1, 1} + {0, 2, 2, 2} = {3, 3, 3, 3}: balanced, nothing moves.
  const std::vector<std::vector<int64_t>> next_tokens = {{0, 0, 0, 0}, {0, 2, 2, 2}};
  CHECK(steps.after_step(kBias, next_tokens, true) == kBias);
  // Without the carried counts the same step would have moved the bias: the check can fail.
  nanreplay::ScoreBiasSteps fresh({Rule::kSignCentred, 0.5});
  CHECK(fresh.after_step(kBias, next_tokens, true) != kBias);
  // After an update the counts start again from zero.
  CHECK(steps.after_step(kBias, kTokens, true) == updated_score_bias({Rule::kSignCentred, 0.5}, kBias, kTokens));
}
