// Tests for replay/step/memory_estimate.cpp: the estimate grows with every
// dimension that grows the replay, counts exactly the parameters the
// checkpoint loader expects, survives absurd manifests, and the size parser
// and the refusal say what they mean. (The CLI refusal and a comparison with
// measured peak RSS are in test_cli_bad_bundles.cpp.)
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cmath>
#include <functional>
#include <string>

#include "loaders/base/error.h"
#include "loaders/bundle/manifest.h"
#include "probes/sites.h"
#include "replay/step/memory_estimate.h"

namespace {

using nanreplay::Arch;
using nanreplay::Compute;
using nanreplay::Manifest;
using nanreplay::estimate_replay_memory;

// The bundle spec's example model and data (llama, 4 layers, hidden 128).
Manifest estimate_manifest() {
  Manifest m;
  m.model.arch = Arch::kLlama;
  m.model.vocab_size = 512;
  m.model.hidden_size = 128;
  m.model.num_layers = 4;
  m.model.num_heads = 4;
  m.model.num_kv_heads = 4;
  m.model.intermediate_size = 344;
  m.model.max_seq_len = 128;
  m.data.seq_len = 64;
  m.data.micro_batch_size = 4;
  m.data.grad_accum_steps = 2;
  m.data.world_size = 1;
  return m;
}

double total(const Manifest& m, size_t steps = 6, bool probes = true) {
  return estimate_replay_memory(m, steps, probes).total();
}

double parameter_elements(const nanreplay::ModelConfig& model) {
  double count = 0;
  for (const nanreplay::ParamSpec& spec : nanreplay::expected_parameters(model)) {
    double elements = 1;
    for (int64_t dim : spec.shape) elements *= static_cast<double>(dim);
    count += elements;
  }
  return count;
}

}  // namespace

TEST_CASE("memory_estimate: grows with every dimension of the replay", "[replay][memory]") {
  const Manifest base = estimate_manifest();
  const double before = total(base);
  const std::vector<std::pair<std::string, std::function<void(Manifest&)>>> growths = {
      {"seq_len", [](Manifest& m) { m.data.seq_len *= 2; }},
      {"micro_batch_size", [](Manifest& m) { m.data.micro_batch_size *= 2; }},
      {"num_layers", [](Manifest& m) { m.model.num_layers *= 2; }},
      {"hidden_size", [](Manifest& m) { m.model.hidden_size *= 2; }},
      {"num_heads", [](Manifest& m) { m.model.num_heads *= 2; m.model.num_kv_heads *= 2; }},
      {"vocab_size", [](Manifest& m) { m.model.vocab_size *= 2; }},
      {"intermediate_size", [](Manifest& m) { m.model.intermediate_size *= 2; }},
      {"untied head", [](Manifest& m) { m.model.tie_embeddings = false; }},
      {"grad_accum_steps (probe records)", [](Manifest& m) { m.data.grad_accum_steps *= 2; }},
      {"world_size (probe records)", [](Manifest& m) { m.data.world_size *= 2; }},
      {"bf16 rounding copies", [](Manifest& m) { m.precision.compute = Compute::kBf16; }},
      {"fp16 rounding copies", [](Manifest& m) { m.precision.compute = Compute::kFp16; }},
  };
  for (const auto& [name, grow] : growths) {
    Manifest bigger = base;
    bigger.model.tie_embeddings = true;  // so "untied head" has something to add
    const double tied = total(bigger);
    grow(bigger);
    INFO(name);
    CHECK(total(bigger) > tied);
  }
  CHECK(total(base, 12) > before);          // more steps, more probe records
  CHECK(total(base, 6, false) < before);    // no probes, no records
  CHECK(estimate_replay_memory(base, 6, false).probes == 0);
}

TEST_CASE("memory_estimate: activations grow with the square of seq_len", "[replay][memory]") {
  Manifest m = estimate_manifest();
  m.model.max_seq_len = 8192;
  m.data.seq_len = 2048;
  const double at_2k = estimate_replay_memory(m, 1, false).activations;
  m.data.seq_len = 4096;
  const double at_4k = estimate_replay_memory(m, 1, false).activations;
  // Dominated by the B*H*T*T scores: doubling T nearly quadruples them.
  CHECK(at_4k / at_2k > 3.5);
  CHECK(at_4k / at_2k <= 4.0);
}

