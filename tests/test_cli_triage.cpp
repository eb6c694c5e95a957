// Triage end to end: one synthetic bundle per finding code, each replayed
// through the CLI, checking the code, its layer and severity, its evidence,
// the exit status and the root cause the report settles on.
#include <catch2/catch.hpp>

#include <fstream>
#include <set>

#include "loaders/bundle/bundle.h"
#include "tests/triage_harness.h"

using nanreplay_test::read_json;
using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;

using nanreplay_test::Triaged;
using nanreplay_test::triage;
using nanreplay_test::with_code;

TEST_CASE("DATA_TOKEN_OUT_OF_RANGE names shard and offset, and the step is not replayed", "[cli][triage]") {
  ScratchDir dir("oor");
  const Triaged t = triage(dir, "token-out-of-range");
  const auto found = with_code(t.report, "DATA_TOKEN_OUT_OF_RANGE");
  REQUIRE(found.size() == 1);
  CHECK(found[0]["layer"] == "data");
  CHECK(found[0]["severity"] == "error");
  CHECK(found[0]["evidence"]["sample"] == t.planted["first_sample"]);
  CHECK(found[0]["evidence"]["position"] == 3);
  const int64_t global = t.planted["first_sample"].get<int64_t>() * 32 + 3;
  CHECK(found[0]["evidence"]["shard"] == "data/shard_000.bin");
  CHECK(found[0]["evidence"]["offset"] == global);  // shard 0 holds the first 4096 tokens
  CHECK(t.report["steps"].back()["replayed"] == false);
  CHECK(t.status == 1);
  CHECK(t.report["root_cause"]["code"] == "DATA_TOKEN_OUT_OF_RANGE");
}

TEST_CASE("DATA_TOKEN_OUT_OF_RANGE is reported where no replayed step reads it, and every step still replays",
          "[cli][triage]") {
  ScratchDir dir("oor-stray");
  REQUIRE(run_cli({"synth", "clean-fp32", (dir / "bundle").string()}).status == 0);
  // A sample no step's batch holds, and its second token (in no other sample).
  int64_t sample = 1, global = 0, vocab = 0;
  nanreplay::ShardLocation where;
  std::filesystem::path shard_file;
  std::string shard_name;
  bool wide = false;
  {
    const nanreplay::Bundle bundle(dir / "bundle");
    std::set<int64_t> read;
    for (const nanreplay::StepEntry& entry : bundle.manifest().steps) {
      for (const auto& rank : bundle.sampler().samples_for(entry)) read.insert(rank.begin(), rank.end());
    }
    while (read.count(sample)) ++sample;
    REQUIRE(sample < bundle.num_samples());
    global = sample * bundle.manifest().data.seq_len + 1;
    vocab = bundle.manifest().model.vocab_size;
    where = bundle.tokens().locate(global);
    shard_name = bundle.tokens().spec(where.shard).path;
    shard_file = dir / "bundle" / shard_name;
    wide = bundle.tokens().spec(where.shard).dtype == nanreplay::TokenDtype::kUint32;
  }
  {
    const uint32_t bad = static_cast<uint32_t>(vocab + 7);  // little-endian, as the shards are
    const unsigned char bytes[4] = {static_cast<unsigned char>(bad), static_cast<unsigned char>(bad >> 8),
                                    static_cast<unsigned char>(bad >> 16), static_cast<unsigned char>(bad >> 24)};
    std::fstream shard(shard_file, std::ios::in | std::ios::out | std::ios::binary);
    shard.seekp(where.offset * (wide ? 4 : 2));
    shard.write(reinterpret_cast<const char*>(bytes), wide ? 4 : 2);
    REQUIRE(shard.good());
    // As if the job had read the poisoned shard: no checksum to disagree with.
    nlohmann::json manifest = read_json(dir / "bundle" / "manifest.json");
    for (auto& s : manifest["data"]["shards"]) s.erase("sha256");
    std::ofstream(dir / "bundle" / "manifest.json") << manifest.dump(2);
  }
  const auto run = run_cli({"run", (dir / "bundle").string(), "--out", (dir / "out").string()});
  INFO(run.err);
  CHECK(run.status == 1);  // an error finding, though nothing went non-finite
  const nlohmann::json report = read_json(dir / "out" / "report.json");
  CHECK(report["reproduced"] == false);
  for (const auto& step : report["steps"]) CHECK(step["replayed"] == true);
  const auto found = with_code(report, "DATA_TOKEN_OUT_OF_RANGE");
  REQUIRE(found.size() == 1);
  CHECK(found[0]["severity"] == "error");
  CHECK(found[0]["evidence"]["shard"] == shard_name);
  CHECK(found[0]["evidence"]["offset"] == where.offset);
  CHECK(found[0]["evidence"]["token"] == vocab + 7);
  CHECK(found[0]["evidence"]["sample"] == sample);
  CHECK(found[0]["evidence"]["position"] == 1);
  CHECK_FALSE(found[0]["evidence"].contains("step"));
  CHECK(report["root_cause"]["code"] == "DATA_TOKEN_OUT_OF_RANGE");
}

