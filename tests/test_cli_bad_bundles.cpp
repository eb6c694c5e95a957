// A corpus of broken bundles, each derived from one good synthetic bundle by
// breaking exactly one thing (bytes, manifest keys, paths, symlinks), replayed
// through the real CLI. The bar for every case: exit 2, exactly one line on
// stderr naming the file and the key or byte offset, no crash, and no output
// directory left behind. Also: SIGINT/SIGTERM mid-replay, --max-memory, and
// outputs that stay whole when a re-run into them fails.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "loaders/bundle/manifest.h"
#include "loaders/bundle/token_shards.h"
#include "replay/step/memory_estimate.h"
#include "tests/bundle_bytes.h"
#include "tests/cli_harness.h"

// AddressSanitizer reserves terabytes of shadow address space and inflates
// RSS: under it (scripts/sanitize.sh) no RLIMIT_AS is set and RSS is not compared.
#if defined(__SANITIZE_ADDRESS__)
#define NANREPLAY_TEST_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define NANREPLAY_TEST_UNDER_ASAN 1
#endif
#endif
#ifndef NANREPLAY_TEST_UNDER_ASAN
#define NANREPLAY_TEST_UNDER_ASAN 0
#endif

namespace {

namespace fs = std::filesystem;
using nanreplay_test::CliResult;
using nanreplay_test::edit_json;
using nanreplay_test::read_u64_le;
using nanreplay_test::u64_le;
using nanreplay_test::write_bytes;
using nanreplay_test::Finished;
using nanreplay_test::line_count;
using nanreplay_test::run_cli;
using nanreplay_test::spawn_cli;
using nanreplay_test::SpawnOptions;
using nanreplay_test::Spawned;
using nanreplay_test::wait_cli;
using nanreplay_test::ScratchDir;
using nanreplay_test::slurp;
using nanreplay_test::read_json;
using nlohmann::json;

// ---- the good bundle and ways to break a copy of it --------------------------

// One clean bundle per test process (llama fp32, steps 100..103, two shards).
const fs::path& good_bundle() {
  static ScratchDir dir("bad-bundles-good");
  static const fs::path bundle = [] {
    const fs::path path = dir / "good";
    const CliResult synth = run_cli({"synth", "clean-fp32", path.string()});
    REQUIRE(synth.status == 0);
    return path;
  }();
  return bundle;
}

fs::path copy_of_good(const ScratchDir& scratch, const std::string& name) {
  const fs::path copy = scratch / name;
  fs::copy(good_bundle(), copy, fs::copy_options::recursive);
  return copy;
}

std::string read_bytes(const fs::path& path) { return slurp(path); }

// A safetensors file split into its JSON header and its data region.
struct Safetensors {
  json header;
  std::string data;
};

Safetensors read_safetensors(const fs::path& path) {
  const std::string bytes = read_bytes(path);
  const uint64_t length = read_u64_le(bytes);
  return {json::parse(bytes.substr(8, length)), bytes.substr(8 + length)};
}

// Rewrites the header (space-padded to 8 bytes) and keeps or replaces the data.
void write_safetensors(const fs::path& path, const Safetensors& file) {
  std::string header = file.header.dump();
  header.append((8 - header.size() % 8) % 8, ' ');
  write_bytes(path, u64_le(header.size()) + header + file.data);
}

void edit_safetensors_header(const fs::path& path, const std::function<void(json&)>& edit) {
  Safetensors file = read_safetensors(path);
  edit(file.header);
  write_safetensors(path, file);
}

// Tensor names of a header ordered by their data offsets.
std::vector<std::string> tensors_by_offset(const json& header) {
  std::vector<std::string> names;
  for (const auto& [name, entry] : header.items()) {
    if (name != "__metadata__") names.push_back(name);
  }
  std::sort(names.begin(), names.end(), [&](const std::string& a, const std::string& b) {
    return header[a]["data_offsets"][0].get<uint64_t>() < header[b]["data_offsets"][0].get<uint64_t>();
  });
  return names;
}

// ---- the bar every broken bundle must meet -----------------------------------

// Exit 2, one line "nanreplay: error: ..." naming `file` and `key`, no OUT.
void check_refused(const CliResult& run, const fs::path& out, const std::string& file,
                   const std::string& key) {
  INFO("stderr: " << run.err);
  CHECK(run.status == 2);
  CHECK(line_count(run.err) == 1);
  CHECK(run.err.rfind("nanreplay: error: ", 0) == 0);
  CHECK(run.err.find(file) != std::string::npos);
  if (!key.empty()) CHECK(run.err.find(key) != std::string::npos);
  CHECK(run.err.find('\x1b') == std::string::npos);  // bundle text cannot reach the terminal raw
  CHECK(run.out.empty());
  CHECK_FALSE(fs::exists(out));
}

struct BrokenCase {
  std::string name;
  std::function<void(const fs::path& bundle)> breaking;
  std::string file;  // expected in the message
  std::string key;   // expected in the message ("" for a file that is missing whole)
};

void run_cases(const std::string& tag, const std::vector<BrokenCase>& cases) {
  ScratchDir scratch(tag);
  for (const BrokenCase& c : cases) {
    INFO("case: " << c.name);
    const fs::path bundle = copy_of_good(scratch, c.name);
    c.breaking(bundle);
    const fs::path out = scratch / (c.name + "-out");
    check_refused(run_cli({"run", bundle.string(), "--out", out.string()}), out, c.file, c.key);
  }
}

const std::string kModel100 = "steps/100/model.safetensors";
const std::string kModel101 = "steps/101/model.safetensors";

fs::path model_file(const fs::path& bundle, int step) {
  return bundle / "steps" / std::to_string(step) / "model.safetensors";
}

// The name of the tensor whose bytes end the data region, read from the good bundle.
std::string last_tensor(int step) {
  return tensors_by_offset(read_safetensors(model_file(good_bundle(), step)).header).back();
}

std::string byte_key(size_t offset) { return "byte " + std::to_string(offset); }

}  // namespace