// docs/performance.md: each model.mtp depth's block counts as one more layer
// of its kind, and around it the depth's own tensors.
TEST_CASE("memory_estimate: each MTP depth adds a block of its kind and its own tensors", "[replay][memory][mtp]") {
  auto activations = [](const Manifest& m) { return estimate_replay_memory(m, 1, false).activations; };
  for (const bool experts : {false, true}) {
    INFO((experts ? "MTP block with experts" : "dense MTP block"));
    Manifest m = estimate_manifest();
    // Experts in decoder layer 0; the MTP block (layer 4) too only when moe.layers lists it.
    Manifest kind_of_block = m;  // a model whose every layer is of the MTP block's kind
    if (experts) {
      m.model.moe = nanreplay::MoeConfig{};
      m.model.moe->num_experts = 8;
      m.model.moe->top_k = 2;
      m.model.moe->intermediate_size = 64;
      m.model.moe->layers = {0, 4};
      kind_of_block = m;
    } else {
      m.model.moe = nanreplay::MoeConfig{};
      m.model.moe->num_experts = 8;
      m.model.moe->top_k = 2;
      m.model.moe->intermediate_size = 64;
      m.model.moe->layers = {0};
    }
    Manifest one_more = kind_of_block;
    one_more.model.num_layers += 1;
    const double block = activations(one_more) - activations(kind_of_block);
    const double N = static_cast<double>(m.data.micro_batch_size * m.data.seq_len);
    const double C = static_cast<double>(m.model.hidden_size), V = static_cast<double>(m.model.vocab_size);
    // embedding, enorm and hnorm (3 each: x^2, x/rms, * weight), the 2C concatenation, eh_proj,
    // shared_head.norm, the fp32 logits and the loss's log-softmax.
    const double own = (N * C + 2 * 3 * N * C + 2 * N * C + N * C + 3 * N * C + 2 * N * V) * 4;
    const double without = activations(m);
    for (const int64_t depths : {1, 2}) {
      INFO(depths << " depth(s)");
      Manifest with = m;
      with.model.mtp = nanreplay::MultiTokenPrediction{depths, 0.3};
      if (experts && depths == 2) with.model.moe->layers.push_back(5);
      CHECK(activations(with) - without == Approx(static_cast<double>(depths) * (block + own)));
    }
  }
}

TEST_CASE("memory_estimate: counts exactly the parameters the checkpoint must hold",
          "[replay][memory]") {
  for (const Arch arch : {Arch::kLlama, Arch::kGpt2}) {
    for (const bool tied : {false, true}) {
      Manifest m = estimate_manifest();
      m.model.arch = arch;
      m.model.tie_embeddings = tied || arch == Arch::kGpt2;
      m.model.num_kv_heads = arch == Arch::kLlama ? 2 : 4;
      if (arch == Arch::kGpt2) m.model.intermediate_size = 4 * m.model.hidden_size;
      const double elements = parameter_elements(m.model);
      INFO(nanreplay::arch_name(arch) << (tied ? " tied" : " untied"));
      // fp32: masters + mapping (2 x 4 bytes); gradients 3 x 4 bytes.
      CHECK(estimate_replay_memory(m, 1, false).parameters == Approx(elements * 8));
      CHECK(estimate_replay_memory(m, 1, false).gradients == Approx(elements * 12));
    }
  }
}

TEST_CASE("memory_estimate: counts model.mtp's parameters as the checkpoint holds them", "[replay][memory][mtp]") {
  for (const bool experts : {false, true}) {
    for (const int64_t depths : {1, 2}) {
      Manifest m = estimate_manifest();
      m.model.mtp = nanreplay::MultiTokenPrediction{depths, 0.3};
      if (experts) {
        m.model.moe = nanreplay::MoeConfig{};
        m.model.moe->num_experts = 8;
        m.model.moe->top_k = 2;
        m.model.moe->intermediate_size = 64;
        m.model.moe->shared_expert_intermediate_size = 32;
        m.model.moe->layers = {1, 4};  // one decoder layer and the first MTP block
      }
      INFO((experts ? "experts" : "dense") << ", " << depths << " depth(s)");
      const double elements = parameter_elements(m.model);
      CHECK(estimate_replay_memory(m, 1, false).parameters == Approx(elements * 8));
      CHECK(nanreplay::count_model_parameters(m.model).elements == Approx(elements));
      CHECK(nanreplay::count_model_parameters(m.model).tensors ==
            static_cast<double>(nanreplay::expected_parameters(m.model).size()));
    }
  }
}

