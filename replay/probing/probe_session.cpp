// Forward statistics are taken as each site is produced; backward statistics
// in gradient hooks. Records are ordered by execution order afterwards, so the
// backward order is the strict reverse of the forward order whatever order
// autograd happens to schedule its nodes in. Host tensors go through the CPU
// kernel at once; device tensors leave their statistics on the device (the
// CUDA kernel's slots, cuda_probe_stats.h, or LibTorch reductions,
// device_stats.h), read back and decoded when the records are taken.
#include "replay/probing/probe_session.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>

#include <torch/torch.h>

#include "kernels/tensor_stats.h"
#include "replay/probing/cuda_probe_stats.h"
#include "replay/probing/device_stats.h"
#include "replay/probing/damage_mask.h"
#include "replay/probing/largest_element.h"
#include "replay/probing/masked_row.h"

namespace nanreplay {

namespace {

void decode_first(ProbeRecord& record, const SiteDef* def, const std::vector<int64_t>& sample_ids) {
  if (record.stats.first_nonfinite < 0) return;
  record.first_index = unravel(record.stats.first_nonfinite, record.shape);
  if (def == nullptr || def->layout == SiteLayout::kScalar || record.first_index.size() < 3) return;
  const int64_t row = record.first_index[0];
  if (row < static_cast<int64_t>(sample_ids.size())) record.sample = sample_ids[static_cast<size_t>(row)];
  if (def->layout == SiteLayout::kTokens) {
    record.position = record.first_index[1];
  } else {
    record.first_head = static_cast<int>(record.first_index[1]);
    record.position = record.first_index[2];
  }
}

// values: min moment, its flat index over (batch rows x cols), rows below eps,
// any zero denominator.
void finish_norm_check(NormCheck& check, const double* values, int64_t cols,
                       const std::vector<int64_t>& sample_ids) {
  check.min_moment = values[0];
  const int64_t flat = static_cast<int64_t>(values[1]);
  check.rows_below_eps = static_cast<int64_t>(values[2]);
  check.zero_denominator = values[3] != 0.0;
  const int64_t row = flat / cols;
  if (row < static_cast<int64_t>(sample_ids.size())) check.sample = sample_ids[static_cast<size_t>(row)];
  check.position = flat % cols;
}

// The elements a site's statistics cover: causal sites (scores, probs) drop
// the positions the mask removes, which never reach the loss.
torch::Tensor counted_elements(const torch::Tensor& t, const SiteDef& def, const AttentionSpan& span) {
  if (!def.causal || t.dim() != 4 || t.size(2) != t.size(3)) return t;
  return t.masked_select(visible_keys(t.size(2), span, t.device()));
}

// kFlags: one all-finite test; counts only when it fails (rare, so cheap).
std::optional<ProbeRecord> nonfinite_flag(const torch::Tensor& tensor, const SiteDef& def, const AttentionSpan& span) {
  torch::NoGradGuard no_grad;
  const torch::Tensor counted = counted_elements(tensor.detach(), def, span);
  if (torch::isfinite(counted).all().item<bool>()) return std::nullopt;
  ProbeRecord record;
  record.shape = tensor.sizes().vec();
  record.stats.count = counted.numel();
  record.stats.nan_count = torch::isnan(counted).sum().item<int64_t>();
  record.stats.inf_count = torch::isinf(counted).sum().item<int64_t>();
  record.stats.finite_count = record.stats.count - record.stats.nan_count - record.stats.inf_count;
  return record;
}

}  // namespace

double dtype_max(ElemType type) {
  switch (type) {
    case ElemType::kF16: return 65504.0;
    case ElemType::kBF16: return 3.3895313892515355e38;
    case ElemType::kF32: return 3.4028234663852886e38;
  }
  return 3.4028234663852886e38;
}

namespace {

// log2(limit / max |x|): +inf for an all-zero tensor.
double headroom_bits(const TensorStats& stats, double limit) {
  return stats.max_abs > 0 ? std::log2(limit / stats.max_abs) : std::numeric_limits<double>::infinity();
}

bool probed_per_head(const torch::Tensor& t, const SiteDef* def) {
  return def != nullptr && is_per_head(def->id) && t.dim() == 4;
}

// Records from statistics already taken: `stats` is {whole} or one per head.
std::vector<ProbeRecord> records_from_stats(const std::vector<TensorStats>& stats, bool per_head,
                                            std::vector<int64_t> shape, ElemType type,
                                            const SiteDef* def, const std::vector<int64_t>& sample_ids) {
  const double limit = dtype_max(type);
  ProbeRecord whole;
  whole.shape = std::move(shape);
  std::vector<ProbeRecord> records;
  if (per_head) {
    whole.stats = combine_heads(stats);
    records.push_back(whole);
    for (size_t h = 0; h < stats.size(); ++h) {
      ProbeRecord one = whole;
      one.head = static_cast<int>(h);
      one.stats = stats[h];
      records.push_back(one);
    }
  } else {
    whole.stats = stats.at(0);
    records.push_back(whole);
  }
  for (ProbeRecord& record : records) {
    decode_first(record, def, sample_ids);
    record.headroom_bits = headroom_bits(record.stats, limit);
  }
  return records;
}

// The expert holding routed row `row`.
int expert_of_row(const ExpertRouting& routing, int64_t row) {
  const auto after = std::upper_bound(routing.offsets.begin(), routing.offsets.end(), row);
  return static_cast<int>(after - routing.offsets.begin()) - 1;
}

// A per-expert record's first element: its routed token's sample and position.
void decode_routed(ProbeRecord& record, int64_t first_row_offset, const ExpertRouting& routing,
                   const std::vector<int64_t>& sample_ids) {
  if (record.stats.first_nonfinite < 0) return;
  record.first_index = unravel(record.stats.first_nonfinite, record.shape);
  const int64_t row = first_row_offset + record.first_index.at(0);
  record.first_expert = expert_of_row(routing, row);
  const int64_t token = routing.tokens.at(static_cast<size_t>(row));
  const int64_t batch_row = token / routing.seq_len;
  if (batch_row < static_cast<int64_t>(sample_ids.size())) record.sample = sample_ids[static_cast<size_t>(batch_row)];
  record.position = token % routing.seq_len;
}

// Records of a per-expert site from each expert's statistics (indices local
// to the expert's rows): the whole tensor first, whose first element is the
// lowest index of the lowest expert holding one, then one record per expert.
std::vector<ProbeRecord> records_from_expert_stats(const std::vector<TensorStats>& per_expert, int64_t features,
                                                   ElemType type, const ExpertRouting& routing,
                                                   const std::vector<int64_t>& sample_ids) {
  std::vector<TensorStats> in_whole = per_expert;  // indices into the whole [rows, features] tensor
  for (size_t e = 0; e < in_whole.size(); ++e) {
    if (in_whole[e].first_nonfinite >= 0) in_whole[e].first_nonfinite += routing.offsets[e] * features;
  }
  ProbeRecord whole;
  whole.shape = {routing.rows(), features};
  whole.stats = combine_heads(in_whole);
  whole.routed_tokens = routing.rows();
  std::vector<ProbeRecord> records{whole};
  decode_routed(records[0], 0, routing, sample_ids);
  for (size_t e = 0; e < per_expert.size(); ++e) {
    ProbeRecord one;
    one.expert = static_cast<int>(e);
    one.routed_tokens = routing.offsets[e + 1] - routing.offsets[e];
    one.shape = {one.routed_tokens, features};
    one.stats = per_expert[e];
    decode_routed(one, routing.offsets[e], routing, sample_ids);
    records.push_back(std::move(one));
  }
  for (ProbeRecord& record : records) record.headroom_bits = headroom_bits(record.stats, dtype_max(type));
  return records;
}

// Each expert's rows of `t` ([rows, features]) as a view.
torch::Tensor expert_rows(const torch::Tensor& t, const ExpertRouting& routing, size_t e) {
  return t.narrow(0, routing.offsets[e], routing.offsets[e + 1] - routing.offsets[e]);
}

// Off the host: one reduction row per expert where the tensor lives, read back with the step's other values.
torch::Tensor device_expert_rows(const torch::Tensor& tensor, const ExpertRouting& routing) {
  std::vector<torch::Tensor> rows;
  for (size_t e = 0; e + 1 < routing.offsets.size(); ++e) {
    rows.push_back(device_stats_rows(expert_rows(tensor, routing, e), false, false, 0));
  }
  return torch::cat(rows, 0);
}

std::vector<ProbeRecord> describe_host_experts(const torch::Tensor& tensor, const ExpertRouting& routing,
                                               const std::vector<int64_t>& sample_ids) {
  const int64_t features = tensor.size(1);
  const size_t experts = routing.offsets.size() - 1;
  std::vector<TensorStats> stats;
  const torch::Tensor t = tensor.detach().contiguous();
  const size_t bytes = t.element_size() * static_cast<size_t>(features);
  for (size_t e = 0; e < experts; ++e) {
    const auto* base = static_cast<const char*>(t.data_ptr()) + bytes * static_cast<size_t>(routing.offsets[e]);
    stats.push_back(compute_stats(base, elem_type_of(t), (routing.offsets[e + 1] - routing.offsets[e]) * features));
  }
  return records_from_expert_stats(stats, features, elem_type_of(tensor), routing, sample_ids);
}

// Statistics rows read back: `count` rows of kDeviceStatsColumns from values[next], next moved past them.
std::vector<TensorStats> take_rows(const std::vector<double>& values, size_t& next, int64_t count) {
  std::vector<TensorStats> stats;
  for (int64_t r = 0; r < count; ++r) {
    stats.push_back(stats_from_row(values.data() + next));
    next += kDeviceStatsColumns;
  }
  return stats;
}

}  // namespace

std::vector<ProbeRecord> describe_tensor(const torch::Tensor& tensor, const SiteDef* def,
                                         const std::vector<int64_t>& sample_ids, const AttentionSpan& layer_span) {
  const bool per_head = probed_per_head(tensor, def);
  const AttentionSpan span = per_head && def->causal ? layer_span : AttentionSpan{};
  if (!tensor.device().is_cpu()) {  // off the host: reductions where it lives
    const torch::Tensor rows = device_stats_rows(tensor, per_head, per_head && def->causal, span);
    const std::vector<double> values = read_back({rows});
    size_t next = 0;
    return records_from_stats(take_rows(values, next, rows.size(0)), per_head, tensor.sizes().vec(),
                              elem_type_of(tensor), def, sample_ids);
  }
  const torch::Tensor t = tensor.detach().contiguous();
  const ElemType type = elem_type_of(t);
  std::vector<TensorStats> stats;
  if (per_head) {
    stats = compute_head_stats(t.data_ptr(), type, t.size(0), t.size(1), t.size(2), t.size(3), def->causal, span);
  } else {
    stats.push_back(compute_stats(t.data_ptr(), type, t.numel()));
  }
  return records_from_stats(stats, per_head, t.sizes().vec(), type, def, sample_ids);
}

struct ProbeSession::State {
  // A probe of a tensor that lives on an accelerator: its statistics rows
  // stay there until resolve() reads every pending row back at once.
  struct PendingProbe {
    torch::Tensor rows;  // (1, heads or experts, kDeviceStatsColumns) float64 on the device,
    std::optional<CudaProbeStats::Ticket> ticket;  // or the CUDA kernel's results
    std::vector<int64_t> shape;
    ElemType type;
    bool per_head;
    SiteRef ref;
    Phase phase;
    std::shared_ptr<const ExpertRouting> routing;  // a per-expert site: one row per expert
  };
  struct PendingNorm {
    torch::Tensor values;  // [min moment, its flat index, rows below eps, any zero denominator]
    int64_t cols;
    NormCheck check;       // all but the four values above
  };