TEST_CASE("bad bundles: broken safetensors files are refused with file and tensor or byte",
          "[cli][bad-input][safetensors]") {
  const Safetensors good = read_safetensors(model_file(good_bundle(), 100));
  const std::vector<std::string> order = tensors_by_offset(good.header);
  const std::string first = order[0];
  const std::string second = order[1];
  const size_t file_size = fs::file_size(model_file(good_bundle(), 100));
  const std::string norm = "model.layers.0.input_layernorm.weight";  // shape [64], F32

  run_cases("safetensors", {
    {"truncated_to_4_bytes", [](const fs::path& b) {
       fs::resize_file(model_file(b, 100), 4);
     }, kModel100, "byte 0"},
    {"truncated_in_header", [](const fs::path& b) {
       const fs::path path = model_file(b, 100);
       fs::resize_file(path, 8 + read_u64_le(read_bytes(path)) / 2);
     }, kModel100, "byte 0"},
    {"truncated_in_data", [&](const fs::path& b) {
       fs::resize_file(model_file(b, 100), file_size - 100);
     }, kModel100, last_tensor(100)},
    // Mid-replay: step 100 replays, step 101 fails; the output directory must still vanish.
    {"truncated_at_step_101", [&](const fs::path& b) {
       fs::resize_file(model_file(b, 101), fs::file_size(model_file(b, 101)) - 1);
     }, kModel101, last_tensor(101)},
    {"header_length_beyond_file", [&](const fs::path& b) {
       std::string bytes = read_bytes(model_file(b, 100));
       bytes.replace(0, 8, u64_le(file_size * 2));
       write_bytes(model_file(b, 100), bytes);
     }, kModel100, "byte 0"},
    {"offsets_out_of_range", [&](const fs::path& b) {
       edit_safetensors_header(model_file(b, 100), [&](json& h) {
         h[first]["data_offsets"][1] = good.data.size() + 4;
       });
     }, kModel100, first},
    {"offsets_overlap", [&](const fs::path& b) {
       edit_safetensors_header(model_file(b, 100), [&](json& h) {
         // The second tensor starts 4 bytes early: same byte span, overlapping the first.
         h[second]["data_offsets"][0] = h[second]["data_offsets"][0].get<uint64_t>() - 4;
         h[second]["data_offsets"][1] = h[second]["data_offsets"][1].get<uint64_t>() - 4;
       });
     }, kModel100, second},
    {"offsets_leave_trailing_bytes", [&](const fs::path& b) {
       write_bytes(model_file(b, 100), read_bytes(model_file(b, 100)) + std::string(8, '\0'));
     }, kModel100, byte_key(file_size)},
    {"unknown_dtype", [&](const fs::path& b) {
       edit_safetensors_header(model_file(b, 100), [&](json& h) { h[norm]["dtype"] = "F8_E4M3"; });
     }, kModel100, norm},
    {"shape_disagrees_with_span", [&](const fs::path& b) {
       edit_safetensors_header(model_file(b, 100), [&](json& h) { h[norm]["shape"] = {65}; });
     }, kModel100, norm},
    {"shape_count_overflows", [&](const fs::path& b) {
       edit_safetensors_header(model_file(b, 100), [&](json& h) {
         h[norm]["shape"] = {uint64_t{1} << 32, uint64_t{1} << 32, 16};
       });
     }, kModel100, norm},
    {"right_span_wrong_dtype", [&](const fs::path& b) {
       // I32 has F32's size, so the header is consistent; the checkpoint loader refuses it.
       edit_safetensors_header(model_file(b, 100), [&](json& h) { h[norm]["dtype"] = "I32"; });
     }, kModel100, norm},
    // Bundle text in a message is escaped: still one line, no terminal control sequences.
    {"tensor_name_with_control_characters", [&](const fs::path& b) {
       edit_safetensors_header(model_file(b, 100), [&](json& h) {
         h[norm + "\x1b[2J\n"] = h[norm];
         h[norm + "\x1b[2J\n"]["dtype"] = "F8_E4M3";
         h.erase(norm);
       });
     }, kModel100, norm + "\\x1b[2J\\x0a"},
    // Only the first step must hold a checkpoint: a later one without is rolled forward.
    {"missing_first_checkpoint", [](const fs::path& b) {
       fs::remove(model_file(b, 100));
     }, kModel100, ""},
  });
}

