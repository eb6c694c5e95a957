// The replay's peak memory from the manifest's shapes, counted the way the
// replay holds tensors (replay/step/gradients.cpp, replay/arch/model.cpp, numerics.cpp),
// and the machine's default limit. Key constraint: the estimate errs high
// (every tensor the forward creates is counted as kept until backward), all
// arithmetic is in double so absurd manifests cannot overflow, and nothing
// here allocates in proportion to the bundle.
#include "replay/step/memory_estimate.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>
#include <sstream>

#include "loaders/base/error.h"
#include "probes/param_table.h"
#include "probes/probe_record.h"
#include "probes/sites.h"

namespace nanreplay {
namespace {

constexpr double kFloatBytes = 4;  // the replay computes in fp32 masters
constexpr double kLowBytes = 2;    // bf16/fp16 copies made by rounding
constexpr double kDefaultFraction = 0.8;
// Resident size of the process before any tensor exists: LibTorch's and
// OpenBLAS's code and thread arenas (measured ~0.3 GiB on Debian 12's
// libtorch 1.13), with headroom for allocator fragmentation.
constexpr double kRuntimeBytes = 512.0 * (1 << 20);
// A probe record's heap beyond sizeof: its site name and shape vectors
// (allocator overhead included), and the trace writer's columns for it.
constexpr double kProbeRecordHeapBytes = 160;

bool reduced_precision(const Manifest& m) {
  return m.precision.compute == Compute::kBf16 || m.precision.compute == Compute::kFp16;
}

struct Dims {
  double B, T, C, H, G, D, F, V, L, maxT;
};

Dims dims_of(const Manifest& m, const ModelConfig& c) {
  return Dims{static_cast<double>(m.data.micro_batch_size), static_cast<double>(m.data.seq_len),
              static_cast<double>(c.hidden_size),         static_cast<double>(c.num_heads),
              static_cast<double>(c.num_kv_heads),        static_cast<double>(c.head_dim()),
              static_cast<double>(c.intermediate_size),   static_cast<double>(c.vocab_size),
              static_cast<double>(c.num_layers),          static_cast<double>(c.max_seq_len)};
}

Dims dims_of(const Manifest& m) { return dims_of(m, m.model); }

// Parameter elements and tensors, as probes/sites.cpp's expected_parameters
// lists them (recomputed here so no per-layer list is built for a manifest
// that claims a billion layers).
struct ParamCount {
  double elements;
  double tensors;
};

// A mixture of experts' parameters in a layer: the router, every expert and the shared one.
ParamCount moe_parameters(const MoeConfig& moe, const Dims& d) {
  const double E = static_cast<double>(moe.num_experts);
  const double S = static_cast<double>(moe.shared_expert_intermediate_size);
  return {E * d.C + E * 3 * static_cast<double>(moe.intermediate_size) * d.C + 3 * S * d.C, 1 + 3 * E + (S > 0 ? 3 : 0)};
}

// The MLP's parameters averaged over the layers: model.moe.layers leaves some layers dense.
ParamCount mlp_parameters(const ModelConfig& model, const Dims& d) {
  const ParamCount dense{3 * d.F * d.C, 3};
  if (!model.moe) return dense;
  const ParamCount experts = moe_parameters(*model.moe, d);
  if (model.moe->layers.empty()) return experts;
  double with_experts = 0;
  for (const int layer : model.moe->layers) with_experts += layer < model.num_layers ? 1 : 0;
  // The model's share, not d.L's: the streamed estimate counts zero layers and one.
  const double share = model.num_layers > 0 ? with_experts / static_cast<double>(model.num_layers) : 0.0;
  return {share * experts.elements + (1 - share) * dense.elements, share * experts.tensors + (1 - share) * dense.tensors};
}

// Latent attention's projections, latent norms and o_proj in a layer (model.latent_attention).
ParamCount latent_attention_parameters(const LatentAttention& a, const Dims& d) {
  const double Q = static_cast<double>(a.q_lora_rank), L = static_cast<double>(a.kv_lora_rank);
  const double N = static_cast<double>(a.qk_nope_head_dim), R = static_cast<double>(a.qk_rope_head_dim);
  const double Dv = static_cast<double>(a.v_head_dim);
  const double q = Q > 0 ? Q * d.C + Q + d.H * (N + R) * Q : d.H * (N + R) * d.C;
  return {q + (L + R) * d.C + L + d.H * (N + Dv) * L + d.C * d.H * Dv, Q > 0 ? 7.0 : 5.0};
}

// One llama block's attention and its two norms, the MLP apart: latent or grouped-query.
ParamCount llama_attention_parameters(const ModelConfig& model, const Dims& d) {
  if (model.latent_attention) {
    const ParamCount attn = latent_attention_parameters(*model.latent_attention, d);
    return {2 * d.C + attn.elements, 2 + attn.tensors};
  }
  return {2 * d.C + 2 * d.H * d.D * d.C + 2 * d.G * d.D * d.C, 6};  // q and o: heads x head_dim
}

// model.mtp's depths: each a block of its own kind (model.moe.layers decides)
// and enorm, hnorm, eh_proj (hidden x 2 hidden) and shared_head.norm; the
// embedding and the output head are the model's own.
ParamCount mtp_parameters(const ModelConfig& model, const Dims& d) {
  ParamCount total{0, 0};
  const ParamCount attn = llama_attention_parameters(model, d);
  for (int depth = 1; model.mtp && depth <= model.mtp->num_layers; ++depth) {
    const bool experts = model.moe && model.moe_layer(mtp_block_layer(model, depth));
    const ParamCount mlp = experts ? moe_parameters(*model.moe, d) : ParamCount{3 * d.F * d.C, 3};
    total.elements += attn.elements + mlp.elements + 2 * d.C * d.C + 3 * d.C;
    total.tensors += attn.tensors + mlp.tensors + 4;
  }
  return total;
}

ParamCount count_parameters(const ModelConfig& model, const Dims& d) {
  if (model.arch == Arch::kLlama) {
    const ParamCount attn = llama_attention_parameters(model, d);
    const ParamCount mlp = mlp_parameters(model, d);
    const ParamCount mtp = mtp_parameters(model, d);
    const bool head = !model.tie_embeddings;
    return {d.V * d.C + d.L * (attn.elements + mlp.elements) + d.C + (head ? d.V * d.C : 0) + mtp.elements,
            2 + (attn.tensors + mlp.tensors) * d.L + (head ? 1 : 0) + mtp.tensors};
  }
  const double per_layer = 4 * d.C + (3 * d.C * d.C + 3 * d.C) + (d.C * d.C + d.C) +
                           (d.F * d.C + d.F) + (d.F * d.C + d.C);
  return {d.V * d.C + d.maxT * d.C + d.L * per_layer + 2 * d.C, 4 + 12 * d.L};
}

// Elements of one micro-batch's forward, per layer, counting every tensor the
// forward creates as kept until the backward frees it (an upper bound on what
// autograd saves), split into token-shaped and attention-square tensors.
struct LayerElements {
  double tokens;   // [B, T, *]
  double squares;  // [B, H, T, T]: scores, scaled scores, masked scores, probs
  double rounded;  // extra elements rounded to bf16/fp16 and back (reduced precision only)
};

// `experts`: the layer holds the mixture of experts (else the dense MLP).
LayerElements layer_elements(const Manifest& m, const Dims& d, bool experts) {
  const double N = d.B * d.T;
  const double HD = d.H * d.D;
  const double GD = d.G * d.D;
  const double square = d.B * d.H * d.T * d.T;
  LayerElements e{};
  const double norms = m.model.arch == Arch::kLlama ? 2 * 3 * N * d.C   // x^2, x/rms, * weight
                                                    : 2 * 2 * N * d.C;  // layer_norm output + stats
  const double qkv = m.model.arch == Arch::kLlama
                         ? 6 * N * HD + 6 * N * GD + N * GD  // projections, rotary (x cos, cat, x sin, sum, copy)
                         : 3 * N * d.C;                      // c_attn output, split as views
  const double repeated = d.G < d.H ? 2 * N * HD : 0;        // grouped-query repeat_interleave of k and v
  const double context = 2 * N * HD + 2 * N * HD;            // contiguous q/k for matmul, probs @ v, reshape copy
  const double attn_out = 2 * N * d.C;                       // projection, residual
  double mlp = (m.model.arch == Arch::kLlama ? 4 : 2) * N * d.F + 2 * N * d.C;
  if (experts) {  // routed rows: gathered inputs, gate, up, silu, act, down, weighted; router and combine
    const double K = N * static_cast<double>(m.model.moe->top_k);
    const double Fe = static_cast<double>(m.model.moe->intermediate_size);
    mlp = K * d.C + 4 * K * Fe + 2 * K * d.C + 4 * N * static_cast<double>(m.model.moe->num_experts) + 2 * N * d.C;
  }
  e.tokens = norms + qkv + repeated + context + attn_out + mlp;
  e.squares = 4 * square;
  if (reduced_precision(m)) {
    // Every site is rounded (15 per layer), every linear input is rounded,
    // and the scores twice more: fp32 copies of the rounded values.
    const double site_tokens = 6 * N * d.C + N * HD + 2 * N * GD + N * HD + 3 * N * d.F;
    const double linear_inputs = 5 * N * d.C + N * HD + N * d.F;
    e.rounded = site_tokens + linear_inputs + 4 * square;
  }
  return e;
}

// One layer's activations in bytes: its elements in fp32, plus each rounding's
// fp32 copy and the transient low-precision tensor it makes.
double layer_bytes(const LayerElements& layer) {
  return (layer.tokens + layer.squares) * kFloatBytes + layer.rounded * (kFloatBytes + kLowBytes);
}

// model.mtp: each depth's activations, the decoder's counted apart. Around its
// block (one layer of its kind: experts when moe.layers lists it): the rolled
// ids' embedding, enorm's and hnorm's outputs with their norm temporaries, the
// concatenation (2C wide), eh_proj's output, shared_head.norm's, and the
// depth's logits in fp32 with the loss's log-softmax.
double mtp_activation_bytes(const Manifest& m, const Dims& d) {
  if (!m.model.mtp) return 0;
  const double N = d.B * d.T;
  const double norm = 3 * N * d.C;  // x^2, x/rms, * weight, as layer_elements counts a norm
  const double around = N * d.C + 2 * norm + 2 * N * d.C + N * d.C + norm + 2 * N * d.V;
  // In bf16/fp16: the sites (embed, the three norms, eh_proj, logits), eh_proj's and the head's inputs rounded.
  const double rounded = reduced_precision(m) ? 5 * N * d.C + N * d.V + 3 * N * d.C : 0.0;
  double bytes = 0;
  for (int64_t depth = 1; depth <= m.model.mtp->num_layers; ++depth) {
    const bool experts = m.model.moe_layer(mtp_block_layer(m.model, static_cast<int>(depth)));
    bytes += layer_bytes(layer_elements(m, d, experts)) + around * kFloatBytes +
             rounded * (kFloatBytes + kLowBytes);
  }
  return bytes;
}

double activation_bytes(const Manifest& m, const Dims& d) {
  const double N = d.B * d.T;
  const LayerElements layer = layer_elements(m, d, m.model.moe.has_value());
  const bool reduced = reduced_precision(m);
  const double per_layer = layer_bytes(layer);
  // Outside the layers: embedding, final norm, logits, log-softmax of the loss.
  double outside = (N * d.C + 3 * N * d.C + 2 * N * d.V) * kFloatBytes;
  if (reduced) outside += (2 * N * d.V + 2 * N * d.C) * (kFloatBytes + kLowBytes);
  // Backward frees the forward's tensors as it goes but briefly holds one
  // layer's worth of gradients and the logits' gradient on top.
  const double backward_working_set = per_layer + 2 * N * d.V * kFloatBytes;
  return d.L * per_layer + outside + backward_working_set + mtp_activation_bytes(m, d);
}

double probe_record_bytes(const Manifest& m, const Dims& d, double param_tensors,
                          size_t steps_replayed) {
  double in_layer = 0;
  double outside = 0;
  double per_head = 0;
  double per_expert = 0;
  double mtp_only = 0;  // model.mtp: a depth's sites around its block
  for (const SiteDef& site : site_table()) {
    if (!site_present(site, m.model)) continue;
    if (site.mtp_only) {
      mtp_only += 1;
      continue;
    }
    (site.in_layer ? in_layer : outside) += 1;
    if (site.in_layer && is_per_head(site.id)) per_head += 1;
    if (is_per_expert(site.id)) per_expert += 1;
  }
  const double experts = m.model.moe ? static_cast<double>(m.model.moe->num_experts) : 0;
  // One record per site and one more per head (expert) of a per-head (per-expert) site, forward and backward.
  // Each MTP depth's block has a layer's sites, plus its own.
  const double blocks = d.L + (m.model.mtp ? static_cast<double>(m.model.mtp->num_layers) : 0.0);
  const double depth_sites = m.model.mtp ? static_cast<double>(m.model.mtp->num_layers) * mtp_only : 0.0;
  const double per_pass = 2 * (outside + depth_sites + blocks * (in_layer + per_head * d.H + per_expert * experts));
  const double passes = static_cast<double>(m.data.world_size) *
                        static_cast<double>(m.data.grad_accum_steps);
  const double per_step = per_pass * passes + param_tensors;
  return per_step * static_cast<double>(steps_replayed) *
         (static_cast<double>(sizeof(ProbeRecord)) + kProbeRecordHeapBytes);
}

// ---- the machine ------------------------------------------------------------

std::optional<double> meminfo_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kib = 0;
  std::string unit;
  while (in >> key >> kib) {
    std::getline(in, unit);
    if (key == "MemAvailable:") return kib * 1024;
  }
  return std::nullopt;
}

// cgroup v2 memory.max, or v1 memory.limit_in_bytes; "max" or absurd values mean none.
std::optional<double> cgroup_limit_bytes() {
  for (const char* path : {"/sys/fs/cgroup/memory.max",
                           "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(path);
    std::string text;
    if (!(in >> text) || text == "max") continue;
    char* end = nullptr;
    const double value = std::strtod(text.c_str(), &end);
    if (end == text.c_str() || value <= 0 || value >= 0x1p62) continue;  // v1 says "no limit" with ~2^63
    return value;
  }
  return std::nullopt;
}

double physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return 0;
  return static_cast<double>(pages) * static_cast<double>(page_size);
}

std::string lower(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return text;
}

}  // namespace

