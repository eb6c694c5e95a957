// `inspect` validates what `run` validates before it replays, with the same
// line: each broken bundle here is refused by both with exit 2 and one
// identical line naming the file and key (a corrupt optimizer state, an
// out-of-range sample, a step outside the epoch, an epoch that would pass
// 2^63, an F64 parameter, a manifest contradicting the checkpoint, an
// optimizer state that is a FIFO or a directory, a NaN lr, a negative loss
// scale). Also: what "valid" means is said, an explicit sampler has no seed,
// and a checksum mismatch names its shard in `inspect` and `scan-data`.
#include <catch2/catch.hpp>

#include <sys/stat.h>

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "tests/bundle_bytes.h"
#include "tests/cli_harness.h"

namespace {

namespace fs = std::filesystem;
using nanreplay_test::check_one_error_line;
using nanreplay_test::CliResult;
using nanreplay_test::edit_json;
using nanreplay_test::read_u64_le;
using nanreplay_test::u64_le;
using nanreplay_test::write_bytes;
using nanreplay_test::read_json;
using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;
using nanreplay_test::shared_clean_bundle;
using nanreplay_test::slurp;
using nlohmann::json;

// Rewrites tensor `name` of a safetensors file as F64 of the same shape and
// values (its bytes doubled, every later offset moved): a consistent header
// with a dtype the replay does not take.
void widen_to_f64(const fs::path& path, const std::string& name) {
  const std::string bytes = slurp(path);
  const uint64_t length = read_u64_le(bytes);
  json header = json::parse(bytes.substr(8, length));
  const std::string data = bytes.substr(8 + length);
  const uint64_t begin = header[name]["data_offsets"][0];
  const uint64_t end = header[name]["data_offsets"][1];
  std::string wide;
  for (uint64_t at = begin; at < end; at += 4) {
    float value;
    std::memcpy(&value, data.data() + at, 4);
    const double widened = value;
    wide.append(reinterpret_cast<const char*>(&widened), 8);
  }
  for (auto& [key, entry] : header.items()) {
    if (key == "__metadata__" || entry["data_offsets"][0].get<uint64_t>() < end) continue;
    entry["data_offsets"][0] = entry["data_offsets"][0].get<uint64_t>() + (end - begin);
    entry["data_offsets"][1] = entry["data_offsets"][1].get<uint64_t>() + (end - begin);
  }
  header[name]["dtype"] = "F64";
  header[name]["data_offsets"][1] = begin + wide.size();
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  write_bytes(path, u64_le(text.size()) + text + data.substr(0, begin) + wide + data.substr(end));
}

struct InspectCase {
  std::string name;
  std::function<void(const fs::path& bundle)> breaking;
  std::vector<std::string> named;  // file and key, in the message
};

}  // namespace

TEST_CASE("inspect refuses what run refuses, with the same line naming file and key", "[cli][inspect][structure]") {
  const std::vector<InspectCase> cases = {
      {"corrupt_optimizer", [](const fs::path& b) { fs::resize_file(b / "steps/101/optimizer.safetensors", 4); },
       {"steps/101/optimizer.safetensors", "byte 0"}},
      {"optimizer_missing_moment", [](const fs::path& b) {
         const fs::path path = b / "steps/102/optimizer.safetensors";
         std::string bytes = slurp(path);
         const std::string key = "\"model.norm.weight.exp_avg\"";
         bytes.replace(bytes.find(key), key.size(), "\"model.norm.weight.exp_av_\"");
         write_bytes(path, bytes);
       }, {"steps/102/optimizer.safetensors", "model.norm.weight.exp_avg", "missing tensor"}},
      {"sample_out_of_range", [](const fs::path& b) {
         edit_json(b / "manifest.json", [](json& m) { m["steps"][1]["samples"][0][2] = 99999; });
       }, {"manifest.json", "steps[1].samples[0][2]", "99999"}},
      {"step_before_the_epoch", [](const fs::path& b) {
         edit_json(b / "manifest.json", [](json& m) { m["data"]["sampler"]["epoch_start_step"] = 102; });
       }, {"manifest.json", "steps[0].step", "expected a step in [102, "}},
      {"epoch_past_2_63", [](const fs::path& b) {
         edit_json(b / "manifest.json", [](json& m) {
           m["data"]["sampler"]["epoch_start_step"] = int64_t{9223372036854775800};
         });
       }, {"manifest.json", "data.sampler.epoch_start_step", "2^63 - 1"}},
      {"f64_parameter", [](const fs::path& b) {
         widen_to_f64(b / "steps/103/model.safetensors", "model.layers.1.post_attention_layernorm.weight");
       }, {"steps/103/model.safetensors", "model.layers.1.post_attention_layernorm.weight", "F64"}},
      {"manifest_contradicts_checkpoint", [](const fs::path& b) {
         edit_json(b / "manifest.json", [](json& m) { m["model"]["intermediate_size"] = 96; });
       }, {"steps/100/model.safetensors", "does not match the manifest's llama model"}},
      {"optimizer_is_a_fifo", [](const fs::path& b) {
         fs::remove(b / "steps/101/optimizer.safetensors");
         REQUIRE(::mkfifo((b / "steps/101/optimizer.safetensors").c_str(), 0644) == 0);
       }, {"steps/101/optimizer.safetensors", "found a FIFO"}},
      {"optimizer_is_a_directory", [](const fs::path& b) {
         fs::remove(b / "steps/101/optimizer.safetensors");
         fs::create_directory(b / "steps/101/optimizer.safetensors");
       }, {"steps/101/optimizer.safetensors", "found a directory"}},
      {"nan_lr", [](const fs::path& b) { edit_json(b / "steps/102/state.json", [](json& s) { s["lr"] = "nan"; }); },
       {"steps/102/state.json", "lr", "expected a learning rate"}},
      {"negative_loss_scale", [](const fs::path& b) {
         edit_json(b / "steps/100/state.json", [](json& s) { s["loss_scale"] = -1; });
       }, {"steps/100/state.json", "loss_scale", "positive finite"}},
  };
  ScratchDir scratch("structure-cases");
  for (const InspectCase& c : cases) {
    INFO("case: " << c.name);
    const fs::path bundle = scratch / c.name;
    fs::copy(shared_clean_bundle(), bundle, fs::copy_options::recursive);
    c.breaking(bundle);
    const CliResult inspect = run_cli({"inspect", bundle.string()});
    check_one_error_line(inspect, c.named);
    const fs::path out = scratch / (c.name + "-out");
    const CliResult run = run_cli({"run", bundle.string(), "--out", out.string()});
    check_one_error_line(run, c.named);
    CHECK(run.err == inspect.err);
    CHECK_FALSE(fs::exists(out));
  }
}