TEST_CASE("bad bundles: a shape claiming terabytes is refused before any allocation",
          "[cli][bad-input][safetensors]") {
  ScratchDir scratch("terabytes");
  const fs::path bundle = copy_of_good(scratch, "terabytes");
  const std::string embed = "model.embed_tokens.weight";
  // 2^20 x 2^20 F32 = 4 TiB claimed for a tensor whose bytes are a few KiB.
  edit_safetensors_header(model_file(bundle, 100), [&](json& h) {
    h[embed]["shape"] = {uint64_t{1} << 20, uint64_t{1} << 20};
  });
  // Under a 4 GiB address-space cap no allocation of that size (nor a tenth
  // of it) could succeed, whatever the kernel's overcommit policy: a tool that
  // tried would die with bad_alloc (exit 3). Exit 2 naming the span proves the
  // header check refused it first.
  const fs::path out = scratch / "out";
  SpawnOptions capped;
  capped.address_space_limit = NANREPLAY_TEST_UNDER_ASAN ? 0 : rlim_t{4} << 30;
  const Finished done =
      wait_cli(spawn_cli(scratch, {"run", bundle.string(), "--out", out.string()}, capped));
  check_refused(done.result, out, kModel100, embed);
  CHECK(done.result.err.find("needs 4398046511104 bytes") != std::string::npos);
}

