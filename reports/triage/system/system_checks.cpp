// Checkpoint contamination and flipped-bit detection; see system_checks.h.
#include "reports/triage/system/system_checks.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>

#include <torch/torch.h>

#include "kernels/tensor_stats.h"
#include "loaders/base/error.h"
#include "loaders/bundle/optimizer_manifest.h"
#include "replay/optim/clipping.h"
#include "replay/optim/optimizer.h"
#include "replay/optim/optimizer_state_file.h"
#include "reports/results/number_text.h"

namespace nanreplay {

using K = EvidenceKey;

namespace {

constexpr size_t kMaxFlipsPerParam = 64;

std::optional<ElemType> elem_type(DType dtype) {
  switch (dtype) {
    case DType::kF32: return ElemType::kF32;
    case DType::kBF16: return ElemType::kBF16;
    case DType::kF16: return ElemType::kF16;
    default: return std::nullopt;
  }
}

TensorStats stats_of(const TensorInfo& info) {
  const auto type = elem_type(info.dtype);
  if (!type) return {};
  const size_t width = dtype_size(info.dtype);
  if (reinterpret_cast<uintptr_t>(info.data) % width == 0) {
    return compute_stats(info.data, *type, info.numel());
  }
  std::vector<uint8_t> aligned(info.nbytes() + 8);
  std::memcpy(aligned.data(), info.data, info.nbytes());
  return compute_stats(aligned.data(), *type, info.numel());
}

// The stored encoding of element `i` and its value with bit `bit` flipped.
uint32_t stored_bits(const TensorInfo& info, int64_t i) {
  uint32_t bits = 0;
  std::memcpy(&bits, info.data + i * static_cast<int64_t>(dtype_size(info.dtype)), dtype_size(info.dtype));
  return bits;
}

double decode(uint32_t bits, DType dtype) {
  if (dtype == DType::kF32) {
    float value;
    std::memcpy(&value, &bits, 4);
    return value;
  }
  return dtype == DType::kBF16 ? bf16_to_float(static_cast<uint16_t>(bits))
                               : f16_to_float(static_cast<uint16_t>(bits));
}

int bit_width(DType dtype) { return dtype == DType::kF32 ? 32 : 16; }

// Drops a tensor's mapped pages when the scope ends, early exits included.
struct ReleaseWhenDone {
  const SafetensorsFile& file;
  const TensorInfo& info;
  ReleaseWhenDone(const SafetensorsFile& f, const TensorInfo& i) : file(f), info(i) {}
  ~ReleaseWhenDone() { file.release(info); }
  ReleaseWhenDone(const ReleaseWhenDone&) = delete;
  ReleaseWhenDone& operator=(const ReleaseWhenDone&) = delete;
};

// Beyond this many deviating elements a parameter was not hit by flipped
// bits: its whole update differs.
int64_t bulk_limit(int64_t numel) { return std::max<int64_t>(1024, numel / 100); }

// Rows of one parameter predicted per pass: about 256 Ki elements, so the
// AdamW temporaries stay a few MiB even for the embedding.
constexpr int64_t kSliceElements = int64_t{1} << 18;

// Elements of model(s+1) that differ from AdamW applied to model(s) by more
// than rounding, with the predicted values (kept up to bulk_limit + 1).
struct Deviations {
  int64_t count = 0;
  std::vector<int64_t> flat;
  std::vector<double> want;
  // How far the stored tensor is from the prediction as a whole (docs/triage.md):
  // the largest |expected - found|, and the sums of squares behind the norms.
  double max_abs_diff = 0.0;
  double sum_sq_expected = 0.0, sum_sq_found = 0.0, sum_sq_diff = 0.0;
};

// Folds one slice's magnitudes into `out` (non-finite stored values make them inf or nan).
void add_magnitudes(Deviations& out, const torch::Tensor& expected, const torch::Tensor& actual) {
  const torch::Tensor e = expected.to(torch::kDouble), a = actual.to(torch::kDouble);
  const torch::Tensor diff = (a - e).abs();
  if (diff.numel() > 0) out.max_abs_diff = std::max(out.max_abs_diff, diff.max().item<double>());
  out.sum_sq_expected += e.pow(2).sum().item<double>();
  out.sum_sq_found += a.pow(2).sum().item<double>();
  out.sum_sq_diff += diff.pow(2).sum().item<double>();
}

// model(s+1) predicted for rows [row, row + count) of a parameter.
using SlicePrediction = std::function<torch::Tensor(int64_t row, int64_t count)>;

// Compares the prediction with the stored model(s+1), slice by slice of rows
// (the update is elementwise, so slicing changes nothing).
// `step_floor`: the smallest deviation that counts; Adam's normalized step
// moves an element by at most a few lr, so 8 lr unless a rule whose steps are
// not normalized per element (Adafactor, Muon) gives its own.
Deviations compare_with_stored(const SlicePrediction& predict, const TensorInfo& actual_info,
                               const std::string& label, double lr, double step_floor = -1) {
  Deviations out;
  const int64_t numel = actual_info.numel();
  const int64_t rows = actual_info.shape.empty() ? 1 : actual_info.shape[0];
  const int64_t row_elements = rows > 0 ? numel / rows : 0;
  const int64_t rows_per_slice = std::max<int64_t>(1, kSliceElements / std::max<int64_t>(1, row_elements));
  const int64_t limit = bulk_limit(numel);
  for (int64_t row = 0; row < rows; row += rows_per_slice) {
    const int64_t count = std::min(rows_per_slice, rows - row);
    torch::Tensor expected = predict(row, count);
    if (actual_info.dtype == DType::kBF16) expected = expected.to(torch::kBFloat16).to(torch::kFloat32);
    if (actual_info.dtype == DType::kF16) expected = expected.to(torch::kHalf).to(torch::kFloat32);
    const torch::Tensor actual = tensor_from_safetensors(tensor_rows(actual_info, row, count), label).reshape(expected.sizes());
    add_magnitudes(out, expected, actual);
    // Far more than rounding: beyond what any sign noise in a near-zero
    // gradient could move Adam's normalized step (a few lr), and 0.1%.
    const torch::Tensor threshold = torch::clamp_min(expected.abs() * 1e-3, step_floor >= 0 ? step_floor : 8.0 * lr);
    const torch::Tensor deviant =
        torch::isfinite(expected) & (((actual - expected).abs() > threshold) | ~torch::isfinite(actual));
    const torch::Tensor where = deviant.reshape({-1}).nonzero().reshape({-1}).contiguous();
    const int64_t found = where.numel();
    if (found == 0) continue;
    const int64_t* local = where.data_ptr<int64_t>();
    const torch::Tensor flat_expected = expected.reshape({-1}).contiguous();
    const float* e = flat_expected.data_ptr<float>();
    for (int64_t k = 0; k < found && out.count + k <= limit; ++k) {
      out.flat.push_back(row * row_elements + local[k]);
      out.want.push_back(e[local[k]]);
    }
    out.count += found;
  }
  return out;
}

// Where model(s+1) and the prediction part: flipped bits (SYSTEM_BIT_FLIP)
// or an update that is not the spec's (SYSTEM_UPDATE_MISMATCH).
struct UpdateContext {
  int64_t current_step, next_step;
  std::string next_label;
  double lr;
  std::string optimizer = "AdamW";  // the rule the prediction applied, as messages name it
};

// SYSTEM_UPDATE_MISMATCH with how far the stored tensor is from the update
// the optimizer computed: max |expected - found|, ||found|| / ||expected||
// and ||found - expected|| / ||expected||. A difference as large as the
// tensor itself (kRewrittenRelative) is no optimizer setting: the tensor was
// rewritten outside the optimizer, an error that can be the root cause.
constexpr double kRewrittenRelative = 1.0;

Finding update_mismatch(const std::string& name, const Deviations& d, const UpdateContext& at, const std::string& what,
                        const std::string& why_warning, Evidence evidence) {
  const double expected_norm = std::sqrt(d.sum_sq_expected);
  const double norm_ratio = std::sqrt(d.sum_sq_found) / std::max(expected_norm, 1e-30);
  const double relative = std::sqrt(d.sum_sq_diff) / std::max(expected_norm, 1e-30);
  evidence.set(K::kMaxAbsDiff, d.max_abs_diff).set(K::kNormRatio, norm_ratio).set(K::kRelative, relative);
  const std::string magnitude = " (max |expected - found| " + format_number(d.max_abs_diff) + ", ||found|| / ||expected|| " +
                                format_number(norm_ratio) + ")";
  // NaN compares false: a non-finite checkpoint is CHECKPOINT_NONFINITE's to name.
  if (relative >= kRewrittenRelative) {
    evidence.set(K::kRewritten, true);
    return make_finding(FindingCode::kSystemUpdateMismatch, Severity::kError,
                        name + " was rewritten outside the optimizer before step " + std::to_string(at.next_step) +
                            ": " + what + magnitude + ", a difference " + format_number(relative) +
                            " times the tensor's own norm, which no optimizer setting explains",
                        evidence);
  }
  evidence.set(K::kRewritten, false);
  return make_finding(FindingCode::kSystemUpdateMismatch, Severity::kWarning, name + ": " + what + magnitude + why_warning,
                      evidence);
}

std::vector<Finding> deviation_findings(const std::string& name, const Deviations& deviations,
                                        const TensorInfo& actual_info, const UpdateContext& at) {
  std::vector<Finding> findings;
  const int64_t count = deviations.count;
  if (count == 0) return findings;
  const int64_t numel = actual_info.numel();
  if (count > bulk_limit(numel)) {
    // Too many to be flipped bits: the update itself differs (lr, betas, a different optimizer).
    findings.push_back(update_mismatch(name, deviations, at,
        std::to_string(count) + " of " + std::to_string(numel) + " elements of " + at.next_label +
            " differ from " + at.optimizer + " applied to step " + std::to_string(at.current_step),
        ": the recorded update is not the bundle format's " + at.optimizer,
        {{K::kStep, at.next_step}, {K::kParam, name}, {K::kLength, count}}));
    return findings;
  }
  std::vector<int64_t> unexplained;
  std::vector<Finding> flips;
  for (size_t k = 0; k < deviations.flat.size(); ++k) {
    const int64_t flat = deviations.flat[k];
    const double want = deviations.want[k];
    const uint32_t bits = stored_bits(actual_info, flat);
    // A flip restores the job's own value, which the recomputation matches to
    // rounding: relative 1e-4, plus a sliver of lr for gradient noise. Looser
    // matching would "explain" any replaced value by a tiny flipped twin.
    const double tolerance = 1e-4 * std::fabs(want) + 1e-3 * at.lr + 1e-30;
    int best_bit = -1;
    double best = tolerance;
    for (int bit = 0; bit < bit_width(actual_info.dtype); ++bit) {
      const double candidate = decode(bits ^ (1u << bit), actual_info.dtype);
      if (std::isfinite(candidate) && std::fabs(candidate - want) <= best) {
        best = std::fabs(candidate - want);
        best_bit = bit;
      }
    }
    if (best_bit < 0) {
      unexplained.push_back(flat);
      continue;
    }
    const double before = decode(bits ^ (1u << best_bit), actual_info.dtype);
    const double after = decode(bits, actual_info.dtype);
    flips.push_back(make_finding(FindingCode::kSystemBitFlip, Severity::kError,
        name + " element " + std::to_string(flat) + " in " + at.next_label + ": bit " + std::to_string(best_bit) +
            " flipped, " + format_number(before) + " became " + format_number(after) + " (" + at.optimizer + " from step " +
            std::to_string(at.current_step) + " predicts " + format_number(want) + ")",
        {{K::kStep, at.next_step}, {K::kParam, name}, {K::kIndex, unravel(flat, actual_info.shape)},
         {K::kBit, best_bit}, {K::kBefore, before}, {K::kAfter, after}, {K::kExpected, want}}));
  }
  // Silent corruption flips a few bits; when most deviations of a parameter
  // have no single-bit explanation the tensor was rewritten, and the odd
  // element whose flipped twin lands near its prediction is a coincidence.
  const bool bulk_change = unexplained.size() >= 4 && unexplained.size() > flips.size();
  if (!bulk_change) {
    if (flips.size() > kMaxFlipsPerParam) flips.resize(kMaxFlipsPerParam);
    findings.insert(findings.end(), flips.begin(), flips.end());
  }
  const size_t deviating = unexplained.size() + (bulk_change ? flips.size() : 0);
  if (!unexplained.empty()) {
    findings.push_back(update_mismatch(name, deviations, at,
        std::to_string(deviating) + " element(s) of " + at.next_label + " differ from " + at.optimizer +
            " applied to step " + std::to_string(at.current_step) + " by more than rounding",
        ", and no single flipped bit explains them",
        {{K::kStep, at.next_step}, {K::kParam, name}, {K::kLength, static_cast<int64_t>(deviating)},
         {K::kIndex, unravel(unexplained.front(), actual_info.shape)}}));
  }
  return findings;
}

}  // namespace

std::vector<Finding> checkpoint_nonfinite_findings(const Bundle& bundle) {
  struct Seen {
    int64_t first_step = 0;
    int64_t count = 0;
    std::string file;
    std::string kind;
    std::vector<int64_t> index;
    std::vector<int64_t> steps;
  };
  std::map<std::string, Seen> tensors;
  std::vector<std::string> order;
  for (const StepFiles& files : bundle.steps()) {
    std::vector<std::pair<std::string, std::string>> sources;
    if (files.has_model) sources.push_back({"model.safetensors", files.model.string()});  // a derived step has none
    if (bundle.has_optimizer(files)) sources.push_back({"optimizer.safetensors", files.optimizer.string()});
    for (const auto& [leaf, path] : sources) {
      const SafetensorsFile file = SafetensorsFile::open(path, files.label(leaf));
      for (const TensorInfo& info : file.tensors()) {
        const TensorStats stats = stats_of(info);
        file.release(info);  // resident: one tensor at a time, not the whole file
        if (stats.all_finite()) continue;
        auto [it, fresh] = tensors.try_emplace(info.name);
        Seen& seen = it->second;
        if (fresh) {
          order.push_back(info.name);
          seen.first_step = files.step;
          seen.count = stats.nan_count + stats.inf_count;
          seen.file = files.label(leaf);
          seen.kind = leaf == "model.safetensors" ? "parameter" : "optimizer moment";
          seen.index = unravel(stats.first_nonfinite, info.shape);
        }
        seen.steps.push_back(files.step);
      }
    }
  }
  std::vector<Finding> findings;
  for (const std::string& name : order) {
    const Seen& s = tensors.at(name);
    findings.push_back(make_finding(FindingCode::kCheckpointNonfinite, Severity::kError,
        s.kind + " " + name + " already holds " + std::to_string(s.count) +
            " non-finite element(s) in " + s.file + " (from step " + std::to_string(s.first_step) +
            " on, before any replay)",
        {{K::kParam, name}, {K::kStep, s.first_step}, {K::kLength, s.count}, {K::kIndex, s.index},
         {K::kSteps, s.steps}, {K::kTensor, s.kind}}));
  }
  return findings;
}

namespace {

// The optimizer as the findings name it: "AdamW" (the bundle format's own), else its class.
std::string optimizer_label_of(const OptimizerRule& rule) {
  return rule.kind == OptimizerKind::kAdamW ? "AdamW" : optimizer_class_name(rule.kind);
}

// The lr of parameter `name`'s group at step `current`: a per-group lr object
// must name the group.
double update_group_lr(const Bundle& bundle, const StepFiles& current, const std::string& group, double lr) {
  const StepState state = bundle.load_state(current);
  if (state.lr_by_group.empty()) return lr;
  const std::optional<double> own = state.lr_of(group);
  if (!own) throw InputError(current.label("state.json"), "lr." + group, "required: optimizer group " + group + " has parameters");
  return *own;
}

// A whole parameter's update by a rule that reads all of it (Adafactor's norms,
// Muon's orthogonalisation), MuonClip after it; slices are cut from it.
torch::Tensor whole_update_prediction(const Bundle& bundle, const UpdateCheckInput& in, const SafetensorsFile& optimizer,
                               size_t i, const torch::Tensor& coef, double lr, const OptimizerRule& rule) {
  const OptimizerConfig& config = *bundle.manifest().optimizer;
  const std::string& name = in.checkpoint->order()[i];
  torch::Tensor expected = in.checkpoint->param(name).detach().clone();
  ParamState state = read_param_state(optimizer, name, expected.sizes().vec(), rule);
  update_param(expected, in.grads->grads[i].reshape(expected.sizes()) * coef, state, lr, rule,
               !excluded_from_decay(config, name));
  if (uses_qk_clip(config)) {
    apply_qk_clip(config, bundle.manifest().model, in.grads->attn_logit_max, {name},
                  [&](size_t) { return expected; }, [](size_t, const torch::Tensor&) {});
  }
  return expected;
}

}  // namespace

std::vector<Finding> update_findings(const Bundle& bundle, const UpdateCheckInput& in) {
  torch::NoGradGuard no_grad;
  const Manifest& m = bundle.manifest();
  const OptimizerConfig& config = *m.optimizer;
  const std::string optimizer_label = in.current->label("optimizer.safetensors");
  const SafetensorsFile optimizer = SafetensorsFile::open(in.current->optimizer.string(), optimizer_label);
  const SafetensorsFile next = SafetensorsFile::open(in.next->model.string(), in.next->label("model.safetensors"));
  const torch::Tensor coef = clip_coefficient(in.grads->grad_norm, config);
  const std::vector<std::string>& names = in.checkpoint->order();
  std::vector<Finding> findings;
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string& name = names[i];
    const ParamRule owner = rule_of_param(config, name);
    const OptimizerRule& rule = *owner.rule;
    const double lr = update_group_lr(bundle, *in.current, owner.group, in.lr);
    const UpdateContext at{in.current->step, in.next->step, next.label(), lr, optimizer_label_of(rule)};
    const TensorInfo& actual_info = next.at(name);
    // The next checkpoint and the state are read one slice at a time and
    // their pages dropped after each parameter, so the check holds one slice's
    // temporaries and no whole file resident beyond what the replay holds.
    // Rules that read the whole parameter predict it whole, then slice.
    const ReleaseWhenDone release_actual{next, actual_info};
    const torch::Tensor param = in.checkpoint->param(name).detach().reshape({actual_info.shape.empty() ? 1 : actual_info.shape[0], -1});
    const torch::Tensor grad = in.grads->grads[i].reshape(param.sizes());
    const bool decay = !excluded_from_decay(config, name);
    const int64_t updates_before = stored_update_count(optimizer, name);
    if (updates_before < 0 && elementwise_rule(rule)) (void)optimizer.at("step");  // missing: the error names it
    torch::Tensor whole;
    if (!in.skipped_by_scaler && !elementwise_rule(rule)) {
      whole = whole_update_prediction(bundle, in, optimizer, i, coef, lr, rule).reshape(param.sizes());
    }
    const StateLayout layout = state_layout(rule, actual_info.shape);
    const SlicePrediction predict = [&](int64_t row, int64_t count) {
      if (in.skipped_by_scaler) return param.narrow(0, row, count).clone();  // no update: model(s+1) = model(s)
      if (whole.defined()) return whole.narrow(0, row, count).clone();
      torch::Tensor expected = param.narrow(0, row, count).clone();
      ParamState state;
      state.step = updates_before;
      for (const auto& [key, shape] : layout) {
        (void)shape;
        const TensorInfo& info = optimizer.at(name + "." + key);
        state.tensors[key] = tensor_from_safetensors(tensor_rows(info, row, count), optimizer_label).clone().reshape(expected.sizes());
      }
      update_param(expected, grad.narrow(0, row, count) * coef, state, lr, rule, decay);
      return expected;
    };
    // A whole-tensor rule: 8 times the RMS of its own step of this parameter (for Muon 8 lr would
    // hide a flipped bit that its orthogonalized step of about lr / sqrt(width) would not explain).
    const double own_step = whole.defined() ? 8.0 * (whole - param).pow(2).mean().sqrt().item<double>() : -1;
    const double step_floor = std::isfinite(own_step) ? own_step : -1;
    const Deviations deviations = compare_with_stored(predict, actual_info, next.label(), lr, step_floor);
    if (!in.skipped_by_scaler) {
      for (const auto& [key, shape] : layout) optimizer.release(optimizer.at(name + "." + key));
    }
    in.checkpoint->release(name);  // a streamed replay's checkpoint is larger than memory
    const std::vector<Finding> found = deviation_findings(name, deviations, actual_info, at);
    findings.insert(findings.end(), found.begin(), found.end());
  }
  return findings;
}