TEST_CASE("inspect says it checks structure, not faithfulness, and gives no seed to an explicit sampler",
          "[cli][inspect]") {
  const CliResult text = run_cli({"inspect", shared_clean_bundle().string()});
  REQUIRE(text.status == 0);
  CHECK(text.out.find("not whether the bundle faithfully records the run") != std::string::npos);
  CHECK(text.out.find("sampler    randperm, seed 1234") != std::string::npos);
  const json summary = json::parse(run_cli({"inspect", shared_clean_bundle().string(), "--json"}).out);
  CHECK(summary["validated"] == "structure");
  CHECK(summary["faithfulness"].get<std::string>().find("reproduces the logged losses") != std::string::npos);

  ScratchDir scratch("structure-explicit");
  const fs::path bundle = scratch / "explicit";
  fs::copy(shared_clean_bundle(), bundle, fs::copy_options::recursive);
  edit_json(bundle / "manifest.json", [](json& m) { m["data"]["sampler"] = {{"kind", "explicit"}}; });
  const CliResult explicit_text = run_cli({"inspect", bundle.string()});
  INFO(explicit_text.err);
  REQUIRE(explicit_text.status == 0);
  CHECK(explicit_text.out.find("sampler    explicit") != std::string::npos);
  CHECK(explicit_text.out.find("seed") == std::string::npos);
  const json explicit_summary = json::parse(run_cli({"inspect", bundle.string(), "--json"}).out);
  CHECK(explicit_summary["sampler"]["seed"].is_null());
  CHECK(explicit_summary["sampler"]["epoch_start_step"].is_null());
}

TEST_CASE("a checksum mismatch: scan-data exits 1 naming the shard, inspect names it in its error",
          "[cli][inspect][scan]") {
  ScratchDir scratch("structure-checksum");
  const fs::path bundle = scratch / "bundle";
  REQUIRE(run_cli({"synth", "checksum-mismatch", bundle.string()}).status == 0);
  const CliResult scan = run_cli({"scan-data", bundle.string()});
  INFO(scan.out << scan.err);
  CHECK(scan.status == 1);  // 0 before: a checksum mismatch went unreported
  CHECK(scan.out.find("shard checksums: MISMATCH") != std::string::npos);
  CHECK(scan.out.find("data/shard_") != std::string::npos);
  const json scan_json = json::parse(run_cli({"scan-data", bundle.string(), "--json"}).out);
  REQUIRE(scan_json["checksum_mismatches"].size() == 1);
  const std::string shard = scan_json["checksum_mismatches"][0]["shard"];
  CHECK(run_cli({"scan-data", shared_clean_bundle().string(), "--quiet"}).status == 0);

  const CliResult inspect = run_cli({"inspect", bundle.string()});
  check_one_error_line(inspect, {shard + ": sha256 is ", "the manifest says"});
}