TEST_CASE("bad bundles: broken manifests are refused with the key or byte at fault",
          "[cli][bad-input][manifest]") {
  const std::string good_text = read_bytes(good_bundle() / "manifest.json");
  // Byte offsets of a planted fault in a manifest text rewritten as `text`.
  auto planted = [](const std::string& text, const std::string& marker) {
    const size_t at = text.find(marker);
    REQUIRE(at != std::string::npos);
    return at;
  };
  const std::string utf8_marker = "\"symptom_note\": \"caf";
  std::string bad_utf8 = good_text;
  bad_utf8.insert(1, utf8_marker + "\xff\"," + "\n");
  const size_t bad_utf8_at = planted(bad_utf8, utf8_marker) + utf8_marker.size();
  std::string deep = good_text;
  deep.insert(1, "\"deep\": " + std::string(100000, '[') + std::string(100000, ']') + ",\n");
  const size_t deep_at = planted(deep, "\"deep\": ") + 8 + 63;  // the 64th [ opens level 65
  std::string nan_literal = good_text;
  nan_literal.replace(planted(good_text, "1e-05"), 5, "NaN");

  run_cases("manifest", {
    {"missing_key", [](const fs::path& b) {
       edit_json(b / "manifest.json", [](json& m) { m["model"].erase("hidden_size"); });
     }, "manifest.json", "model.hidden_size"},
    {"wrong_type", [](const fs::path& b) {
       edit_json(b / "manifest.json", [](json& m) { m["data"]["seq_len"] = "32"; });
     }, "manifest.json", "data.seq_len"},
    {"negative", [](const fs::path& b) {
       edit_json(b / "manifest.json", [](json& m) { m["model"]["num_layers"] = -2; });
     }, "manifest.json", "model.num_layers"},
    {"max_seq_len_2_62", [](const fs::path& b) {
       edit_json(b / "manifest.json", [](json& m) { m["model"]["max_seq_len"] = int64_t{1} << 62; });
     }, "manifest.json", "model.max_seq_len"},
    {"num_experts_2_40", [](const fs::path& b) {
       edit_json(b / "manifest.json", [](json& m) { m["model"]["moe"] = {{"num_experts", int64_t{1} << 40}, {"top_k", 1}}; });
     }, "manifest.json", "model.moe.num_experts"},
    {"nan_string", [](const fs::path& b) {
       edit_json(b / "manifest.json", [](json& m) { m["model"]["norm_eps"] = "nan"; });
     }, "manifest.json", "model.norm_eps"},
    {"nan_literal", [&](const fs::path& b) {
       write_bytes(b / "manifest.json", nan_literal);
     }, "manifest.json", byte_key(planted(nan_literal, "NaN"))},
    // nlohmann refuses 1e400 with out_of_range, not parse_error: it used to escape as exit 3.
    {"number_beyond_double", [](const fs::path& b) {
       std::string text = read_bytes(b / "manifest.json");
       text.replace(text.find("1e-05"), 5, "1e400");
       write_bytes(b / "manifest.json", text);
     }, "manifest.json", "byte "},
    {"invalid_utf8", [&](const fs::path& b) { write_bytes(b / "manifest.json", bad_utf8); },
     "manifest.json", byte_key(bad_utf8_at)},
    {"deeply_nested", [&](const fs::path& b) { write_bytes(b / "manifest.json", deep); },
     "manifest.json", byte_key(deep_at)},
    {"not_json_at_all", [](const fs::path& b) {
       write_bytes(b / "manifest.json", std::string("\x89PNG\r\n\x1a\n", 8));
     }, "manifest.json", "byte 0"},
    {"state_json_invalid_utf8", [](const fs::path& b) {
       write_bytes(b / "steps/100/state.json", "{\"step\": 100, \"x\": \"\xc0\xaf\"}");
     }, "steps/100/state.json", "byte 20"},
    {"state_json_deeply_nested", [](const fs::path& b) {
       write_bytes(b / "steps/100/state.json",
                   "{\"step\": 100, \"x\": " + std::string(5000, '{') + "}");
     }, "steps/100/state.json", byte_key(19 + 63)},
    {"state_json_wrong_step", [](const fs::path& b) {
       edit_json(b / "steps/101/state.json", [](json& s) { s["step"] = 7; });
     }, "steps/101/state.json", "step"},
  });
}

