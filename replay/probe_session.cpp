// Forward statistics are taken as each site is produced; backward statistics
// in gradient hooks. Records are ordered by execution order afterwards, so the
// backward order is the strict reverse of the forward order whatever order
// autograd happens to schedule its nodes in.
#include "replay/probe_session.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include <torch/torch.h>

#include "kernels/tensor_stats.h"

namespace nanreplay {

namespace {

ElemType elem_type_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return ElemType::kF32;
    case torch::kBFloat16: return ElemType::kBF16;
    case torch::kHalf: return ElemType::kF16;
    default: throw std::logic_error("probe: unsupported dtype " + std::string(c10::toString(t.scalar_type())));
  }
}

std::vector<int64_t> unravel(int64_t index, const std::vector<int64_t>& shape) {
  std::vector<int64_t> coords(shape.size(), 0);
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] == 0) return coords;
    coords[d] = index % shape[d];
    index /= shape[d];
  }
  return coords;
}

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

// The elements a site's statistics cover: causal sites (scores, probs) drop
// the positions the mask removes, which never reach the loss.
torch::Tensor counted_elements(const torch::Tensor& t, const SiteDef& def) {
  if (!def.causal || t.dim() != 4 || t.size(2) != t.size(3)) return t;
  const int64_t T = t.size(2);
  const torch::Tensor keep = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool)).tril();
  return t.masked_select(keep);
}

// kFlags: one all-finite test; counts only when it fails (rare, so cheap).
std::optional<ProbeRecord> nonfinite_flag(const torch::Tensor& tensor, const SiteDef& def) {
  torch::NoGradGuard no_grad;
  const torch::Tensor counted = counted_elements(tensor.detach(), def);
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

std::vector<ProbeRecord> describe_tensor(const torch::Tensor& tensor, const SiteDef* def,
                                         const std::vector<int64_t>& sample_ids) {
  const torch::Tensor t = tensor.detach().contiguous();
  const ElemType type = elem_type_of(t);
  const double limit = dtype_max(type);
  ProbeRecord whole;
  whole.shape = t.sizes().vec();
  std::vector<ProbeRecord> records;
  const bool per_head = def != nullptr && is_per_head(def->id) && t.dim() == 4;
  if (per_head) {
    const std::vector<TensorStats> heads =
        compute_head_stats(t.data_ptr(), type, t.size(0), t.size(1), t.size(2), t.size(3), def->causal);
    whole.stats = combine_heads(heads);
    records.push_back(whole);
    for (size_t h = 0; h < heads.size(); ++h) {
      ProbeRecord one = whole;
      one.head = static_cast<int>(h);
      one.stats = heads[h];
      records.push_back(one);
    }
  } else {
    whole.stats = compute_stats(t.data_ptr(), type, t.numel());
    records.push_back(whole);
  }
  for (ProbeRecord& record : records) {
    decode_first(record, def, sample_ids);
    record.headroom_bits = record.stats.max_abs > 0 ? std::log2(limit / record.stats.max_abs)
                                                    : std::numeric_limits<double>::infinity();
  }
  return records;
}

struct ProbeSession::State {
  BatchContext context;
  ProbeScope scope;
  int num_forward_sites = 0;
  std::vector<int> order_of;  // (layer + 1) * kSiteCount + id -> forward order
  std::vector<ProbeRecord> forward;
  std::vector<ProbeRecord> backward;
  std::vector<std::pair<SiteRef, SiteRef>> aliases;
  std::vector<NormCheck> norm_checks;

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

  // The records of one site's tensor at this level (none when flags find it finite).
  std::vector<ProbeRecord> describe(const torch::Tensor& tensor, const SiteDef& def) const {
    if (scope.level == ProbeLevel::kFull) return describe_tensor(tensor, &def, context.sample_ids);
    std::optional<ProbeRecord> flag = nonfinite_flag(tensor, def);
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
      record.site = site_name(ref);
      record.layer = ref.layer;
      (phase == Phase::kForward ? forward : backward).push_back(std::move(record));
    }
  }
};

ProbeSession::ProbeSession(BatchContext context, const Numerics& numerics, bool enabled,
                           const ModelConfig& model)
    : ProbeSession(std::move(context), numerics, ProbeScope{enabled ? ProbeLevel::kFull : ProbeLevel::kOff, {}},
                   model) {}

