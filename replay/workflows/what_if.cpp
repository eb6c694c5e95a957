// Parsing, checking and replaying what-ifs; see what_if.h. Each what-if is
// turned into StepOverrides and the bad step is scanned whole with them (all
// passes, so the loss is the step's), then located with full probes when it
// is still non-finite.
#include "replay/workflows/what_if.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <sstream>

#include "loaders/base/error.h"
#include "loaders/base/message_text.h"
#include "replay/step/layer_stream.h"
#include "replay/step/step_scan.h"
#include "reports/results/number_text.h"

namespace nanreplay {

namespace {

struct KindInfo {
  WhatIf::Kind kind;
  const char* name;
  const char* example;
  const char* meaning;
};

const std::vector<KindInfo>& kinds() {
  static const std::vector<KindInfo> table = {
      {WhatIf::Kind::kDropSamples, "drop-samples", "drop-samples=12,40",
       "remove these samples (dataset indices) from the bad step's batch"},
      {WhatIf::Kind::kFp32Layers, "fp32-layers", "fp32-layers=2,3 | fp32-layers=all",
       "compute these layers entirely in fp32 (no rounding, no fp8)"},
      {WhatIf::Kind::kNormEps, "norm-eps", "norm-eps=1e-5", "use this eps in every RMSNorm/LayerNorm"},
      {WhatIf::Kind::kDampFp8Scale, "damp-fp8-scale", "damp-fp8-scale=3",
       "clamp each fp8 scale to within 3x (default) of the previous step's"},
      {WhatIf::Kind::kStableSoftmax, "stable-softmax", "stable-softmax",
       "q k^T, scaling and softmax in fp32, never rounded (as a fused attention kernel)"},
      {WhatIf::Kind::kQkNorm, "qk-norm", "qk-norm",
       "q and k RMS-normalised per head with unit weights before rotary (Qwen3's QK-norm; llama only)"},
      {WhatIf::Kind::kSoftcap, "softcap", "softcap=50",
       "the attention scores soft-capped, c * tanh(s / c), before softmax (Gemma 2; llama only)"},
      {WhatIf::Kind::kRouterFp32, "router-fp32", "router-fp32",
       "a mixture of experts' router matmul and softmax in fp32, never rounded (model.moe only)"},
      {WhatIf::Kind::kZLoss, "z-loss", "z-loss=1e-3",
       "the router z-loss coefficient (ST-MoE: mean logsumexp(router logits)^2; model.moe only)"},
  };
  return table;
}

[[noreturn]] void bad_spec(const std::string& text, const std::string& why) {
  throw UsageError("--what-if '" + printable(text) + "': " + why);
}

std::vector<int64_t> parse_index_list(const std::string& text, const std::string& list, const char* what) {
  std::vector<int64_t> values;
  std::stringstream items(list);
  std::string item;
  while (std::getline(items, item, ',')) {
    if (item.empty() || item.size() > 12 || item.find_first_not_of("0123456789") != std::string::npos) {
      bad_spec(text, "'" + item + "' is not a " + what + " (a non-negative integer)");
    }
    const int64_t value = std::stoll(item);
    if (std::find(values.begin(), values.end(), value) != values.end()) {
      bad_spec(text, std::string(what) + " " + item + " is listed twice");
    }
    values.push_back(value);
  }
  if (values.empty() || list.back() == ',') bad_spec(text, std::string("expected a list of ") + what + "s, e.g. 12,40");
  return values;
}

double parse_number(const std::string& text, const std::string& value) {
  size_t used = 0;
  double number = 0.0;
  try {
    number = std::stod(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != value.size() || !std::isfinite(number)) bad_spec(text, "'" + value + "' is not a number");
  return number;
}

constexpr size_t kValuesShown = 16;  // of a what-if's samples or layers, in its description

const StepFiles* previous_step(const Bundle& bundle, int64_t step) {
  const StepFiles* previous = nullptr;
  for (const StepFiles& files : bundle.steps()) {
    if (files.step == step) return previous;
    previous = &files;
  }
  return nullptr;
}

// Each fp8 scale of the bad step clamped to [previous / factor, previous * factor];
// a NaN scale takes the previous one. Describes every scale it changed.
std::map<std::string, Fp8ModuleScales> damped_scales(const StepState& bad, const StepState& previous,
                                                     double factor, std::vector<std::string>& changed) {
  std::map<std::string, Fp8ModuleScales> scales = bad.fp8_scales;
  for (auto& [module, current] : scales) {
    const auto found = previous.fp8_scales.find(module);
    const Fp8ModuleScales before = found != previous.fp8_scales.end() ? found->second : Fp8ModuleScales{};
    const std::pair<const char*, std::optional<double> Fp8ModuleScales::*> tensors[] = {
        {"input", &Fp8ModuleScales::input}, {"weight", &Fp8ModuleScales::weight},
        {"grad_output", &Fp8ModuleScales::grad_output}};
    for (const auto& [tensor, member] : tensors) {
      // A scale the job did not record is 1, as the replay takes it.
      const double now = (current.*member).value_or(1.0);
      const double then = (before.*member).value_or(1.0);
      if (!(std::isfinite(then) && then > 0)) continue;  // nothing sane to damp against
      const double damped = std::isnan(now) ? then : std::clamp(now, then / factor, then * factor);
      if (damped == now) continue;
      current.*member = damped;
      changed.push_back(module + " " + tensor + " " + format_number(now) + " -> " + format_number(damped));
    }
  }
  return scales;
}

// drop-samples: every named sample must be read by the step, and one must be left.
std::string drop_samples(const WhatIf& w, const LoadedStep& step, StepOverrides& overrides) {
  const std::string in_step = "step " + std::to_string(step.step());
  const std::vector<int64_t> read = step.samples();
  for (int64_t sample : w.samples) {
    if (std::find(read.begin(), read.end(), sample) == read.end()) {
      bad_spec(w.text, "sample " + std::to_string(sample) + " is not read by " + in_step +
                           " (its samples: " + comma_list(read, kValuesShown) + ")");
    }
    overrides.dropped_samples.insert(sample);
  }
  if (overrides.dropped_samples.size() == read.size()) {
    bad_spec(w.text, "it drops every sample of " + in_step + ": nothing would be replayed");
  }
  return (w.samples.size() == 1 ? "sample " : "samples ") + comma_list(w.samples, kValuesShown) + " removed from " +
         in_step + " (" + std::to_string(read.size() - w.samples.size()) + " of " + std::to_string(read.size()) +
         " samples left)";
}

std::string fp32_layers(const WhatIf& w, const Manifest& m, StepOverrides& overrides) {
  if (w.all_layers) {
    for (int layer = 0; layer < m.model.num_layers; ++layer) overrides.numerics.fp32_layers.push_back(layer);
  } else {
    overrides.numerics.fp32_layers = w.layers;
  }
  std::vector<int64_t> shown(overrides.numerics.fp32_layers.begin(), overrides.numerics.fp32_layers.end());
  const std::string which =
      w.all_layers ? "every layer" : (shown.size() == 1 ? "layer " : "layers ") + comma_list(shown, kValuesShown);
  std::string change = which + " computed in fp32";
  if (m.precision.compute == Compute::kFp32) change += " (no change: the bundle computes in fp32)";
  return change;
}

// damp-fp8-scale: against the step before, which must be in the bundle.
std::string damp_fp8_scale(const WhatIf& w, const Bundle& bundle, const LoadedStep& step, StepOverrides& overrides) {
  const StepFiles* previous = previous_step(bundle, step.step());
  if (previous == nullptr) {
    bad_spec(w.text, "step " + std::to_string(step.step()) +
                         " is the bundle's first step: there is no earlier scale to damp against");
  }
  std::vector<std::string> changed;
  overrides.fp8_scales = damped_scales(step.state(), bundle.load_state(*previous), w.value, changed);
  std::string list;
  for (size_t i = 0; i < changed.size(); ++i) list += (i ? "; " : "") + changed[i];
  return changed.empty() ? "no fp8 scale moved more than " + format_number(w.value) + "x since step " +
                               std::to_string(previous->step) + ": nothing damped"
                         : "fp8 scales clamped to " + format_number(w.value) + "x of step " +
                               std::to_string(previous->step) + "'s: " + list;
}

// The overrides one what-if makes on `step`, and a sentence saying what they change.
StepOverrides overrides_for(const WhatIf& w, const Bundle& bundle, const LoadedStep& step, std::string& change) {
  const Manifest& m = bundle.manifest();
  StepOverrides overrides;
  switch (w.kind) {
    case WhatIf::Kind::kDropSamples:
      change = drop_samples(w, step, overrides);
      break;
    case WhatIf::Kind::kFp32Layers:
      change = fp32_layers(w, m, overrides);
      break;
    case WhatIf::Kind::kNormEps:
      overrides.norm_eps = w.value;
      change = "norm eps " + format_number(m.model.norm_eps) + " -> " + format_number(w.value);
      if (w.value == m.model.norm_eps) change += " (no change)";
      break;
    case WhatIf::Kind::kDampFp8Scale:
      change = damp_fp8_scale(w, bundle, step, overrides);
      break;
    case WhatIf::Kind::kStableSoftmax:
      overrides.numerics.stable_softmax = true;
      change = "attention q k^T, scaling and softmax kept in fp32";
      if (m.precision.compute == Compute::kFp32 || m.precision.compute == Compute::kFp8) {
        change += " (no change: this bundle's attention scores are fp32 already)";
      }
      break;
    case WhatIf::Kind::kQkNorm:
      overrides.qk_norm = true;
      change = m.model.qk_norm != QkNorm::kNone ? "no change: the model normalises q and k already"
                                                : "q and k RMS-normalised per head (unit weights, eps " +
                                                      format_number(m.model.norm_eps) + ") before rotary";
      break;
    case WhatIf::Kind::kSoftcap:
      overrides.attn_logit_softcap = w.value;
      change = "attention scores soft-capped at " + format_number(w.value) +
               (m.model.attn_logit_softcap ? " (instead of " + format_number(*m.model.attn_logit_softcap) + ")" : "");
      break;
    case WhatIf::Kind::kRouterFp32:
      overrides.numerics.router_fp32 = true;
      change = "router matmul and softmax kept in fp32";
      if (m.precision.compute == Compute::kFp32) change += " (no change: the bundle computes in fp32)";
      break;
    case WhatIf::Kind::kZLoss:
      if (!m.model.moe) bad_spec(w.text, "a mixture of experts' router only: this bundle's model has no model.moe");
      overrides.router_z_loss_coef = w.value;
      change = "router z-loss coefficient " + format_number(m.model.moe->router_z_loss_coef) + " -> " +
               format_number(w.value) +
               " (the loss and its gradient change; the forward values do not, so a forward overflow stays)";
      if (w.value == m.model.moe->router_z_loss_coef) {
        change = "no change: the router z-loss coefficient is already " + format_number(w.value);
      }
      break;
  }
  return overrides;
}

}  // namespace

WhatIf parse_what_if(const std::string& text) {
  const size_t eq = text.find('=');
  const std::string name = text.substr(0, eq);
  const std::optional<std::string> value = eq == std::string::npos ? std::nullopt : std::optional(text.substr(eq + 1));
  const auto info = std::find_if(kinds().begin(), kinds().end(), [&](const KindInfo& k) { return name == k.name; });
  if (info == kinds().end()) {
    std::string names;
    for (const KindInfo& k : kinds()) names += std::string(names.empty() ? "" : ", ") + k.name;
    bad_spec(text, "unknown kind '" + name + "'; known: " + names);
  }
  WhatIf w;
  w.kind = info->kind;
  w.text = text;
  const bool takes_value = w.kind != WhatIf::Kind::kStableSoftmax && w.kind != WhatIf::Kind::kQkNorm &&
                           w.kind != WhatIf::Kind::kRouterFp32;
  const bool value_optional = w.kind == WhatIf::Kind::kDampFp8Scale;
  if (!takes_value && value) bad_spec(text, std::string(info->name) + " takes no value");
  if (takes_value && !value_optional && (!value || value->empty())) {
    bad_spec(text, "needs a value, e.g. " + std::string(info->example));
  }
  switch (w.kind) {
    case WhatIf::Kind::kDropSamples:
      w.samples = parse_index_list(text, *value, "sample");
      break;
    case WhatIf::Kind::kFp32Layers:
      if (*value == "all") {
        w.all_layers = true;
      } else {
        for (int64_t layer : parse_index_list(text, *value, "layer")) {
          if (layer > 1000000) bad_spec(text, "layer " + std::to_string(layer) + " is out of range");
          w.layers.push_back(static_cast<int>(layer));
        }
      }
      break;
    case WhatIf::Kind::kNormEps:
      w.value = parse_number(text, *value);
      if (w.value < 0) bad_spec(text, "eps must be >= 0");
      break;
    case WhatIf::Kind::kDampFp8Scale:
      w.value = value ? parse_number(text, *value) : 3.0;
      if (w.value < 1) bad_spec(text, "the factor must be >= 1 (1 keeps the previous step's scales)");
      break;
    case WhatIf::Kind::kSoftcap:
      w.value = parse_number(text, *value);
      if (!(w.value > 0) || !std::isfinite(w.value)) bad_spec(text, "the cap must be a finite number > 0");
      break;
    case WhatIf::Kind::kZLoss:
      w.value = parse_number(text, *value);
      if (w.value < 0) bad_spec(text, "the coefficient must be >= 0");
      break;
    case WhatIf::Kind::kStableSoftmax:
    case WhatIf::Kind::kQkNorm:
    case WhatIf::Kind::kRouterFp32:
      break;
  }
  return w;
}

void check_what_if(const WhatIf& w, const Manifest& manifest) {
  if (w.kind == WhatIf::Kind::kFp32Layers) {
    for (int layer : w.layers) {
      if (layer >= manifest.model.num_layers) {
        bad_spec(w.text, "layer " + std::to_string(layer) + " is out of range: the model has " +
                             std::to_string(manifest.model.num_layers) + " layers (0-" +
                             std::to_string(manifest.model.num_layers - 1) + ")");
      }
    }
  }
  if ((w.kind == WhatIf::Kind::kQkNorm || w.kind == WhatIf::Kind::kSoftcap) && manifest.model.arch != Arch::kLlama) {
    bad_spec(w.text, "the llama family's attention only: this bundle's model is gpt2");
  }
  if ((w.kind == WhatIf::Kind::kRouterFp32 || w.kind == WhatIf::Kind::kZLoss) && !manifest.model.moe) {
    bad_spec(w.text, "a mixture of experts' router only: this bundle's model has no model.moe");
  }
  if (w.kind == WhatIf::Kind::kDampFp8Scale && manifest.precision.compute != Compute::kFp8) {
    bad_spec(w.text, std::string("the bundle computes in ") + compute_name(manifest.precision.compute) +
                         ": it has no fp8 scales to damp");
  }
}

std::string what_if_help() {
  std::ostringstream out;
  out << "what-ifs (repeatable; each replays the first non-finite step once with one change):\n";
  for (const KindInfo& k : kinds()) {
    out << "  " << std::left << std::setw(36) << k.example << k.meaning << "\n";
  }
  return out.str();
}

std::vector<WhatIfOutcome> evaluate_what_ifs(const Bundle& bundle, const std::optional<FirstNonfinite>& origin,
                                             const std::vector<WhatIf>& what_ifs,
                                             const std::function<void()>& before_pass,
                                             const std::vector<std::string>& devices, bool native_low_precision,
                                             const std::optional<std::filesystem::path>& stream_scratch) {
  std::vector<WhatIfOutcome> outcomes;
  if (what_ifs.empty()) return outcomes;
  if (!origin) {
    for (const WhatIf& w : what_ifs) {
      WhatIfOutcome outcome;
      outcome.what_if = w.text;
      outcome.change = "not replayed: no step went non-finite";
      outcomes.push_back(outcome);
    }
    return outcomes;
  }
  // A what-if replays on the run's devices; a split model stays split.
  const ComputePlacement placement = streamed_if(
      placement_for(devices, native_low_precision, bundle.manifest().precision.compute), stream_scratch);
  LoadedStep step(bundle, origin->step, placement);
  // Every what-if is checked against the step before the first replay.
  std::vector<StepOverrides> overrides;
  for (const WhatIf& w : what_ifs) {
    WhatIfOutcome outcome;
    outcome.what_if = w.text;
    outcome.step = origin->step;
    outcome.before = origin;
    overrides.push_back(overrides_for(w, bundle, step, outcome.change));
    outcomes.push_back(outcome);
  }
  const std::vector<std::string> contaminated = step.nonfinite_params();
  for (size_t i = 0; i < outcomes.size(); ++i) {
    WhatIfOutcome& outcome = outcomes[i];
    const StepScan scan = scan_step(step, overrides[i], /*stop_at_first_bad=*/false, before_pass);
    outcome.replays = scan.passes;
    outcome.resolved = !scan.bad;
    outcome.loss_after = scan.loss;
    outcome.scaler_skipped = scan.scaler_skips;
    if (scan.bad) {
      outcome.after = locate_first(step, overrides[i], scan, outcome.replays, before_pass);
      outcome.after->contaminated_params = contaminated;
    }
  }
  return outcomes;
}

}  // namespace nanreplay