TEST_CASE("bad bundles: missing directories and paths escaping the bundle are refused",
          "[cli][bad-input][paths]") {
  ScratchDir outside("bad-bundles-outside");
  fs::copy(good_bundle(), outside / "elsewhere", fs::copy_options::recursive);
  const fs::path elsewhere = outside / "elsewhere";

  run_cases("paths", {
    {"empty_bundle_directory", [](const fs::path& b) {
       fs::remove_all(b);
       fs::create_directory(b);
     }, "manifest.json", ""},
    {"step_directory_missing", [](const fs::path& b) {
       edit_json(b / "manifest.json", [](json& m) { m["steps"][1]["dir"] = "steps/999"; });
     }, "manifest.json", "steps[1].dir"},
    {"step_dir_dot_dot", [](const fs::path& b) {
       edit_json(b / "manifest.json", [](json& m) { m["steps"][0]["dir"] = "steps/../../elsewhere"; });
     }, "manifest.json", "steps[0].dir"},
    {"shard_path_absolute", [&](const fs::path& b) {
       edit_json(b / "manifest.json", [&](json& m) {
         m["data"]["shards"][0]["path"] = (elsewhere / "data/shard_000.bin").string();
       });
     }, "manifest.json", "data.shards[0].path"},
    {"shard_symlink_outside", [&](const fs::path& b) {
       fs::remove(b / "data/shard_000.bin");
       fs::create_symlink(elsewhere / "data/shard_000.bin", b / "data/shard_000.bin");
     }, "manifest.json", "data.shards[0].path"},
    {"step_dir_symlink_outside", [&](const fs::path& b) {
       fs::remove_all(b / "steps/101");
       fs::create_directory_symlink(elsewhere / "steps/101", b / "steps/101");
     }, "manifest.json", "steps[1].dir"},
    {"checkpoint_symlink_outside", [&](const fs::path& b) {
       fs::remove(model_file(b, 101));
       fs::create_symlink(model_file(elsewhere, 101), model_file(b, 101));
     }, kModel101, "steps[1].dir"},
    {"manifest_symlink_outside", [&](const fs::path& b) {
       fs::remove(b / "manifest.json");
       fs::create_symlink(elsewhere / "manifest.json", b / "manifest.json");
     }, "manifest.json", "escapes the bundle"},
    {"shard_path_with_control_characters", [](const fs::path& b) {
       edit_json(b / "manifest.json", [](json& m) {
         m["data"]["shards"][0]["path"] = "data/shard\n\x1b]0;owned\x07_000.bin";
       });
     }, "manifest.json", "data.shards[0].path"},
    {"shard_shorter_than_tokens", [](const fs::path& b) {
       fs::resize_file(b / "data/shard_000.bin", fs::file_size(b / "data/shard_000.bin") - 2);
     }, "data/shard_000.bin", "data.shards[0].tokens"},
    {"shard_longer_than_tokens", [](const fs::path& b) {
       fs::resize_file(b / "data/shard_001.bin", fs::file_size(b / "data/shard_001.bin") + 2);
     }, "data/shard_001.bin", "data.shards[1].tokens"},
    {"shard_missing", [](const fs::path& b) { fs::remove(b / "data/shard_001.bin"); },
     "data/shard_001.bin", ""},
  });
  // The bundle outside was only ever read.
  CHECK(fs::exists(elsewhere / "manifest.json"));
}