  BatchContext context;
  ProbeScope scope;
  bool defer_host = false;
  // Each layer's sliding window or chunk (ModelConfig::span_of): causal sites count the keys seen.
  std::vector<AttentionSpan> attention_spans;
  AttentionSpan span_at(int layer) const {
    return layer >= 0 && layer < static_cast<int>(attention_spans.size()) ? attention_spans[static_cast<size_t>(layer)]
                                                                        : AttentionSpan{};
  }
  int num_forward_sites = 0;
  std::vector<int> order_of;  // (layer + 1) * kSiteCount + id -> forward order
  int last_order = -1;        // the forward order of the last site produced
  bool recomputing = false;   // begin_recompute(): hooks only
  int64_t head_dim = 0;             // attn.q/k/v: one head's width, for the shape of the damage
  int64_t v_head_dim = 0;           // attn.v's (latent attention's v_head_dim, else head_dim)
  bool nonfinite_damage_taken = false;  // the pass's first non-finite forward site has its damage
  // hold_scores(): one layer's attn.scores, from that site to its attn.probs.
  int held_scores_layer = -1;
  torch::Tensor held_scores;
  AttentionMask attention_mask = AttentionMask::kExclude;  // the model's, for what it does to a masked score
  bool soft_capped = false;                                // attn_logit_softcap runs before the mask

