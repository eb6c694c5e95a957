// The "optimizer" section beyond AdamW (docs/optimizers.md): each kind's
// hyper-parameters under its class's names and defaults, parameter groups
// (first matching glob wins, the top level for the rest, a group of the top
// level's kind inheriting its settings), state.json's per-group lr, the
// round trip through the manifest writer, and one refusal per rule naming the
// file and key.
#include <catch2/catch.hpp>

#include "tests/loader_test_support.h"

#include <string>

#include <nlohmann/json.hpp>

#include "loaders/bundle/manifest.h"
#include "loaders/bundle/manifest_writer.h"
#include "loaders/bundle/optimizer_manifest.h"
#include "loaders/bundle/step_state.h"

namespace {

using nanreplay::OptimizerConfig;
using nanreplay_test::kManifestLabel;
using nanreplay::OptimizerKind;
using nlohmann::json;

const char* const kState = "bundle/steps/3/state.json";

OptimizerConfig parse_optimizer(const json& optimizer) {
  json manifest = R"({
    "format": "nanreplay.bundle", "version": 1,
    "model": { "arch": "llama", "vocab_size": 32, "hidden_size": 16, "num_layers": 1,
               "num_heads": 2, "intermediate_size": 40, "max_seq_len": 8 },
    "data": { "shards": [ { "path": "data/a.bin", "dtype": "uint32", "tokens": 100 } ],
              "seq_len": 8, "micro_batch_size": 2,
              "sampler": { "kind": "randperm", "seed": 0 } },
    "steps": [ { "step": 0, "dir": "steps/0" } ]
  })"_json;
  manifest["optimizer"] = optimizer;
  return *nanreplay::parse_manifest(manifest.dump(), kManifestLabel).optimizer;
}

}  // namespace

TEST_CASE("optimizer kinds take their class's defaults", "[loaders][manifest][optim]") {
  const OptimizerConfig adamw = parse_optimizer(json::object());
  CHECK(adamw.kind == OptimizerKind::kAdamW);
  CHECK(adamw.weight_decay == 0.01);
  CHECK_FALSE(adamw.amsgrad);

  const OptimizerConfig adam = parse_optimizer({{"kind", "adam"}});
  CHECK(adam.kind == OptimizerKind::kAdam);
  CHECK(adam.weight_decay == 0.0);  // torch.optim.Adam's default, not AdamW's
  CHECK(adam.beta2 == 0.999);

  const OptimizerConfig adafactor = parse_optimizer({{"kind", "adafactor"}});
  CHECK(adafactor.beta2_decay == -0.8);
  CHECK(adafactor.d == 1.0);
  CHECK_FALSE(adafactor.eps1.has_value());  // None: fp32's machine epsilon
  CHECK(adafactor.eps2 == 1e-3);
  CHECK(adafactor.weight_decay == 0.0);

  const OptimizerConfig hf = parse_optimizer({{"kind", "adafactor_hf"}});
  CHECK(hf.relative_step);
  CHECK(hf.scale_parameter);
  CHECK_FALSE(hf.warmup_init);
  CHECK_FALSE(hf.hf_beta1.has_value());
  CHECK(hf.clip_threshold == 1.0);
  CHECK(hf.decay_rate == -0.8);

  const OptimizerConfig muon = parse_optimizer({{"kind", "muon"}});
  CHECK(muon.weight_decay == 0.1);
  CHECK(muon.momentum == 0.95);
  CHECK(muon.nesterov);
  CHECK(muon.eps == 1e-7);
  CHECK(muon.ns_steps == 5);
  CHECK(muon.ns_a == 3.4445);
  CHECK(muon.ns_b == -4.7750);
  CHECK(muon.ns_c == 2.0315);
  CHECK(muon.adjust_lr_fn == "original");
  CHECK_FALSE(muon.qk_clip_tau.has_value());
}