std::vector<std::string> jumped_params(const StepFiles& before, const StepFiles& after, double factor) {
  const SafetensorsFile a = SafetensorsFile::open(before.model.string(), before.label("model.safetensors"));
  const SafetensorsFile b = SafetensorsFile::open(after.model.string(), after.label("model.safetensors"));
  std::vector<std::string> jumped;
  for (const TensorInfo& later : b.tensors()) {
    const TensorInfo* earlier = a.find(later.name);
    if (earlier == nullptr) continue;
    const TensorStats x = stats_of(*earlier), y = stats_of(later);
    a.release(*earlier);
    b.release(later);
    if (!x.all_finite() || !y.all_finite()) continue;  // CHECKPOINT_NONFINITE's to name
    const double lo = std::sqrt(std::min(x.sum_sq, y.sum_sq)), hi = std::sqrt(std::max(x.sum_sq, y.sum_sq));
    if (hi > 0 && hi >= factor * lo) jumped.push_back(later.name);
  }
  return jumped;
}

std::vector<Finding> derived_update_findings(const Bundle& bundle, const StepFiles& current, const StepFiles& next,
                                             const ModelCheckpoint& predicted, double lr) {
  torch::NoGradGuard no_grad;
  const SafetensorsFile stored = SafetensorsFile::open(next.model.string(), next.label("model.safetensors"));
  std::vector<Finding> findings;
  for (const std::string& name : predicted.order()) {
    const OptimizerRule& rule = *rule_of_param(*bundle.manifest().optimizer, name).rule;
    const UpdateContext at{current.step, next.step, stored.label(), lr, optimizer_label_of(rule)};
    const TensorInfo& actual_info = stored.at(name);
    const ReleaseWhenDone release_actual{stored, actual_info};
    const torch::Tensor value =
        predicted.param(name).detach().reshape({actual_info.shape.empty() ? 1 : actual_info.shape[0], -1});
    const SlicePrediction predict = [&](int64_t row, int64_t count) { return value.narrow(0, row, count).clone(); };
    const std::vector<Finding> found =
        deviation_findings(name, compare_with_stored(predict, actual_info, stored.label(), lr), actual_info, at);
    findings.insert(findings.end(), found.begin(), found.end());
  }
  return findings;
}

}  // namespace nanreplay