ParameterCount count_model_parameters(const ModelConfig& model) {
  const Manifest none;  // no batch: only the model's dimensions are read
  const ParamCount count = count_parameters(model, dims_of(none, model));
  return {count.tensors, count.elements};
}

MemoryEstimate estimate_replay_memory(const Manifest& manifest, size_t steps_with_probes, bool probes,
                                      bool rolls_forward) {
  const Dims d = dims_of(manifest);
  const ParamCount params = count_parameters(manifest.model, d);
  const bool reduced = reduced_precision(manifest);
  MemoryEstimate estimate;
  // fp32 masters, plus the mapped file (at most fp32 per element), plus in
  // bf16/fp16 the rounded fp32 copy of every weight a linear keeps for backward.
  estimate.parameters = params.elements * kFloatBytes * (reduced ? 3 : 2);
  // param.grad, the rank's unscaled copy and the cross-rank sum (gradients.cpp).
  estimate.gradients = params.elements * kFloatBytes * 3;
  estimate.activations = activation_bytes(manifest, d);
  estimate.probes = probes ? probe_record_bytes(manifest, d, params.tensors, steps_with_probes) : 0;
  estimate.rolling = rolls_forward ? params.elements * kFloatBytes * 4 : 0;
  estimate.runtime = kRuntimeBytes;
  return estimate;
}