TEST_CASE("optimizer hyper-parameters are read under their own names", "[loaders][manifest][optim]") {
  const OptimizerConfig hf = parse_optimizer(
      {{"kind", "adafactor_hf"}, {"eps", {1e-29, 2e-3}}, {"beta1", 0.8}, {"relative_step", false},
       {"scale_parameter", false}, {"clip_threshold", 2.0}, {"decay_rate", -0.5}, {"weight_decay", 0.01}});
  CHECK(*hf.eps1 == 1e-29);
  CHECK(hf.eps2 == 2e-3);
  CHECK(*hf.hf_beta1 == 0.8);
  CHECK_FALSE(hf.relative_step);
  CHECK(hf.clip_threshold == 2.0);
  CHECK(hf.decay_rate == -0.5);
  const OptimizerConfig torch_adafactor =
      parse_optimizer({{"kind", "adafactor"}, {"eps", {nullptr, 1e-4}}, {"d", 2.0}, {"beta2_decay", -0.5}});
  CHECK_FALSE(torch_adafactor.eps1.has_value());
  CHECK(torch_adafactor.eps2 == 1e-4);
  CHECK(torch_adafactor.d == 2.0);
  const OptimizerConfig muon = parse_optimizer({{"kind", "muon"}, {"nesterov", false}, {"ns_steps", 3},
                                                {"ns_coefficients", {3.0, -4.0, 2.0}},
                                                {"adjust_lr_fn", "match_rms_adamw"}, {"qk_clip", {{"tau", 100.0}}}});
  CHECK_FALSE(muon.nesterov);
  CHECK(muon.ns_steps == 3);
  CHECK(muon.ns_b == -4.0);
  CHECK(muon.adjust_lr_fn == "match_rms_adamw");
  CHECK(*muon.qk_clip_tau == 100.0);
  CHECK(parse_optimizer({{"kind", "adamw"}, {"amsgrad", true}}).amsgrad);
}

TEST_CASE("optimizer groups: the first matching glob wins, the rest use the top level", "[loaders][manifest][optim]") {
  const OptimizerConfig config = parse_optimizer(
      {{"kind", "adamw"}, {"betas", {0.9, 0.95}}, {"weight_decay", 0.1}, {"grad_clip", 1.0},
       {"groups", {{{"name", "muon"}, {"params", {"model.layers.*_proj.weight"}}, {"kind", "muon"}},
                   {{"name", "late"}, {"params", {"model.layers.*"}}, {"weight_decay", 0.0}}}}});
  REQUIRE(config.groups.size() == 2);
  const auto q = nanreplay::rule_of_param(config, "model.layers.0.self_attn.q_proj.weight");
  CHECK(q.group == "muon");
  CHECK(q.rule->kind == OptimizerKind::kMuon);
  CHECK(q.rule->weight_decay == 0.1);  // Muon's own default, not the top level's
  const auto norm = nanreplay::rule_of_param(config, "model.layers.0.input_layernorm.weight");
  CHECK(norm.group == "late");
  CHECK(norm.rule->kind == OptimizerKind::kAdamW);
  CHECK(norm.rule->beta2 == 0.95);  // same kind as the top level: its settings carry over
  CHECK(norm.rule->weight_decay == 0.0);
  const auto embed = nanreplay::rule_of_param(config, "model.embed_tokens.weight");
  CHECK(embed.group == "default");
  CHECK(embed.rule->weight_decay == 0.1);

  // The writer gives back what the reader took.
  const OptimizerConfig again = parse_optimizer(nanreplay::optimizer_config_json(config));
  CHECK(again.groups.size() == 2);
  CHECK(again.groups[0].rule.kind == OptimizerKind::kMuon);
  CHECK(again.groups[1].rule.weight_decay == 0.0);
  CHECK(again.groups[1].rule.beta2 == 0.95);
  CHECK(*again.grad_clip == 1.0);
}

TEST_CASE("state.json lr: a number for every group or one per group name", "[loaders][state][optim]") {
  const nanreplay::StepState number = nanreplay::parse_step_state(R"({"step": 3, "lr": 0.001})", kState);
  CHECK(*number.lr_of("muon") == 0.001);
  CHECK(*number.lr_of("default") == 0.001);
  const nanreplay::StepState groups =
      nanreplay::parse_step_state(R"({"step": 3, "lr": {"default": 0.001, "muon": 0.02}})", kState);
  CHECK(*groups.lr == 0.001);
  CHECK(*groups.lr_of("muon") == 0.02);
  CHECK(*groups.lr_of("default") == 0.001);
  CHECK_FALSE(groups.lr_of("other").has_value());
  REQUIRE_INPUT_ERROR(nanreplay::parse_step_state(R"({"step": 3, "lr": {"muon": -1}})", kState), kState, "lr.muon");
  REQUIRE_INPUT_ERROR(nanreplay::parse_step_state(R"({"step": 3, "lr": {"muon": "fast"}})", kState), kState,
                      "lr.muon");
  REQUIRE_INPUT_ERROR(nanreplay::parse_step_state(R"({"step": 3, "lr": {}})", kState), kState, "lr");
}