  // The forward must produce its sites in the site table's order: the order
  // that defines "first", and the reverse of the backward's.
  void advance_to(const SiteRef& ref) {
    const int next = order(ref);
    if (next <= last_order) {
      throw std::logic_error("the forward produced " + site_name(ref) + " out of the site table's order");
    }
    last_order = next;
  }
  std::vector<ProbeRecord> forward;
  std::vector<ProbeRecord> backward;
  std::vector<PendingProbe> pending;
  std::vector<PendingNorm> pending_norms;
  // Made for the first CUDA tensor the kernel takes, or shared by a step's
  // sessions (share_kernel) so that it is read back once for all of them.
  std::shared_ptr<CudaProbeStats> cuda_stats;
  std::vector<std::pair<SiteRef, SiteRef>> aliases;
  std::vector<NormCheck> norm_checks;

  // Full statistics of CPU tensors are taken at once, those of device
  // tensors join `pending`; bisection's flags are read at once anywhere.
  void probe(const torch::Tensor& tensor, const SiteRef& ref, Phase phase,
             const std::shared_ptr<const ExpertRouting>& routing = nullptr) {
    const SiteDef& def = site_def(ref.id);
    const bool deferred = scope.level == ProbeLevel::kFull && (!tensor.device().is_cpu() || defer_host);
    const bool locate = context.locate_largest && phase == Phase::kForward && scope.level == ProbeLevel::kFull;
    if (routing && !deferred && scope.level == ProbeLevel::kFull) {
      std::vector<ProbeRecord> records = describe_host_experts(tensor, *routing, context.sample_ids);
      if (locate) locate_largest_routed(records, tensor, *routing, context.sample_ids);
      add(std::move(records), ref, phase);
      return;
    }
    if (!deferred) {
      std::vector<ProbeRecord> records = describe(tensor, def, ref.layer);
      if (locate) locate_largest(records, tensor, def, context.sample_ids, span_at(ref.layer));
      if (phase == Phase::kForward && scope.level == ProbeLevel::kFull) take_damage(records, tensor, ref, locate);
      add(std::move(records), ref, phase);
      return;
    }
    const bool per_head = !routing && probed_per_head(tensor, &def);
    const bool causal = per_head && def.causal;
    const AttentionSpan span = causal ? span_at(ref.layer) : AttentionSpan{};
    PendingProbe p{{}, std::nullopt, tensor.sizes().vec(), elem_type_of(tensor), per_head, ref, phase, routing};
    // The CUDA kernel knows full causal rows only: a sliding window or chunk takes LibTorch's reductions.
    if (routing) {
      p.rows = device_expert_rows(tensor, *routing);
    } else if (span.full() && CudaProbeStats::accepts(tensor) && CudaProbeStats::available()) {
      if (!cuda_stats) cuda_stats = std::make_shared<CudaProbeStats>();
      p.ticket = cuda_stats->add(tensor, per_head, causal);
    } else {
      p.rows = device_stats_rows(tensor, per_head, causal, span);
    }
    pending.push_back(std::move(p));
  }