MemoryEstimate estimate_streamed_memory(const Manifest& manifest, size_t steps_with_probes, bool probes,
                                        bool rolls_forward) {
  const Dims d = dims_of(manifest);
  const ParamCount params = count_parameters(manifest.model, d);
  const bool reduced = reduced_precision(manifest);
  Dims one_layer = d;
  one_layer.L = 1;
  Dims no_layers = d;
  no_layers.L = 0;
  // Embeddings, final norm, head, and model.mtp's blocks, which the streamed replay loads with the head.
  const double outer = count_parameters(manifest.model, no_layers).elements;
  const double block = count_parameters(manifest.model, one_layer).elements - outer;
  const double N = d.B * d.T;
  MemoryEstimate estimate;
  // As in memory (masters, the mapping, rounded copies), for the outer
  // tensors and one block. A block with experts loads only those its router
  // sent a token to (layer_stream.h), at most tokens * top_k of them, which
  // a real batch reaches: every expert is counted, an upper bound.
  estimate.parameters = (outer + block) * kFloatBytes * (reduced ? 3 : 2);
  // The outer tensors' .grad and one block's; accumulating reads a block's
  // earlier sum back and writes the new one (two more copies of a block).
  estimate.gradients = (outer + 3 * block) * kFloatBytes;
  // One block's activations (activation_bytes of a one-layer model), plus the
  // residual stream entering each block.
  estimate.activations = activation_bytes(manifest, one_layer) + (d.L + 1) * N * d.C * kFloatBytes;
  estimate.probes = probes ? probe_record_bytes(manifest, d, params.tensors, steps_with_probes) : 0;
  // Rolling forward on scratch files: one parameter, its gradient and its two
  // moments at a time; the largest is the embedding (or a block's widest).
  const double largest = std::max({d.V * d.C, d.F * d.C, 3 * d.C * d.C});
  estimate.rolling = rolls_forward ? 4 * largest * kFloatBytes : 0;
  estimate.runtime = kRuntimeBytes;
  return estimate;
}