TEST_CASE("bad optimizer sections are refused with the file and key", "[loaders][manifest][optim][bad]") {
  REQUIRE_INPUT_ERROR(parse_optimizer({{"kind", "lion"}}), kManifestLabel, "optimizer.kind", "lion");
  REQUIRE_INPUT_ERROR(parse_optimizer({{"kind", "muon"}, {"betas", {0.9, 0.95}}}), kManifestLabel, "optimizer.betas",
                      "torch.optim.Muon");
  REQUIRE_INPUT_ERROR(parse_optimizer({{"kind", "adamw"}, {"momentum", 0.9}}), kManifestLabel, "optimizer.momentum");
  REQUIRE_INPUT_ERROR(parse_optimizer({{"kind", "adafactor"}, {"d", 0.5}}), kManifestLabel, "optimizer.d");
  REQUIRE_INPUT_ERROR(parse_optimizer({{"kind", "adafactor"}, {"beta2_decay", 0.5}}), kManifestLabel,
                      "optimizer.beta2_decay");
  REQUIRE_INPUT_ERROR(parse_optimizer({{"kind", "adafactor"}, {"eps", {1e-30}}}), kManifestLabel, "optimizer.eps");
  REQUIRE_INPUT_ERROR(parse_optimizer({{"kind", "adafactor_hf"}, {"warmup_init", true}, {"relative_step", false}}),
                      kManifestLabel, "optimizer.warmup_init");
  REQUIRE_INPUT_ERROR(parse_optimizer({{"kind", "adafactor_hf"}, {"beta1", 1.5}}), kManifestLabel, "optimizer.beta1");
  REQUIRE_INPUT_ERROR(parse_optimizer({{"kind", "muon"}, {"ns_steps", 100}}), kManifestLabel, "optimizer.ns_steps");
  REQUIRE_INPUT_ERROR(parse_optimizer({{"kind", "muon"}, {"adjust_lr_fn", "spectral"}}), kManifestLabel,
                      "optimizer.adjust_lr_fn");
  REQUIRE_INPUT_ERROR(parse_optimizer({{"kind", "muon"}, {"ns_coefficients", {1.0, 2.0}}}), kManifestLabel,
                      "optimizer.ns_coefficients");
  REQUIRE_INPUT_ERROR(parse_optimizer({{"kind", "muon"}, {"qk_clip", {{"tau", 0}}}}), kManifestLabel,
                      "optimizer.qk_clip.tau");
  REQUIRE_INPUT_ERROR(parse_optimizer({{"kind", "adamw"}, {"qk_clip", {{"tau", 10}}}}), kManifestLabel,
                      "optimizer.qk_clip");
  REQUIRE_INPUT_ERROR(parse_optimizer({{"groups", {{{"params", {"*"}}}}}}), kManifestLabel, "optimizer.groups[0].name");
  REQUIRE_INPUT_ERROR(parse_optimizer({{"groups", {{{"name", "default"}, {"params", {"*"}}}}}}), kManifestLabel,
                      "optimizer.groups[0].name");
  REQUIRE_INPUT_ERROR(parse_optimizer({{"groups", {{{"name", "a"}, {"params", {"*"}}},
                                                   {{"name", "a"}, {"params", {"x"}}}}}}),
                      kManifestLabel, "optimizer.groups[1].name");
  REQUIRE_INPUT_ERROR(parse_optimizer({{"groups", {{{"name", "a"}, {"params", {1}}}}}}), kManifestLabel,
                      "optimizer.groups[0].params[0]");
  REQUIRE_INPUT_ERROR(parse_optimizer({{"groups", {{{"name", "a"}, {"params", {"*"}}, {"kind", "sgd"}}}}}),
                      kManifestLabel, "optimizer.groups[0].kind");
  REQUIRE_INPUT_ERROR(
      parse_optimizer({{"groups", {{{"name", "m"}, {"params", {"*"}}, {"kind", "muon"}, {"amsgrad", true}}}}}),
      kManifestLabel, "optimizer.groups[0].amsgrad");
}