TEST_CASE("DATA_REPEAT_RUN gives the run's position and length", "[cli][triage]") {
  ScratchDir dir("repeat");
  const Triaged t = triage(dir, "repeat-run");
  const auto found = with_code(t.report, "DATA_REPEAT_RUN");
  REQUIRE(found.size() == 1);
  CHECK(found[0]["evidence"]["sample"] == t.planted["first_sample"]);
  CHECK(found[0]["evidence"]["position"] == 4);
  CHECK(found[0]["evidence"]["length"] == 16);
  // The run holds the first non-finite value (one head amplifies its token): implicated.
  CHECK(found[0]["severity"] == "error");
  CHECK(found[0]["evidence"]["implicated"] == "origin");
  CHECK(t.report["first_nonfinite"]["sample"] == t.planted["first_sample"]);
  CHECK(t.report["root_cause"]["code"] == "DATA_REPEAT_RUN");
  CHECK(t.status == 1);
}

TEST_CASE("DATA_LOW_ENTROPY compares against the shard's typical sample", "[cli][triage]") {
  ScratchDir dir("entropy");
  const Triaged t = triage(dir, "low-entropy");
  const auto found = with_code(t.report, "DATA_LOW_ENTROPY");
  REQUIRE(found.size() == 1);
  CHECK(found[0]["evidence"]["sample"] == t.planted["first_sample"]);
  CHECK(found[0]["evidence"]["after"].get<double>() == Approx(1.0).epsilon(0.01));
  CHECK(found[0]["evidence"]["expected"].get<double>() > 4.0);
  // Nothing implicates the sample (no origin, an ordinary loss): context, not an error.
  CHECK(found[0]["severity"] == "info");
  CHECK(found[0]["evidence"]["implicated"].is_null());
  CHECK(t.status == 0);
}

TEST_CASE("DATA_SAMPLER_MISMATCH when recorded samples disagree with randperm", "[cli][triage]") {
  ScratchDir dir("sampler");
  const Triaged t = triage(dir, "sampler-mismatch");
  const auto found = with_code(t.report, "DATA_SAMPLER_MISMATCH");
  REQUIRE(found.size() == 1);
  CHECK(found[0]["evidence"]["sample"] == t.planted["first_sample"]);
  // The recorded samples are what the run read: the replay agrees with the log.
  CHECK(with_code(t.report, "SYSTEM_NOT_REPRODUCIBLE").empty());
}

TEST_CASE("NUMERIC_OVERFLOW names the site and head that reached the fp16 limit", "[cli][triage]") {
  ScratchDir dir("overflow");
  const Triaged t = triage(dir, "head-overflow");
  const auto found = with_code(t.report, "NUMERIC_OVERFLOW");
  REQUIRE(found.size() == 1);
  CHECK(found[0]["evidence"]["site"] == "layers.1.attn.scores");
  CHECK(found[0]["evidence"]["head"] == 2);
  CHECK(found[0]["evidence"]["expected"] == 65504.0);
  CHECK(t.report["root_cause"]["code"] == "NUMERIC_OVERFLOW");
  // The propagation path starts right after the origin.
  REQUIRE_FALSE(t.report["propagation"].empty());
  CHECK(t.report["propagation"][0]["site"] == "layers.1.attn.probs");
  CHECK(t.verdict.find("most likely root cause") != std::string::npos);
}

TEST_CASE("NUMERIC_ZERO_NORM for a zero row under norm_eps = 0", "[cli][triage]") {
  ScratchDir dir("zeronorm");
  const Triaged t = triage(dir, "zero-embedding");
  const auto found = with_code(t.report, "NUMERIC_ZERO_NORM");
  REQUIRE_FALSE(found.empty());
  CHECK(found[0]["severity"] == "error");
  CHECK(found[0]["evidence"]["site"] == "layers.0.attn_norm");
  CHECK(found[0]["evidence"]["sample"] == t.planted["first_sample"]);
  CHECK(found[0]["evidence"]["position"] == t.planted["zero_position"]);
  CHECK(t.report["root_cause"]["code"] == "NUMERIC_ZERO_NORM");
}