MemoryLimit default_memory_limit() {
  std::optional<double> available = meminfo_available_bytes();
  std::string source = "MemAvailable";
  if (const std::optional<double> cgroup = cgroup_limit_bytes();
      cgroup && (!available || *cgroup < *available)) {
    available = cgroup;
    source = "the cgroup's memory limit";
  }
  if (!available) {
    available = physical_memory_bytes();
    source = "physical memory";
  }
  MemoryLimit limit;
  limit.bytes = static_cast<uint64_t>(std::max(0.0, *available * kDefaultFraction));
  limit.source = "the default, 80% of " + source;
  return limit;
}

uint64_t parse_memory_size(const std::string& text) {
  const std::string bad = "--max-memory: '" + text +
                          "' is not a size like 8G, 512M, 1.5GiB or 1073741824 (bytes)";
  size_t digits_end = 0;
  while (digits_end < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[digits_end])) || text[digits_end] == '.')) {
    ++digits_end;
  }
  const std::string number = text.substr(0, digits_end);
  if (number.empty() || number == "." || std::count(number.begin(), number.end(), '.') > 1) {
    throw UsageError(bad);
  }
  std::string unit = lower(text.substr(digits_end));
  unit.erase(std::remove(unit.begin(), unit.end(), ' '), unit.end());
  static const std::pair<const char*, int> kUnits[] = {
      {"", 0},   {"b", 0},   {"k", 1},   {"kb", 1},  {"kib", 1}, {"m", 2},  {"mb", 2},
      {"mib", 2}, {"g", 3},  {"gb", 3},  {"gib", 3}, {"t", 4},   {"tb", 4}, {"tib", 4}};
  const auto* found = std::find_if(std::begin(kUnits), std::end(kUnits),
                                   [&](const auto& entry) { return unit == entry.first; });
  if (found == std::end(kUnits)) throw UsageError(bad);
  const double bytes = std::strtod(number.c_str(), nullptr) * std::pow(1024.0, found->second);
  if (!(bytes >= 1) || bytes >= 0x1p63) throw UsageError(bad);
  return static_cast<uint64_t>(bytes);
}