  // What resolve_from() decodes, in its order: each pending probe's rows
  // (the CUDA kernel's results come apart), then each norm's four values.
  void add_readback(std::vector<torch::Tensor>& parts) const {
    for (const PendingProbe& p : pending) {
      if (!p.ticket) parts.push_back(p.rows);
    }
    for (const PendingNorm& n : pending_norms) parts.push_back(n.values);
  }

  void resolve_from(const std::vector<double>& values, size_t& next, const std::vector<TensorStats>& kernel_results) {
    for (PendingProbe& p : pending) {
      std::vector<TensorStats> stats;
      if (p.ticket) {
        const auto first = kernel_results.begin() + p.ticket->first;
        stats.assign(first, first + p.ticket->count);
      } else {
        stats = take_rows(values, next, p.rows.size(0));
      }
      if (p.routing) {
        add(records_from_expert_stats(stats, p.shape.at(1), p.type, *p.routing, context.sample_ids), p.ref, p.phase);
      } else {
        add(records_from_stats(stats, p.per_head, std::move(p.shape), p.type, &site_def(p.ref.id), context.sample_ids),
            p.ref, p.phase);
      }
    }
    pending.clear();
    for (PendingNorm& n : pending_norms) {
      finish_norm_check(n.check, values.data() + next, n.cols, context.sample_ids);
      next += 4;
      norm_checks.push_back(n.check);
    }
    pending_norms.clear();
  }

