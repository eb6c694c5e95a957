// Tests for loaders/bundle/step_state.cpp: the spec's example state.json, the
// non-finite spellings a broken run logs, and one bad input per key, each
// asserting that the InputError names the file and the key path.
#include <catch2/catch.hpp>

#include "tests/loader_test_support.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loaders/base/error.h"
#include "loaders/bundle/step_state.h"

namespace {

using nanreplay::InputError;
using nlohmann::json;

using nanreplay_test::MessageMentions;
using nanreplay_test::TempDir;
const char* const kStateLabel = "steps/105/state.json";
constexpr double kInfinity = std::numeric_limits<double>::infinity();

nanreplay::StepState state_of(const json& state) {
  return nanreplay::parse_step_state(state.dump(), kStateLabel);
}

json state_with(json state, const std::string& pointer, json value) {
  state[json::json_pointer(pointer)] = std::move(value);
  return state;
}

}  // namespace

TEST_CASE("step_state: the spec's example parses", "[loaders][state]") {
  const nanreplay::StepState s = nanreplay::parse_step_state(R"({
    "step": 105,
    "lr": 0.0003,
    "loss_scale": 65536.0,
    "fp8_scales": { "model.layers.0.self_attn.q_proj": {"input": 1.0, "weight": 1.0} },
    "logged": { "loss": 3.21, "grad_norm": 0.97,
                "rank_grad_norms": [0.97], "rank_losses": [3.21] }
  })", kStateLabel);
  CHECK(s.step == 105);
  CHECK(s.lr == 0.0003);
  CHECK(s.loss_scale == 65536.0);
  REQUIRE(s.fp8_scales.size() == 1);
  const nanreplay::Fp8ModuleScales& q = s.fp8_scales.at("model.layers.0.self_attn.q_proj");
  CHECK(q.input == 1.0);
  CHECK(q.weight == 1.0);
  CHECK_FALSE(q.grad_output.has_value());
  CHECK(s.logged.loss == 3.21);
  CHECK(s.logged.grad_norm == 0.97);
  CHECK(s.logged.rank_grad_norms == std::vector<double>{0.97});
  CHECK(s.logged.rank_losses == std::vector<double>{3.21});
  CHECK_FALSE(s.skipped.has_value());
}

TEST_CASE("step_state: only step is required", "[loaders][state]") {
  const nanreplay::StepState s = state_of({{"step", 0}});
  CHECK(s.step == 0);
  CHECK_FALSE(s.lr.has_value());
  CHECK(s.loss_scale == 1.0);
  CHECK(s.fp8_scales.empty());
  CHECK_FALSE(s.logged.loss.has_value());
  CHECK_FALSE(s.logged.grad_norm.has_value());
  CHECK(s.logged.rank_losses.empty());
  CHECK(s.logged.rank_grad_norms.empty());
  CHECK_FALSE(s.skipped.has_value());
  CHECK(state_of({{"step", 1}, {"skipped", true}, {"future_key", {1, 2}}}).skipped == true);
}

TEST_CASE("step_state: non-finite values are data, in every spelling", "[loaders][state]") {
  // What the job logged and its fp8 scales; lr and loss_scale must be sane (below).
  const nanreplay::StepState s = state_of(R"({
    "step": 7, "lr": 0.001, "loss_scale": 1024,
    "fp8_scales": { "m": {"input": "-inf", "weight": "NaN", "grad_output": "Infinity"} },
    "logged": { "loss": "nan", "grad_norm": "inf",
                "rank_losses": [1.5, "-Infinity", "NAN"], "rank_grad_norms": ["+inf", 2] }
  })"_json);
  CHECK(s.lr == 0.001);
  CHECK(s.loss_scale == 1024);
  CHECK(s.fp8_scales.at("m").input == -kInfinity);
  CHECK(std::isnan(*s.fp8_scales.at("m").weight));
  CHECK(s.fp8_scales.at("m").grad_output == kInfinity);
  CHECK(std::isnan(*s.logged.loss));
  CHECK(s.logged.grad_norm == kInfinity);
  REQUIRE(s.logged.rank_losses.size() == 3);
  CHECK(s.logged.rank_losses[0] == 1.5);
  CHECK(s.logged.rank_losses[1] == -kInfinity);
  CHECK(std::isnan(s.logged.rank_losses[2]));
  CHECK(s.logged.rank_grad_norms == std::vector<double>{kInfinity, 2.0});
}