std::string format_bytes(double bytes) {
  if (!std::isfinite(bytes)) return "more than can be counted";
  static const char* const kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return std::to_string(static_cast<long long>(bytes)) + " bytes";
  double value = bytes / 1024;
  size_t unit = 0;
  while (value >= 1024 && unit + 1 < std::size(kUnits)) {
    value /= 1024;
    ++unit;
  }
  char text[64];
  if (value >= 1024) {  // beyond EiB: print in scientific notation rather than lie
    std::snprintf(text, sizeof text, "%.3g bytes", bytes);
  } else {
    std::snprintf(text, sizeof text, "%.1f %s", value, kUnits[unit]);
  }
  return text;
}

namespace {

// Which part of the estimate dominates, and what sets it, so the refusal
// points at the cause (a typo'd vocab_size, a huge micro-batch, many steps).
std::string dominant_cause(const MemoryEstimate& e) {
  const double weights = e.parameters + e.gradients + e.rolling;
  const double largest = std::max({weights, e.activations, e.probes, e.runtime});
  if (largest == e.runtime) return "the runtime's fixed cost (LibTorch itself)";
  if (largest == weights) {
    return std::string(e.rolling > 0 ? "parameters, gradients and the rolled-forward AdamW state" : "parameters and gradients") +
           ", set by model.vocab_size, model.hidden_size, "
           "model.intermediate_size and model.num_layers in manifest.json";
  }
  if (largest == e.activations) {
    return "activations, set by data.micro_batch_size, data.seq_len, model.num_heads, "
           "model.hidden_size and model.vocab_size in manifest.json";
  }
  return "probe records, set by data.grad_accum_steps, "
         "data.world_size, model.num_layers and model.num_heads in manifest.json; "
         "--no-probes drops them";
}

}  // namespace