  // Reads this session's pending values back on its own (one copy per
  // device) and decodes them: valid while no other session holds results in
  // a kernel it shares.
  void resolve() {
    if (pending.empty() && pending_norms.empty()) return;
    const std::vector<TensorStats> kernel_results = cuda_stats ? cuda_stats->collect() : std::vector<TensorStats>{};
    std::vector<torch::Tensor> parts;
    add_readback(parts);
    size_t next = 0;
    resolve_from(read_back(parts), next, kernel_results);
  }

  int order(const SiteRef& ref) const {
    return order_of.at(static_cast<size_t>((ref.layer + 1) * site_count() + static_cast<int>(ref.id)));
  }
  static int site_count() { return static_cast<int>(site_table().size()); }

  bool probed(const SiteRef& ref) const {
    if (scope.level == ProbeLevel::kOff) return false;
    if (scope.level == ProbeLevel::kFlags || !scope.layer || ref.layer == *scope.layer) return true;
    // The residual stream entering block L is also block L's `input` site.
    const int block = *scope.layer;
    if (block == 0) return ref.id == SiteId::kEmbed;
    return block > 0 && ref.id == SiteId::kOutput && ref.layer == block - 1;
  }

  // One head's width in the site's tensor: attn.v's may differ from q's and k's (latent attention).
  int64_t width_of_head(const SiteRef& ref) const { return ref.id == SiteId::kAttnV ? v_head_dim : head_dim; }