TEST_CASE("memory_estimate: absurd manifests give a refusable number, not a crash",
          "[replay][memory]") {
  Manifest m = estimate_manifest();
  m.model.vocab_size = int64_t{1} << 62;
  m.model.hidden_size = int64_t{1} << 40;
  m.model.num_heads = 1;
  m.model.num_kv_heads = 1;
  m.model.num_layers = int64_t{1} << 31;
  m.model.max_seq_len = int64_t{1} << 40;
  m.data.seq_len = int64_t{1} << 40;
  const double bytes = total(m, 1000000);
  CHECK(bytes > 1e30);
  CHECK_THROWS_AS(nanreplay::choose_layer_streaming(estimate_replay_memory(m, 1, true),
                                                    nanreplay::estimate_streamed_memory(m, 1, true),
                                                    {uint64_t{1} << 62, "test"}, false),
                  nanreplay::UsageError);
  CHECK(nanreplay::format_bytes(bytes).find("bytes") != std::string::npos);
  CHECK(nanreplay::format_bytes(INFINITY) == "more than can be counted");
}

TEST_CASE("memory_estimate: sizes parse as powers of 1024", "[replay][memory]") {
  using nanreplay::parse_memory_size;
  CHECK(parse_memory_size("4096") == 4096);
  CHECK(parse_memory_size("4096B") == 4096);
  CHECK(parse_memory_size("1k") == 1024);
  CHECK(parse_memory_size("512M") == uint64_t{512} << 20);
  CHECK(parse_memory_size("512MB") == uint64_t{512} << 20);
  CHECK(parse_memory_size("8G") == uint64_t{8} << 30);
  CHECK(parse_memory_size("8g") == uint64_t{8} << 30);
  CHECK(parse_memory_size("1.5GiB") == uint64_t{3} << 29);
  CHECK(parse_memory_size("2 TiB") == uint64_t{2} << 40);
  for (const char* bad : {"", "G", "-1", "1.2.3", "12X", "0", "0.1", "1e9", "8 GB extra", "."}) {
    INFO(bad);
    CHECK_THROWS_AS(parse_memory_size(bad), nanreplay::UsageError);
  }
}

TEST_CASE("memory_estimate: bytes print in binary units", "[replay][memory]") {
  using nanreplay::format_bytes;
  CHECK(format_bytes(800) == "800 bytes");
  CHECK(format_bytes(1536) == "1.5 KiB");
  CHECK(format_bytes(double(uint64_t{512} << 20)) == "512.0 MiB");
  CHECK(format_bytes(1.5 * double(uint64_t{1} << 30)) == "1.5 GiB");
}

TEST_CASE("memory_estimate: the default limit is a fraction of this machine's memory",
          "[replay][memory]") {
  const nanreplay::MemoryLimit limit = nanreplay::default_memory_limit();
  const double physical = static_cast<double>(sysconf(_SC_PHYS_PAGES)) *
                          static_cast<double>(sysconf(_SC_PAGESIZE));
  CHECK(limit.bytes > 0);
  CHECK(static_cast<double>(limit.bytes) <= 0.8 * physical + 1);
  CHECK(limit.source.find("80% of") != std::string::npos);
}

namespace {

// A 7B-like llama: parameters dominate.
Manifest llama_7b_like() {
  Manifest big = estimate_manifest();
  big.model.vocab_size = 32000;
  big.model.hidden_size = 4096;
  big.model.num_heads = 32;
  big.model.num_kv_heads = 32;
  big.model.num_layers = 32;
  big.model.intermediate_size = 11008;
  return big;
}

bool streams(const Manifest& m, uint64_t limit, bool asked) {
  return nanreplay::choose_layer_streaming(estimate_replay_memory(m, 6, true),
                                           nanreplay::estimate_streamed_memory(m, 6, true), {limit, "test"}, asked);
}

}  // namespace

TEST_CASE("memory_estimate: the refusal gives both estimates, the limit and the cause",
          "[replay][memory]") {
  const Manifest big = llama_7b_like();
  const nanreplay::MemoryEstimate estimate = estimate_replay_memory(big, 6, true);
  const nanreplay::MemoryEstimate streamed = nanreplay::estimate_streamed_memory(big, 6, true);
  CHECK_FALSE(streams(big, uint64_t{1} << 40, false));
  try {
    streams(big, uint64_t{1} << 20, false);
    FAIL("expected a refusal");
  } catch (const nanreplay::UsageError& error) {
    const std::string message = error.what();
    CHECK(message.find(nanreplay::format_bytes(estimate.total()) + " in memory (") != std::string::npos);
    CHECK(message.find(nanreplay::format_bytes(streamed.total()) + " streamed layer by layer") != std::string::npos);
    CHECK(message.find("1.0 MiB (test); neither fits") != std::string::npos);
    CHECK(message.find("most of it is parameters and gradients") != std::string::npos);
    CHECK(message.find("model.vocab_size") != std::string::npos);
    CHECK(message.find('\n') == std::string::npos);
  }
  // A tiny model is mostly LibTorch's fixed cost, and the message says so.
  try {
    nanreplay::choose_layer_streaming(estimate_replay_memory(estimate_manifest(), 1, false),
                                      nanreplay::estimate_streamed_memory(estimate_manifest(), 1, false),
                                      {uint64_t{1} << 20, "--max-memory 1M"}, false);
    FAIL("expected a refusal");
  } catch (const nanreplay::UsageError& error) {
    CHECK(std::string(error.what()).find("runtime's fixed cost") != std::string::npos);
  }
}