bool choose_layer_streaming(const MemoryEstimate& in_memory, const MemoryEstimate& streamed,
                            const MemoryLimit& limit, bool stream) {
  const double room = static_cast<double>(limit.bytes);
  if (!stream && in_memory.total() <= room) return false;
  if (streamed.total() <= room) return true;
  // The breakdown of the mode asked for (streamed with --stream, else in memory), the other's total.
  const MemoryEstimate& shown = stream ? streamed : in_memory;
  std::ostringstream message;
  message << "this replay needs an estimated " << format_bytes(shown.total())
          << (stream ? " streamed layer by layer" : " in memory") << " (parameters " << format_bytes(shown.parameters)
          << ", gradients " << format_bytes(shown.gradients) << ", activations of one micro-batch "
          << format_bytes(shown.activations) << ", probe records " << format_bytes(shown.probes)
          << (shown.rolling > 0 ? ", rolled-forward parameters and AdamW state " + format_bytes(shown.rolling) : "")
          << ", runtime " << format_bytes(shown.runtime) << ") and "
          << format_bytes((stream ? in_memory : streamed).total())
          << (stream ? " in memory" : " streamed layer by layer") << ", more than the limit of " << format_bytes(room)
          << " (" << limit.source << "); "
          << (in_memory.total() <= room ? "the in-memory replay would fit: drop --stream" : "neither fits")
          << "; most of it is " << dominant_cause(streamed)
          << ". Nothing was loaded; if the machine has the room, raise the limit with --max-memory SIZE";
  throw UsageError(message.str());
}


}  // namespace nanreplay