  // The shape of the damage (damage_mask.h): the non-finite elements of the
  // pass's first non-finite forward site, else on a spike incident the outliers.
  void take_damage(std::vector<ProbeRecord>& records, const torch::Tensor& tensor, const SiteRef& ref, bool outliers) {
    if (records.empty()) return;
    std::optional<DamageShape> damage;
    if (!records[0].stats.all_finite() && !nonfinite_damage_taken) {
      nonfinite_damage_taken = true;
      damage = nonfinite_damage(tensor, ref, width_of_head(ref), span_at(ref.layer));
      take_masked_score(records, tensor, ref);
    } else if (outliers && records[0].stats.all_finite()) {
      damage = outlier_damage(tensor, ref, width_of_head(ref), span_at(ref.layer));
    }
    if (!damage) return;
    if (damage->batch_row >= 0 && damage->batch_row < static_cast<int64_t>(context.sample_ids.size())) {
      damage->sample = context.sample_ids[static_cast<size_t>(damage->batch_row)];
    }
    const auto shared = std::make_shared<const DamageShape>(std::move(*damage));
    for (ProbeRecord& r : records) r.damage = shared;
  }

  // The pass's first non-finite site is a layer's scores or probabilities: what
  // the mask did to the origin's row if it held non-finite scores at masked keys.
  void take_masked_score(std::vector<ProbeRecord>& records, const torch::Tensor& tensor, const SiteRef& ref) {
    torch::Tensor scores;
    if (ref.id == SiteId::kAttnScores) scores = tensor;
    if (ref.id == SiteId::kAttnProbs && held_scores_layer == ref.layer) scores = held_scores;
    if (!scores.defined() || scores.sizes() != tensor.sizes()) return;
    std::optional<MaskedScore> masked =
        masked_score_in_row(scores, records[0].first_index, span_at(ref.layer), attention_mask, soft_capped);
    if (!masked) return;
    if (masked->batch_row < static_cast<int64_t>(context.sample_ids.size())) {
      masked->sample = context.sample_ids[static_cast<size_t>(masked->batch_row)];
    }
    const auto shared = std::make_shared<const MaskedScore>(std::move(*masked));
    for (ProbeRecord& r : records) r.masked_score = shared;
  }

  // The records of one site's tensor at this level (none when flags find it finite).
  std::vector<ProbeRecord> describe(const torch::Tensor& tensor, const SiteDef& def, int layer) const {
    const AttentionSpan span = span_at(layer);
    if (scope.level == ProbeLevel::kFull) return describe_tensor(tensor, &def, context.sample_ids, span);
    std::optional<ProbeRecord> flag = nonfinite_flag(tensor, def, span);
    return flag ? std::vector<ProbeRecord>{*flag} : std::vector<ProbeRecord>{};
  }