TEST_CASE("memory_estimate: a model larger than the limit streams, and --stream says when it need not",
          "[replay][memory]") {
  const Manifest big = llama_7b_like();
  const double in_memory = estimate_replay_memory(big, 6, true).total();
  const double streamed = nanreplay::estimate_streamed_memory(big, 6, true).total();
  INFO("in memory " << nanreplay::format_bytes(in_memory) << ", streamed " << nanreplay::format_bytes(streamed));
  // 7B: over 100 GiB in memory (masters, gradients), a few GiB streamed: this machine's 24 GiB holds it.
  CHECK(in_memory > 100.0 * (uint64_t{1} << 30));
  CHECK(streamed < 8.0 * (uint64_t{1} << 30));
  const uint64_t machine = uint64_t{19} << 30;
  CHECK(streams(big, machine, false));
  CHECK(streams(big, machine, true));
  CHECK(streams(estimate_manifest(), machine, true));  // asked for, and it fits
  try {
    streams(estimate_manifest(), static_cast<uint64_t>(
                                    nanreplay::estimate_streamed_memory(estimate_manifest(), 6, true).total() - 1), true);
    FAIL("expected a refusal");
  } catch (const nanreplay::UsageError& error) {
    // Asked for and not fitting: refused with the streamed breakdown.
    const std::string message = error.what();
    CHECK(message.find("streamed layer by layer (") != std::string::npos);
  }
}

TEST_CASE("memory_estimate: streamed, memory hardly grows with the number of layers", "[replay][memory]") {
  Manifest m = llama_7b_like();
  m.model.num_layers = 4;
  const double streamed_4 = nanreplay::estimate_streamed_memory(m, 1, false).total();
  const double in_memory_4 = estimate_replay_memory(m, 1, false).total();
  m.model.num_layers = 64;
  const double streamed_64 = nanreplay::estimate_streamed_memory(m, 1, false).total();
  const double in_memory_64 = estimate_replay_memory(m, 1, false).total();
  CHECK(streamed_64 / streamed_4 < 1.3);
  CHECK(in_memory_64 / in_memory_4 > 5);
}

// The count refuses a checkpoint with fewer tensors than it says the model
// has (replay/step/bundle_structure.cpp): it must never count more than the list holds.
TEST_CASE("count_model_parameters counts no more tensors than expected_parameters lists", "[replay][memory]") {
  std::vector<std::pair<std::string, nanreplay::ModelConfig>> models;
  models.push_back({"llama", estimate_manifest().model});
  nanreplay::ModelConfig untied = estimate_manifest().model;
  untied.tie_embeddings = false;
  models.push_back({"llama untied", untied});
  nanreplay::ModelConfig moe = estimate_manifest().model;
  moe.moe = nanreplay::MoeConfig{};
  moe.moe->num_experts = 8;
  moe.moe->top_k = 2;
  moe.moe->intermediate_size = 64;
  models.push_back({"llama moe", moe});
  nanreplay::ModelConfig extras = estimate_manifest().model;
  extras.attention_bias = true;
  extras.qk_norm = nanreplay::QkNorm::kHead;
  models.push_back({"llama with biases and qk-norm", extras});
  nanreplay::ModelConfig gpt2 = estimate_manifest().model;
  gpt2.arch = Arch::kGpt2;
  gpt2.intermediate_size = 4 * gpt2.hidden_size;
  gpt2.tie_embeddings = true;
  models.push_back({"gpt2", gpt2});
  for (const auto& [name, model] : models) {
    INFO(name);
    const double listed = static_cast<double>(nanreplay::expected_parameters(model).size());
    const nanreplay::ParameterCount counted = nanreplay::count_model_parameters(model);
    CHECK(counted.tensors <= listed);
    // Only the optional biases and QK-norm weights go uncounted.
    if (!model.attention_bias && model.qk_norm == nanreplay::QkNorm::kNone) CHECK(counted.tensors == listed);
  }
  nanreplay::ModelConfig billion = moe;
  billion.moe->num_experts = 1000000000;
  CHECK(nanreplay::count_model_parameters(billion).tensors == Approx(2 + (6 + 1 + 3e9) * 4));
}