TEST_CASE("bad bundles: a token id out of range is a finding, not a crash", "[cli][bad-input][data]") {
  ScratchDir scratch("token-range");
  const fs::path bundle = copy_of_good(scratch, "bundle");
  const json manifest = json::parse(read_bytes(bundle / "manifest.json"));
  const int64_t seq_len = manifest["data"]["seq_len"];
  const int64_t vocab = manifest["model"]["vocab_size"];
  const int64_t per_shard = manifest["data"]["shards"][0]["tokens"];
  // The third token of step 100's first sample, located in its shard.
  const int64_t sample = manifest["steps"][0]["samples"][0][0];
  const int64_t global = sample * seq_len + 2;
  const size_t shard = static_cast<size_t>(global / per_shard);
  const int64_t offset = global % per_shard;
  const std::string shard_path = manifest["data"]["shards"][shard]["path"];
  std::string tokens = read_bytes(bundle / shard_path);
  const uint16_t bad = static_cast<uint16_t>(vocab);  // the first id past the vocabulary
  std::memcpy(&tokens[static_cast<size_t>(offset) * 2], &bad, sizeof bad);
  write_bytes(bundle / shard_path, tokens);
  // Keep the checksum right so the token is the only thing wrong.
  edit_json(bundle / "manifest.json", [&](json& m) {
    m["data"]["shards"][shard]["sha256"] = nanreplay::sha256_hex(
        reinterpret_cast<const uint8_t*>(tokens.data()), tokens.size());
  });

  const fs::path out = scratch / "out";
  const CliResult run = run_cli({"run", bundle.string(), "--out", out.string()});
  INFO(run.err);
  CHECK(run.status == 1);
  CHECK(run.err.empty());
  const json report = nanreplay_test::read_json(out / "report.json");
  bool found = false;
  for (const json& finding : report["findings"]) {
    if (finding["code"] != "DATA_TOKEN_OUT_OF_RANGE") continue;
    found = true;
    CHECK(finding["severity"] == "error");
    CHECK(finding["evidence"]["shard"] == shard_path);
    CHECK(finding["evidence"]["offset"] == offset);
    CHECK(finding["evidence"]["step"] == 100);
  }
  CHECK(found);
  REQUIRE(report["steps"].size() == 4);
  CHECK(report["steps"][0]["replayed"] == false);
  CHECK(report["steps"][1]["replayed"] == true);
}

TEST_CASE("run refuses a replay that would not fit --max-memory, before loading anything",
          "[cli][bad-input][memory]") {
  ScratchDir scratch("max-memory");
  const fs::path bundle = copy_of_good(scratch, "bundle");
  // A checkpoint that cannot even be read: the refusal must come before it is opened.
  fs::resize_file(model_file(bundle, 100), 4);
  const fs::path out = scratch / "out";

  const CliResult tight = run_cli({"run", bundle.string(), "--out", out.string(), "--max-memory", "1M"});
  check_refused(tight, out, "estimated", "1.0 MiB");
  CHECK(tight.err.find("--max-memory 1M") != std::string::npos);
  CHECK(tight.err.find(kModel100) == std::string::npos);

  const CliResult syntax = run_cli({"run", bundle.string(), "--out", out.string(), "--max-memory", "12X"});
  check_refused(syntax, out, "--max-memory", "12X");

  // Room enough: the run gets as far as the broken checkpoint.
  const CliResult roomy = run_cli({"run", bundle.string(), "--out", out.string(), "--max-memory", "64GiB"});
  check_refused(roomy, out, kModel100, "byte 0");

  // A manifest claiming a model of terabytes (a vocabulary of 2^30, the largest dimension the
  // manifest allows) is refused under the machine's default limit, naming the keys that drive the estimate.
  edit_json(bundle / "manifest.json", [](json& m) { m["model"]["vocab_size"] = int64_t{1} << 30; });
  const CliResult huge = run_cli({"run", bundle.string(), "--out", out.string()});
  check_refused(huge, out, "manifest.json", "model.vocab_size");
  CHECK(huge.err.find("80% of") != std::string::npos);
}