  void add(std::vector<ProbeRecord> records, const SiteRef& ref, Phase phase) {
    const int forward_order = order(ref);
    for (ProbeRecord& record : records) {
      record.step = context.step;
      record.micro_batch = context.micro_batch;
      record.rank = context.rank;
      record.phase = phase;
      record.order = phase == Phase::kForward ? forward_order : num_forward_sites - 1 - forward_order;
      record.site = ref;
      record.layer = ref.layer;
      (phase == Phase::kForward ? forward : backward).push_back(std::move(record));
    }
  }
};

ProbeSession::ProbeSession(BatchContext context, const Numerics& numerics, bool enabled,
                           const ModelConfig& model, bool defer_host)
    : ProbeSession(std::move(context), numerics, ProbeScope{enabled ? ProbeLevel::kFull : ProbeLevel::kOff, {}},
                   model, defer_host) {}

ProbeSession::ProbeSession(BatchContext context, const Numerics& numerics, const ProbeScope& scope,
                           const ModelConfig& model, bool defer_host)
    : state_(std::make_shared<State>()), numerics_(numerics) {
  state_->context = std::move(context);
  state_->scope = scope;
  state_->defer_host = defer_host;
  // The decoder's layers, then model.mtp's blocks (as with_mtp_blocks' model spans them).
  for (int layer = 0; layer < layers_with_sites(model); ++layer) {
    const bool listed = model.layer_types.empty() || layer < static_cast<int>(model.layer_types.size());
    state_->attention_spans.push_back(listed ? model.span_of(layer) : AttentionSpan{});
  }
  state_->head_dim = model.num_heads > 0 ? model.head_dim() : 0;
  state_->v_head_dim = model.num_heads > 0 ? model.v_head_dim() : 0;
  state_->attention_mask = model.attention_mask;
  state_->soft_capped = model.attn_logit_softcap.has_value();
  const std::vector<SiteRef> sites = forward_sites(model);
  state_->num_forward_sites = static_cast<int>(sites.size());
  state_->order_of.assign(static_cast<size_t>((layers_with_sites(model) + 1) * State::site_count()), -1);
  for (size_t i = 0; i < sites.size(); ++i) {
    const size_t slot = static_cast<size_t>((sites[i].layer + 1) * State::site_count() +
                                            static_cast<int>(sites[i].id));
    state_->order_of[slot] = static_cast<int>(i);
  }
}

ProbeSession::~ProbeSession() = default;

torch::Tensor ProbeSession::site(const SiteRef& ref, const torch::Tensor& value) { return produce(ref, value, nullptr); }

torch::Tensor ProbeSession::expert_site(const SiteRef& ref, const torch::Tensor& value,
                                       std::shared_ptr<const ExpertRouting> routing) {
  return produce(ref, value, std::move(routing));
}

torch::Tensor ProbeSession::produce(const SiteRef& ref, const torch::Tensor& value,
                                    std::shared_ptr<const ExpertRouting> routing) {
  state_->advance_to(ref);
  // The loss stays fp32 (cross-entropy from the rounded logits); all else is
  // rounded, unless a what-if keeps the site in fp32.
  const bool rounded = numerics_.rounds_site(ref);
  const torch::Tensor held = rounded ? numerics_.to_low(value) : value;
  if (state_->probed(ref)) {
    if (!state_->recomputing) state_->probe(held, ref, Phase::kForward, routing);
    if (held.requires_grad()) {
      std::shared_ptr<State> state = state_;
      held.register_hook([state, ref, routing](torch::Tensor grad) { state->probe(grad, ref, Phase::kBackward, routing); });
    }
  }
  if (ref.id == SiteId::kAttnProbs) state_->held_scores = torch::Tensor();  // its scores are read by now
  return rounded ? held.to(torch::kFloat32) : value;
}

void ProbeSession::hold_scores(int layer, const torch::Tensor& scores) {
  State& s = *state_;
  const bool wanted = s.scope.level == ProbeLevel::kFull && !s.recomputing && !s.nonfinite_damage_taken &&
                      scores.device().is_cpu() && !s.defer_host;
  s.held_scores_layer = wanted ? layer : -1;
  s.held_scores = wanted ? scores.detach() : torch::Tensor();
}

void ProbeSession::alias(const SiteRef& ref, const SiteRef& same_as) {
  state_->advance_to(ref);
  if (!state_->probed(ref) || state_->recomputing) return;
  state_->aliases.emplace_back(ref, same_as);  // copied in take_records, once all are resolved
}

bool ProbeSession::enabled() const { return state_->scope.level == ProbeLevel::kFull && !state_->recomputing; }

void ProbeSession::begin_recompute() {
  state_->recomputing = true;
  state_->last_order = -1;  // each piece produces its sites in order from the start
}

void ProbeSession::check_norm(const SiteRef& ref, const torch::Tensor& moment, double eps, const char* moment_name) {
  if (!enabled()) return;
  torch::NoGradGuard no_grad;
  const torch::Tensor m = moment.detach().to(torch::kFloat64).reshape({moment.size(0), -1});
  const torch::Tensor finite_m = torch::where(torch::isnan(m), torch::full_like(m, INFINITY), m);
  const torch::Tensor flat = finite_m.argmin();
  // Four values, still on m's device: resolved with the step's other probes.
  const torch::Tensor values = torch::stack({finite_m.view(-1).index_select(0, flat.view(1)).squeeze(0),
                                             flat.to(torch::kFloat64), (m < eps).sum().to(torch::kFloat64),
                                             ((m + eps) == 0).any().to(torch::kFloat64)});
  State::PendingNorm pending{values, m.size(1), NormCheck{}};
  NormCheck& check = pending.check;
  check.step = state_->context.step;
  check.micro_batch = state_->context.micro_batch;
  check.rank = state_->context.rank;
  check.site = ref;
  check.layer = ref.layer;
  check.eps = eps;
  check.moment = moment_name;
  if (m.device().is_cpu() && !state_->defer_host) {
    finish_norm_check(check, values.contiguous().data_ptr<double>(), m.size(1), state_->context.sample_ids);
    state_->norm_checks.push_back(check);
  } else {
    state_->pending_norms.push_back(std::move(pending));
  }
}

void ProbeSession::add_readback(std::vector<torch::Tensor>& parts) const { state_->add_readback(parts); }

void ProbeSession::resolve_from(const std::vector<double>& values, size_t& next,
                                const std::vector<TensorStats>& kernel_results) {
  state_->resolve_from(values, next, kernel_results);
}

void ProbeSession::share_kernel(std::shared_ptr<CudaProbeStats> kernel) { state_->cuda_stats = std::move(kernel); }

std::vector<NormCheck> ProbeSession::take_norm_checks() {
  state_->resolve();
  std::vector<NormCheck> checks = std::move(state_->norm_checks);
  state_->norm_checks.clear();
  return checks;
}

std::vector<ProbeRecord> ProbeSession::take_records() {
  State& s = *state_;
  s.resolve();
  s.last_order = -1;  // the pass is over; a session used again starts a new one
  s.recomputing = false;
  for (const auto& [ref, same_as] : s.aliases) {
    for (Phase phase : {Phase::kForward, Phase::kBackward}) {
      std::vector<ProbeRecord> copies;
      for (const ProbeRecord& record : phase == Phase::kForward ? s.forward : s.backward) {
        if (record.site == same_as) copies.push_back(record);
      }
      s.add(std::move(copies), ref, phase);
    }
  }
  s.aliases.clear();
  auto by_order = [](const ProbeRecord& a, const ProbeRecord& b) {
    return a.order != b.order ? a.order < b.order : std::pair(a.head, a.expert) < std::pair(b.head, b.expert);
  };
  std::stable_sort(s.forward.begin(), s.forward.end(), by_order);
  std::stable_sort(s.backward.begin(), s.backward.end(), by_order);
  std::vector<ProbeRecord> all = std::move(s.forward);
  all.insert(all.end(), std::make_move_iterator(s.backward.begin()),
             std::make_move_iterator(s.backward.end()));
  s.forward.clear();
  s.backward.clear();
  return all;
}

ProbeHarvest ProbeSession::take_harvest() {
  State& s = *state_;
  s.resolve();
  ProbeHarvest harvest{std::move(s.forward), std::move(s.backward), std::move(s.aliases), std::move(s.norm_checks)};
  s.forward.clear();
  s.backward.clear();
  s.aliases.clear();
  s.norm_checks.clear();
  return harvest;
}

void ProbeSession::absorb(ProbeHarvest harvest) {
  State& s = *state_;
  auto append = [](auto& into, auto& from) {
    into.insert(into.end(), std::make_move_iterator(from.begin()), std::make_move_iterator(from.end()));
  };
  append(s.forward, harvest.forward);
  append(s.backward, harvest.backward);
  append(s.aliases, harvest.aliases);
  append(s.norm_checks, harvest.norm_checks);
  // One process notes its norms in forward order; several, each in its own.
  std::stable_sort(s.norm_checks.begin(), s.norm_checks.end(),
                   [&s](const NormCheck& a, const NormCheck& b) { return s.order(a.site) < s.order(b.site); });
}

}  // namespace nanreplay