TEST_CASE("step_state: lr and loss_scale must be numbers a run could have used", "[loaders][state]") {
  CHECK(state_of({{"step", 1}, {"lr", 1e-9}}).lr == 1e-9);
  CHECK(state_of({{"step", 1}, {"lr", 1e3}}).lr == 1e3);
  CHECK(state_of({{"step", 1}, {"loss_scale", 1e-4}}).loss_scale == 1e-4);
  const json base = {{"step", 3}};
  for (const json& lr : {json("nan"), json("inf"), json(0), json(1.0001e3), json(1e30)}) {
    CAPTURE(lr.dump());
    REQUIRE_INPUT_ERROR(state_of(state_with(base, "/lr", lr)), kStateLabel, std::string(kStateLabel) + ": lr: expected a learning rate");
  }
  for (const json& scale : {json("nan"), json("inf"), json("-inf"), json(0), json(-65536)}) {
    CAPTURE(scale.dump());
    REQUIRE_INPUT_ERROR(state_of(state_with(base, "/loss_scale", scale)), kStateLabel,
                        std::string(kStateLabel) + ": loss_scale: expected a positive finite loss scale");
  }
}

TEST_CASE("step_state: bad values name the key", "[loaders][state]") {
  const json base = {{"step", 3}};
  struct BadCase {
    json state;
    const char* key;
  };
  const std::vector<BadCase> cases = {
      {json::object(), "step"},
      {{{"step", -1}}, "step"},
      {{{"step", 1.5}}, "step"},
      {{{"step", "3"}}, "step"},
      {{{"step", nullptr}}, "step"},
      {state_with(base, "/lr", -0.1), "lr"},
      {state_with(base, "/lr", "-inf"), "lr"},
      {state_with(base, "/lr", "fast"), "lr"},
      {state_with(base, "/loss_scale", "big"), "loss_scale"},
      {state_with(base, "/loss_scale", true), "loss_scale"},
      {state_with(base, "/fp8_scales", {1, 2}), "fp8_scales"},
      {state_with(base, "/fp8_scales", {{"model.layers.0.mlp.up_proj", 1.0}}),
       "fp8_scales[\"model.layers.0.mlp.up_proj\"]"},
      {state_with(base, "/fp8_scales", {{"q", {{"input", "x"}}}}), "fp8_scales[\"q\"].input"},
      {state_with(base, "/fp8_scales", {{"q", {{"weight", {1}}}}}), "fp8_scales[\"q\"].weight"},
      {state_with(base, "/fp8_scales", {{"q", {{"grad_output", false}}}}), "fp8_scales[\"q\"].grad_output"},
      {state_with(base, "/fp8_scales", {{"", {{"input", 1}}}}), "fp8_scales[\"\"]"},
      {state_with(base, "/logged", "loss=nan"), "logged"},
      {state_with(base, "/logged", {{"loss", "nope"}}), "logged.loss"},
      {state_with(base, "/logged", {{"grad_norm", {1.0}}}), "logged.grad_norm"},
      {state_with(base, "/logged", {{"rank_losses", 1.0}}), "logged.rank_losses"},
      {state_with(base, "/logged", {{"rank_losses", {1.0, true}}}), "logged.rank_losses[1]"},
      {state_with(base, "/logged", {{"rank_grad_norms", {"x"}}}), "logged.rank_grad_norms[0]"},
      {state_with(base, "/skipped", "yes"), "skipped"},
      {state_with(base, "/skipped", 1), "skipped"},
  };
  for (const BadCase& bad : cases) {
    CAPTURE(bad.state.dump());
    REQUIRE_INPUT_ERROR(state_of(bad.state), kStateLabel, std::string(kStateLabel) + ": " + bad.key);
  }
}

TEST_CASE("step_state: text that is not a JSON object names the file", "[loaders][state]") {
  REQUIRE_INPUT_ERROR(nanreplay::parse_step_state("{\"step\": 1,}", kStateLabel), kStateLabel, "byte",
                      "invalid JSON");
  REQUIRE_INPUT_ERROR(nanreplay::parse_step_state("{\"step\": NaN}", kStateLabel), kStateLabel,
                      "invalid JSON");
  REQUIRE_INPUT_ERROR(nanreplay::parse_step_state("3", kStateLabel), kStateLabel, "expected a JSON object");
  REQUIRE_INPUT_ERROR(nanreplay::parse_step_state(std::string(100, '{'), kStateLabel), kStateLabel,
                      "nested");
  REQUIRE_INPUT_ERROR(nanreplay::parse_step_state("{\"step\": 1, \"x\": \"\x80\"}", kStateLabel),
                      kStateLabel, "UTF-8");
}