ProbeSession::ProbeSession(BatchContext context, const Numerics& numerics, const ProbeScope& scope,
                           const ModelConfig& model)
    : state_(std::make_shared<State>()), numerics_(numerics) {
  state_->context = std::move(context);
  state_->scope = scope;
  const std::vector<SiteRef> sites = forward_sites(model);
  state_->num_forward_sites = static_cast<int>(sites.size());
  state_->order_of.assign(static_cast<size_t>((model.num_layers + 1) * State::site_count()), -1);
  for (size_t i = 0; i < sites.size(); ++i) {
    const size_t slot = static_cast<size_t>((sites[i].layer + 1) * State::site_count() +
                                            static_cast<int>(sites[i].id));
    state_->order_of[slot] = static_cast<int>(i);
  }
}

ProbeSession::~ProbeSession() = default;

torch::Tensor ProbeSession::site(const SiteRef& ref, const torch::Tensor& value) {
  // The loss stays fp32 (cross-entropy from the rounded logits); all else is
  // rounded, unless a what-if keeps the site in fp32.
  const bool rounded = numerics_.rounds_site(ref);
  const torch::Tensor held = rounded ? numerics_.to_low(value) : value;
  if (state_->probed(ref)) {
    const SiteDef& def = site_def(ref.id);
    state_->add(state_->describe(held, def), ref, Phase::kForward);
    if (held.requires_grad()) {
      std::shared_ptr<State> state = state_;
      held.register_hook([state, ref](torch::Tensor grad) {
        state->add(state->describe(grad, site_def(ref.id)), ref, Phase::kBackward);
      });
    }
  }
  return rounded ? held.to(torch::kFloat32) : value;
}

void ProbeSession::alias(const SiteRef& ref, const SiteRef& same_as) {
  if (!state_->probed(ref)) return;
  state_->aliases.emplace_back(ref, same_as);
  const std::string original = site_name(same_as);
  std::vector<ProbeRecord> copies;
  for (const ProbeRecord& record : state_->forward) {
    if (record.site == original) copies.push_back(record);
  }
  state_->add(std::move(copies), ref, Phase::kForward);
}

bool ProbeSession::enabled() const { return state_->scope.level == ProbeLevel::kFull; }

void ProbeSession::check_norm(const SiteRef& ref, const torch::Tensor& moment, double eps) {
  if (!enabled()) return;
  torch::NoGradGuard no_grad;
  const torch::Tensor m = moment.detach().to(torch::kFloat64).reshape({moment.size(0), -1});
  const torch::Tensor finite_m = torch::where(torch::isnan(m), torch::full_like(m, INFINITY), m);
  const int64_t flat = finite_m.argmin().item<int64_t>();
  NormCheck check;
  check.step = state_->context.step;
  check.micro_batch = state_->context.micro_batch;
  check.rank = state_->context.rank;
  check.site = site_name(ref);
  check.layer = ref.layer;
  check.eps = eps;
  check.min_moment = finite_m.view(-1)[flat].item<double>();
  check.rows_below_eps = (m < eps).sum().item<int64_t>();
  check.zero_denominator = ((m + eps) == 0).any().item<bool>();
  const int64_t row = flat / m.size(1);
  if (row < static_cast<int64_t>(state_->context.sample_ids.size())) {
    check.sample = state_->context.sample_ids[static_cast<size_t>(row)];
  }
  check.position = flat % m.size(1);
  state_->norm_checks.push_back(check);
}

std::vector<NormCheck> ProbeSession::take_norm_checks() {
  std::vector<NormCheck> checks = std::move(state_->norm_checks);
  state_->norm_checks.clear();
  return checks;
}

std::vector<ProbeRecord> ProbeSession::take_records() {
  State& s = *state_;
  for (const auto& [ref, same_as] : s.aliases) {
    const std::string original = site_name(same_as);
    std::vector<ProbeRecord> copies;
    for (const ProbeRecord& record : s.backward) {
      if (record.site == original) copies.push_back(record);
    }
    s.add(std::move(copies), ref, Phase::kBackward);
  }
  s.aliases.clear();
  auto by_order = [](const ProbeRecord& a, const ProbeRecord& b) {
    return a.order != b.order ? a.order < b.order : a.head < b.head;
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

}  // namespace nanreplay