TEST_CASE("NUMERIC_FP8_SCALE_JUMP names module, tensor, step and both scales", "[cli][triage]") {
  ScratchDir dir("fp8");
  const Triaged t = triage(dir, "fp8-scale-jump");
  const auto found = with_code(t.report, "NUMERIC_FP8_SCALE_JUMP");
  REQUIRE(found.size() == 1);
  CHECK(found[0]["evidence"]["tensor"] == "input");
  CHECK(found[0]["evidence"]["step"] == t.planted["fault_step"]);
  CHECK(found[0]["evidence"]["before"] == 1.0);
  CHECK(found[0]["evidence"]["after"] == 1000.0);
  CHECK(found[0]["evidence"]["param"].get<std::string>().rfind("model.layers.0.", 0) == 0);
}

TEST_CASE("NUMERIC_LOSS_SCALE_OVERFLOW is handled overflow, not a reproduction", "[cli][triage]") {
  ScratchDir dir("lossscale");
  const Triaged t = triage(dir, "loss-scale-overflow");
  REQUIRE_FALSE(with_code(t.report, "NUMERIC_LOSS_SCALE_OVERFLOW").empty());
  CHECK(with_code(t.report, "NUMERIC_LOSS_SCALE_OVERFLOW")[0]["severity"] == "info");
  for (const auto& f : with_code(t.report, "NUMERIC_LOSS_SCALE_OVERFLOW")) {
    // report-v1: a finding about a site carries its head (null: not a per-head site).
    CHECK(f["evidence"]["site"] == "logits");
    CHECK(f["evidence"].contains("head"));
    CHECK(f["evidence"]["head"].is_null());
  }
  CHECK(t.report["reproduced"] == false);
  CHECK(t.report["first_nonfinite"].is_null());
  CHECK(t.status == 0);
  // The job's skipped flags agree with the replay.
  CHECK(with_code(t.report, "SYSTEM_NOT_REPRODUCIBLE").empty());
}

TEST_CASE("SYSTEM_BIT_FLIP finds a flipped weight even when nothing goes non-finite", "[cli][triage]") {
  ScratchDir dir("silentflip");
  const Triaged t = triage(dir, "silent-bit-flip");
  CHECK(t.report["reproduced"] == false);
  const auto found = with_code(t.report, "SYSTEM_BIT_FLIP");
  REQUIRE(found.size() == 1);
  CHECK(found[0]["evidence"]["param"] == "model.layers.0.mlp.up_proj.weight");
  CHECK(found[0]["evidence"]["bit"] == 29);
  CHECK(found[0]["evidence"]["step"] == t.planted["fault_step"]);
  CHECK(found[0]["evidence"]["index"] == nlohmann::json::array({0, 0}));
  CHECK(t.status == 1);
  CHECK(t.report["root_cause"]["code"] == "SYSTEM_BIT_FLIP");
}

TEST_CASE("a checkpoint already holding NaN is reported before replay and blamed, not the site", "[cli][triage]") {
  ScratchDir dir("contaminated");
  const Triaged t = triage(dir, "bit-flip");
  const auto found = with_code(t.report, "CHECKPOINT_NONFINITE");
  REQUIRE(found.size() == 1);
  CHECK(found[0]["severity"] == "error");  // before the first non-finite replayed value: a cause
  CHECK(found[0]["evidence"]["param"] == "model.layers.1.post_attention_layernorm.weight");
  CHECK(found[0]["evidence"]["step"] == t.planted["fault_step"]);
  CHECK(found[0]["evidence"]["length"] == 1);
  CHECK(t.report["first_nonfinite"]["producer"] == false);
  CHECK(t.report["first_nonfinite"]["checkpoint_nonfinite_params"][0] ==
        "model.layers.1.post_attention_layernorm.weight");
  const auto flips = with_code(t.report, "SYSTEM_BIT_FLIP");
  REQUIRE(flips.size() == 1);
  CHECK(flips[0]["evidence"]["bit"] == 30);
  CHECK(flips[0]["evidence"]["index"][0] == t.planted["fault_element"]);
  CHECK(t.report["root_cause"]["code"] == "SYSTEM_BIT_FLIP");
}