TEST_CASE("the memory estimate of a real replay is within a sane factor of its peak RSS",
          "[cli][memory]") {
  ScratchDir scratch("rss");
  const fs::path out = scratch / "out";
  const Finished done = wait_cli(spawn_cli(scratch, {"run", good_bundle().string(), "--out", out.string()}));
  REQUIRE(done.result.status == 0);
  const nanreplay::Manifest manifest = nanreplay::parse_manifest(
      read_bytes(good_bundle() / "manifest.json"), "manifest.json");
  const double estimate = nanreplay::estimate_replay_memory(manifest, 4, true).total();
  const double measured = static_cast<double>(done.max_rss_kib) * 1024;
  INFO("estimate " << nanreplay::format_bytes(estimate) << ", measured peak RSS "
                   << nanreplay::format_bytes(measured));
  // The estimate errs high (it must refuse before the OOM killer would act),
  // but not absurdly: a tiny bundle is mostly the runtime's fixed cost.
  if (!NANREPLAY_TEST_UNDER_ASAN) {
    CHECK(estimate >= measured);
    CHECK(estimate <= 6 * measured);
  }
}

namespace {

// The good bundle stretched to `count` steps (copies of step 100's files under
// new step numbers, samples from randperm), so a replay lasts long enough to interrupt.
fs::path long_bundle(const ScratchDir& scratch, int count) {
  const fs::path bundle = copy_of_good(scratch, "long");
  edit_json(bundle / "manifest.json", [&](json& m) {
    for (int step = 104; step < 100 + count; ++step) {
      const std::string dir = "steps/" + std::to_string(step);
      fs::copy(bundle / "steps/100", bundle / dir, fs::copy_options::recursive);
      edit_json(bundle / dir / "state.json", [&](json& s) { s["step"] = step; });
      m["steps"].push_back({{"step", step}, {"dir", dir}});
    }
  });
  return bundle;
}

// Starts a replay, waits until it has opened the bundle and staged its
// output, lets it run a little, then sends `signal`.
Finished interrupt_replay(const ScratchDir& scratch, const fs::path& bundle, const fs::path& out,
                          int signal_number) {
  const Spawned child = spawn_cli(scratch, {"run", bundle.string(), "--out", out.string(), "--threads", "1"});
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  bool staged = false;
  while (!staged && std::chrono::steady_clock::now() < deadline) {
    std::error_code ec;
    if (fs::is_directory(out, ec)) {
      for (const auto& entry : fs::directory_iterator(out, ec)) {
        if (entry.path().filename().string().rfind(".nanreplay-staging-", 0) == 0) staged = true;
      }
    }
    if (!staged) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  REQUIRE(staged);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  REQUIRE(kill(child.pid, signal_number) == 0);
  return wait_cli(child);
}

}  // namespace

TEST_CASE("SIGINT and SIGTERM mid-replay stop cleanly and say how far it got",
          "[cli][signals]") {
  ScratchDir scratch("signals");
  const int steps = 60;
  const fs::path bundle = long_bundle(scratch, steps);
  for (const int signal_number : {SIGINT, SIGTERM}) {
    DYNAMIC_SECTION("signal " << signal_number) {
      const fs::path out = scratch / ("out-" + std::to_string(signal_number));
      const Finished done = interrupt_replay(scratch, bundle, out, signal_number);
      INFO("stderr: " << done.result.err);
      CHECK(done.result.status == 130);
      CHECK(line_count(done.result.err) == 1);
      std::smatch match;
      const std::regex said(R"(interrupted after (\d+) of (\d+) steps; nothing was written)");
      REQUIRE(std::regex_search(done.result.err, match, said));
      CHECK(std::stoi(match[1]) < steps);
      CHECK(std::stoi(match[2]) == steps);
      CHECK_FALSE(fs::exists(out));
    }
  }
}

TEST_CASE("a re-run that fails leaves the previous results whole", "[cli][output]") {
  ScratchDir scratch("force-atomic");
  const fs::path bundle = copy_of_good(scratch, "bundle");
  const fs::path out = scratch / "out";
  REQUIRE(run_cli({"run", bundle.string(), "--out", out.string(), "--no-probes"}).status == 0);
  const std::string report_before = read_bytes(out / "report.json");
  const std::string trace_before = read_bytes(out / "trace.h5");

  // Step 101's checkpoint breaks after step 100 has replayed into the staging area.
  fs::resize_file(model_file(bundle, 101), 12);
  const CliResult rerun = run_cli({"run", bundle.string(), "--out", out.string()});
  INFO(rerun.err);
  CHECK(rerun.status == 2);
  CHECK(line_count(rerun.err) == 1);
  CHECK(rerun.err.find(kModel101) != std::string::npos);
  CHECK(read_bytes(out / "report.json") == report_before);
  CHECK(read_bytes(out / "trace.h5") == trace_before);
  std::vector<std::string> left;
  for (const auto& entry : fs::directory_iterator(out)) left.push_back(entry.path().filename().string());
  std::sort(left.begin(), left.end());
  CHECK(left == std::vector<std::string>{"report.html", "report.json", "report.md", "trace.h5"});
}

TEST_CASE("inspect refuses absurd sizes quickly and in bounded memory as run does", "[cli][bad-input][manifest]") {
  ScratchDir scratch("absurd-sizes");
  // Under 2 GiB of address space a list of a billion experts' parameters (~200 GB) dies
  // with bad_alloc (exit 3); the dense manifest below would parse (~1.1 GB) and pass as valid.
  SpawnOptions capped;
  capped.address_space_limit = NANREPLAY_TEST_UNDER_ASAN ? 0 : rlim_t{2} << 30;
  const auto refused_in_time = [&](const fs::path& bundle, const std::string& file, const std::string& key) {
    const auto started = std::chrono::steady_clock::now();
    const Finished done = wait_cli(spawn_cli(scratch, {"inspect", bundle.string()}, capped));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    check_refused(done.result, scratch / "no-out", file, key);
    CHECK(seconds < 20);
  };

  SECTION("a billion experts: counted against the checkpoint's tensors before any list is built") {
    const fs::path bundle = copy_of_good(scratch, "experts");
    edit_json(bundle / "manifest.json", [](json& m) { m["model"]["moe"] = {{"num_experts", 1000000000}, {"top_k", 2}}; });
    refused_in_time(bundle, kModel100, "parameter tensors");
    const CliResult run = run_cli({"run", bundle.string(), "--out", (scratch / "out").string()});
    check_refused(run, scratch / "out", "estimated", "");
  }
  SECTION("max_seq_len 2^62") {
    const fs::path bundle = copy_of_good(scratch, "seq");
    edit_json(bundle / "manifest.json", [](json& m) { m["model"]["max_seq_len"] = int64_t{1} << 62; });
    refused_in_time(bundle, "manifest.json", "model.max_seq_len");
  }
  SECTION("a manifest under the size cap whose DOM would take gigabytes") {
    const fs::path bundle = copy_of_good(scratch, "dense");
    std::string text = read_bytes(bundle / "manifest.json");
    std::string pad = "\"pad\": [{}";
    pad.reserve(40u << 20);
    while (pad.size() < (40u << 20)) pad += ",{}";
    text.insert(1, pad + "],\n");
    write_bytes(bundle / "manifest.json", text);
    refused_in_time(bundle, "manifest.json", "parsed form fits 384 MiB");
  }
}

TEST_CASE("a --steps selection that names no step of the bundle is exit 2 naming the steps it has",
          "[cli][bad-input][steps]") {
  ScratchDir scratch("steps-outside");
  const fs::path out = scratch / "out";
  const CliResult outside = run_cli({"run", good_bundle().string(), "--out", out.string(), "--steps", "3,7-9"});
  check_refused(outside, out, "--steps 3, 7-9", "has step(s) 100-103");
  // One step inside the bundle is enough to replay.
  const CliResult inside = run_cli({"run", good_bundle().string(), "--out", out.string(), "--steps", "3,103", "--quiet"});
  INFO(inside.err);
  CHECK(inside.status == 0);
  CHECK(read_json(out / "report.json")["steps"].size() == 1);
}