TEST_CASE("SYSTEM_NOT_REPRODUCIBLE: a logged NaN the replay does not reproduce", "[cli][triage]") {
  ScratchDir dir("notrepro");
  const Triaged t = triage(dir, "not-reproducible");
  const auto found = with_code(t.report, "SYSTEM_NOT_REPRODUCIBLE");
  REQUIRE(found.size() == 1);
  CHECK(found[0]["severity"] == "error");
  CHECK(found[0]["evidence"]["step"] == t.planted["fault_step"]);
  CHECK(t.report["reproduced"] == false);
  CHECK(t.status == 1);
  CHECK(t.report["root_cause"]["code"] == "SYSTEM_NOT_REPRODUCIBLE");
}

TEST_CASE("SYSTEM_RANK_MISMATCH names the rank that disagrees", "[cli][triage]") {
  ScratchDir dir("rank");
  const Triaged t = triage(dir, "rank-mismatch");
  const auto found = with_code(t.report, "SYSTEM_RANK_MISMATCH");
  REQUIRE(found.size() == 1);
  CHECK(found[0]["evidence"]["rank"] == 1);
  CHECK(found[0]["evidence"]["tensor"] == "loss");
}

TEST_CASE("BUNDLE_CHECKSUM_MISMATCH is a finding, not a crash", "[cli][triage]") {
  ScratchDir dir("checksum");
  const Triaged t = triage(dir, "checksum-mismatch");
  const auto found = with_code(t.report, "BUNDLE_CHECKSUM_MISMATCH");
  REQUIRE(found.size() == 1);
  CHECK(found[0]["layer"] == "system");
  CHECK(found[0]["evidence"]["shard"] == "data/shard_000.bin");
  CHECK(t.report["root_cause"]["code"] == "BUNDLE_CHECKSUM_MISMATCH");
}

TEST_CASE("the determinism self-check replays what decides the verdict and says it matched", "[cli][triage]") {
  ScratchDir dir("determinism");
  SECTION("no origin: the last step's first micro-batch") {
    const Triaged t = triage(dir, "clean-fp16");
    const nlohmann::json& d = t.report["determinism"];
    REQUIRE(d.is_object());
    CHECK(d["bitwise_identical"] == true);
    CHECK(d["replayed"] == "micro_batch");
    CHECK(d["step"] == t.report["steps"].back()["step"]);
    CHECK(d["rank"] == 0);
    CHECK(d["micro_batch"] == 0);
    CHECK(d["probes_compared"].get<int>() > 100);
    CHECK(t.verdict.find("rank 0 micro-batch 0 replayed twice, bitwise identical") != std::string::npos);
  }
  SECTION("an origin: its own micro-batch, forward and backward only") {
    const Triaged t = triage(dir, "head-overflow");
    const nlohmann::json& d = t.report["determinism"];
    const nlohmann::json& origin = t.report["first_nonfinite"];
    REQUIRE(origin.is_object());
    CHECK(d["bitwise_identical"] == true);
    CHECK(d["replayed"] == "micro_batch");
    CHECK(d["step"] == origin["step"]);
    CHECK(d["rank"] == origin["rank"]);
    CHECK(d["micro_batch"] == origin["micro_batch"]);
    // One pass of a step of grad_accum_steps passes: far fewer records than the step holds.
    CHECK(d["probes_compared"].get<int>() > 50);
    const double share = t.report["timings"]["seconds"]["determinism"].get<double>() /
                         t.report["timings"]["seconds"]["replay"].get<double>();
    CHECK(share < 0.5);
  }
}

TEST_CASE("scan-data flags poisoned samples over the whole stream and prints GB/s", "[cli][triage][scan]") {
  ScratchDir dir("scan");
  REQUIRE(run_cli({"synth", "repeat-run", (dir / "bundle").string()}).status == 0);
  const auto text = run_cli({"scan-data", (dir / "bundle").string()});
  CHECK(text.status == 1);
  CHECK(text.out.find("GB/s") != std::string::npos);
  const auto json = run_cli({"scan-data", (dir / "bundle").string(), "--json"});
  REQUIRE(json.status == 1);
  const auto scan = nlohmann::json::parse(json.out);
  REQUIRE(scan["repeat_runs"].size() == 1);
  CHECK(scan["repeat_runs"][0]["length"] == 16);
  CHECK(scan["repeat_runs"][0]["position"] == 4);
  CHECK(scan["out_of_range_count"] == 0);

  ScratchDir clean("scan-clean");
  REQUIRE(run_cli({"synth", "clean-fp32", (clean / "bundle").string()}).status == 0);
  const auto ok = run_cli({"scan-data", (clean / "bundle").string(), "--json"});
  CHECK(ok.status == 0);
  CHECK(nlohmann::json::parse(ok.out)["samples"] == 255);
}
