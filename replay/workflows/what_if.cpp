// Parsing, checking and replaying what-ifs; see what_if.h. Each what-if kind
// is one row (what_if_rows: name, value, check, and the StepOverrides it
// makes); the bad step is scanned whole with those overrides (all passes, so
// the loss is the step's), then located with full probes when it is still
// non-finite.
#include "replay/workflows/what_if.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <sstream>

#include "loaders/base/error.h"
#include "loaders/base/message_text.h"
#include "probes/sites.h"
#include "replay/step/layer_stream.h"
#include "replay/step/step_scan.h"
#include "replay/workflows/qk_clip_what_if.h"
#include "reports/results/number_text.h"

namespace nanreplay {

namespace {

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
    // model.mtp's blocks too: every layer with sites.
    for (int layer = 0; layer < layers_with_sites(m.model); ++layer) overrides.numerics.fp32_layers.push_back(layer);
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

// The attention what-ifs change a llama's attention; gpt2 has another layout.
void llama_only(const WhatIf& w, const Manifest& m) {
  if (m.model.arch != Arch::kLlama) bad_spec(w.text, "the llama family's attention only: this bundle's model is gpt2");
}

// The qk-norm what-if normalises q_proj's and k_proj's heads, which latent attention has not.
void plain_attention_only(const WhatIf& w, const Manifest& m) {
  llama_only(w, m);
  if (m.model.latent_attention) {
    bad_spec(w.text, "q_proj and k_proj heads only: this bundle's model has model.latent_attention");
  }
}

void experts_only(const WhatIf& w, const Manifest& m) {
  if (!m.model.moe) bad_spec(w.text, "a mixture of experts' router only: this bundle's model has no model.moe");
}

void experts_mlp_only(const WhatIf& w, const Manifest& m) {
  if (!m.model.moe) bad_spec(w.text, "a mixture of experts' experts only: this bundle's model has no model.moe");
}

void fp8_only(const WhatIf& w, const Manifest& m) {
  if (m.precision.compute != Compute::kFp8) {
    bad_spec(w.text, std::string("the bundle computes in ") + compute_name(m.precision.compute) +
                         ": it has no fp8 scales to damp");
  }
}

// A layer of the decoder or one of model.mtp's blocks (num_layers + k - 1), whose sites name them so.
void layers_in_model(const WhatIf& w, const Manifest& m) {
  const int layers = layers_with_sites(m.model);
  const std::string mtp = layers > m.model.num_layers ? ", the last " + std::to_string(layers - m.model.num_layers) +
                                                            " of them model.mtp's blocks"
                                                      : "";
  for (int layer : w.layers) {
    if (layer >= layers) {
      bad_spec(w.text, "layer " + std::to_string(layer) + " is out of range: the model has " + std::to_string(layers) +
                           " layers (0-" + std::to_string(layers - 1) + mtp + ")");
    }
  }
}

void parse_layers(WhatIf& w, const std::string& value) {
  if (value == "all") {
    w.all_layers = true;
    return;
  }
  for (int64_t layer : parse_index_list(w.text, value, "layer")) {
    if (layer > 1000000) bad_spec(w.text, "layer " + std::to_string(layer) + " is out of range");
    w.layers.push_back(static_cast<int>(layer));
  }
}

// z-loss: the coefficient the router loss is taken with.
std::string z_loss(const WhatIf& w, const Manifest& m, StepOverrides& overrides) {
  experts_only(w, m);
  overrides.change_model = [coef = w.value](ModelConfig& model) {
    if (model.moe) model.moe->router_z_loss_coef = coef;
  };
  const double now = m.model.moe->router_z_loss_coef;
  if (w.value == now) return "no change: the router z-loss coefficient is already " + format_number(w.value);
  return "router z-loss coefficient " + format_number(now) + " -> " + format_number(w.value) +
         " (the loss and its gradient change; the forward values do not, so a forward overflow stays)";
}

// swiglu-clamp: GPT-OSS's clamp on every expert's gate (at most L) and up (within +-L) projections.
std::string swiglu_clamp(const WhatIf& w, const Manifest& m, StepOverrides& overrides) {
  experts_mlp_only(w, m);
  overrides.change_model = [limit = w.value](ModelConfig& model) {
    if (model.moe) model.moe->swiglu_limit = limit;
  };
  const std::optional<double>& now = m.model.moe->swiglu_limit;
  const std::string clamp = "the experts' gate clamped to at most " + format_number(w.value) + " and up to [-" +
                            format_number(w.value) + ", " + format_number(w.value) + "] before the activation";
  if (now && *now == w.value) return "no change: " + clamp + " already (model.moe.swiglu_limit)";
  return clamp + (now ? " (instead of " + format_number(*now) + ")" : "");
}

// router-bias=frozen: DeepSeek-V3's grouped router with the correction bias of the step before,
// as if the balancing rule had not updated it after that step ("did the bias update cause this?").
void grouped_router_only(const WhatIf& w, const Manifest& m) {
  if (!m.model.moe || m.model.moe->router != RouterKind::kSigmoidGrouped || !m.model.moe->score_bias) {
    bad_spec(w.text, "a correction bias only (DeepSeek-V3's router: model.moe.router \"sigmoid_grouped\" with "
                     "router_score_bias): this bundle's model has none");
  }
}

// window: the sliding layers' window, in keys (the query's own included, as sliding_window counts).
std::string sliding_window_change(const WhatIf& w, const Manifest& m, StepOverrides& overrides) {
  const auto window = static_cast<int64_t>(w.value);
  overrides.change_model = [window](ModelConfig& model) { model.sliding_window = window; };
  std::string layers;
  for (int layer = 0; layer < m.model.num_layers && !m.model.layer_types.empty(); ++layer) {
    if (m.model.attention_kind(layer) != AttentionKind::kSliding) continue;
    layers += (layers.empty() ? "" : ", ") + std::to_string(layer);
  }
  const std::string where = layers.empty() ? "every layer" : "the sliding layers (" + layers + ")";
  return "sliding window " + std::to_string(m.model.sliding_window) + " -> " + std::to_string(window) + " keys on " +
         where + (window == m.model.sliding_window ? " (no change)" : "");
}

// A what-if's value after '=': none, required, or optional (with the row's default).
enum class WhatIfValue { kNone, kRequired, kOptional };

// What one what-if is applied to: the bad step of the bundle.
struct WhatIfTarget {
  const Bundle& bundle;
  const LoadedStep& step;
  const Manifest& manifest;
};

// One what-if kind, everything about it: its spec, how its value parses,
// what the bundle must have for it, and what it changes in the step (its
// StepOverrides, which replay_step reads) with the sentence that says so.
struct WhatIfRow {
  WhatIf::Kind kind;
  const char* name;
  const char* example;
  const char* meaning;
  WhatIfValue value;
  // Reads the text after '=' into `w` (nullopt: an optional value left out). Null: no value.
  void (*parse)(WhatIf& w, const std::optional<std::string>& value);
  // Throws UsageError when the bundle cannot take it, before any replay. Null: any bundle can.
  void (*check)(const WhatIf& w, const Manifest& m);
  // Fills `overrides`; returns what they change, "no change: ..." when nothing.
  std::string (*apply)(const WhatIf& w, const WhatIfTarget& at, StepOverrides& overrides);
};

using WhatIfText = const std::optional<std::string>&;
using WhatIfAt = const WhatIfTarget&;

std::string router_bias_frozen(const WhatIf& w, const WhatIfTarget& at, StepOverrides& overrides) {
  grouped_router_only(w, at.manifest);
  const StepFiles* previous = previous_step(at.bundle, at.step.step());
  if (previous == nullptr) {
    return "no change: step " + std::to_string(at.step.step()) +
           " is the bundle's first step, so it keeps its own correction bias";
  }
  const std::map<int, std::vector<double>> before =
      router_score_bias_of(at.bundle.load_state(*previous), at.manifest.model);
  const std::map<int, std::vector<double>> now = router_score_bias_of(at.step.state(), at.manifest.model);
  double moved = 0.0;
  for (const auto& [layer, bias] : now) {
    for (size_t e = 0; e < bias.size(); ++e) moved = std::max(moved, std::fabs(bias[e] - before.at(layer)[e]));
  }
  overrides.change_model = [before](ModelConfig& model) {
    if (model.moe) model.moe->step_score_bias = before;
  };
  const std::string which = "the routers' correction bias of step " + std::to_string(previous->step) +
                            " in place of step " + std::to_string(at.step.step()) + "'s";
  return moved == 0.0 ? "no change: " + which + " are the same"
                      : which + " (largest change undone: " + format_number(moved) + ")";
}

double non_negative_value(const WhatIf& w, WhatIfText value, const char* what) {
  const double number = parse_number(w.text, *value);
  if (number < 0) bad_spec(w.text, std::string(what) + " must be >= 0");
  return number;
}

// In --help's order.
const std::vector<WhatIfRow>& what_if_rows() {
  // Each row: kind, name, example; meaning; value rule, parse; check; apply.
  static const std::vector<WhatIfRow> rows = {
      {WhatIf::Kind::kDropSamples, "drop-samples", "drop-samples=12,40",
       "remove these samples (dataset indices) from the bad step's batch",
       WhatIfValue::kRequired, [](WhatIf& w, WhatIfText v) { w.samples = parse_index_list(w.text, *v, "sample"); },
       nullptr,
       [](const WhatIf& w, WhatIfAt at, StepOverrides& o) { return drop_samples(w, at.step, o); }},
      {WhatIf::Kind::kFp32Layers, "fp32-layers", "fp32-layers=2,3 | fp32-layers=all",
       "compute these layers entirely in fp32 (no rounding, no fp8)",
       WhatIfValue::kRequired, [](WhatIf& w, WhatIfText v) { parse_layers(w, *v); },
       layers_in_model,
       [](const WhatIf& w, WhatIfAt at, StepOverrides& o) { return fp32_layers(w, at.manifest, o); }},
      {WhatIf::Kind::kNormEps, "norm-eps", "norm-eps=1e-5",
       "use this eps in every RMSNorm/LayerNorm",
       WhatIfValue::kRequired, [](WhatIf& w, WhatIfText v) { w.value = non_negative_value(w, v, "eps"); },
       nullptr,
       [](const WhatIf& w, WhatIfAt at, StepOverrides& o) {
         o.change_model = [eps = w.value](ModelConfig& model) { model.norm_eps = eps; };
         const double now = at.manifest.model.norm_eps;
         return "norm eps " + format_number(now) + " -> " + format_number(w.value) +
                (w.value == now ? " (no change)" : "");
       }},
      {WhatIf::Kind::kDampFp8Scale, "damp-fp8-scale", "damp-fp8-scale=3",
       "clamp each fp8 scale to within 3x (default) of the previous step's",
       WhatIfValue::kOptional,
       [](WhatIf& w, WhatIfText v) {
         w.value = v ? parse_number(w.text, *v) : 3.0;
         if (w.value < 1) bad_spec(w.text, "the factor must be >= 1 (1 keeps the previous step's scales)");
       },
       fp8_only,
       [](const WhatIf& w, WhatIfAt at, StepOverrides& o) { return damp_fp8_scale(w, at.bundle, at.step, o); }},
      {WhatIf::Kind::kStableSoftmax, "stable-softmax", "stable-softmax",
       "q k^T, scaling and softmax in fp32, never rounded (as a fused attention kernel)",
       WhatIfValue::kNone, nullptr,
       nullptr,
       [](const WhatIf&, WhatIfAt at, StepOverrides& o) {
         o.numerics.stable_softmax = true;
         const Compute compute = at.manifest.precision.compute;
         return std::string("attention q k^T, scaling and softmax kept in fp32") +
                (compute == Compute::kFp32 || compute == Compute::kFp8
                     ? " (no change: this bundle's attention scores are fp32 already)"
                     : "");
       }},
      {WhatIf::Kind::kQkNorm, "qk-norm", "qk-norm",
       "q and k RMS-normalised per head with unit weights before rotary (Qwen3's QK-norm; llama only)",
       WhatIfValue::kNone, nullptr,
       plain_attention_only,
       [](const WhatIf&, WhatIfAt at, StepOverrides& o) {
         // Unit weights: no checkpoint holds q_norm and k_norm weights for a model without them.
         o.change_model = [](ModelConfig& model) {
           if (model.qk_norm == QkNorm::kL2) model.l2_qk_norm_every_layer = true;  // Llama 4: NoPE layers too
           if (model.qk_norm != QkNorm::kNone) return;
           model.qk_norm = QkNorm::kHead;
           model.qk_norm_unit_weights = true;
         };
         const ModelConfig& m = at.manifest.model;
         const bool nope_layers =
             std::find(m.no_rope_layers.begin(), m.no_rope_layers.end(), 0) != m.no_rope_layers.end();
         if (m.qk_norm == QkNorm::kL2 && nope_layers) {
           return std::string("Llama 4's L2 QK-norm applied on its NoPE layers too (it normalises the rotary layers only)");
         }
         return m.qk_norm != QkNorm::kNone ? std::string("no change: the model normalises q and k already")
                                           : "q and k RMS-normalised per head (unit weights, eps " +
                                                 format_number(m.norm_eps) + ") before rotary";
       }},
      {WhatIf::Kind::kSoftcap, "softcap", "softcap=50",
       "the attention scores soft-capped, c * tanh(s / c), before softmax (Gemma 2; llama only)",
       WhatIfValue::kRequired,
       [](WhatIf& w, WhatIfText v) {
         w.value = parse_number(w.text, *v);
         if (!(w.value > 0) || !std::isfinite(w.value)) bad_spec(w.text, "the cap must be a finite number > 0");
       },
       llama_only,
       [](const WhatIf& w, WhatIfAt at, StepOverrides& o) {
         o.change_model = [cap = w.value](ModelConfig& model) { model.attn_logit_softcap = cap; };
         const std::optional<double>& now = at.manifest.model.attn_logit_softcap;
         return "attention scores soft-capped at " + format_number(w.value) +
                (now ? " (instead of " + format_number(*now) + ")" : "");
       }},
      {WhatIf::Kind::kRouterFp32, "router-fp32", "router-fp32",
       "a mixture of experts' router matmul and softmax in fp32, never rounded (model.moe only)",
       WhatIfValue::kNone, nullptr,
       experts_only,
       [](const WhatIf&, WhatIfAt at, StepOverrides& o) {
         o.numerics.router_fp32 = true;
         return std::string("router matmul and softmax kept in fp32") +
                (at.manifest.precision.compute == Compute::kFp32 ? " (no change: the bundle computes in fp32)" : "");
       }},
      {WhatIf::Kind::kZLoss, "z-loss", "z-loss=1e-3",
       "the router z-loss coefficient (ST-MoE: mean logsumexp(router logits)^2; model.moe only)",
       WhatIfValue::kRequired, [](WhatIf& w, WhatIfText v) { w.value = non_negative_value(w, v, "the coefficient"); },
       experts_only,
       [](const WhatIf& w, WhatIfAt at, StepOverrides& o) { return z_loss(w, at.manifest, o); }},
      {WhatIf::Kind::kSinksOff, "sinks", "sinks=off",
       "the softmax without the attention sinks' column (GPT-OSS; model.attention_sinks only)",
       WhatIfValue::kRequired,
       [](WhatIf& w, WhatIfText v) {
         if (*v != "off") bad_spec(w.text, "the only value is off (the model without its sink logits)");
       },
       [](const WhatIf& w, const Manifest& m) {
         if (!m.model.attention_sinks) bad_spec(w.text, "the bundle's model has no attention sinks (model.attention_sinks)");
       },
       [](const WhatIf&, WhatIfAt, StepOverrides& o) {
         o.change_model = [](ModelConfig& model) { model.attention_sinks = false; };
         return std::string("attention sinks off: each head's softmax over its keys only (the sink logits unread)");
       }},
      {WhatIf::Kind::kWindow, "window", "window=4",
       "the sliding layers' window in keys (model.sliding_window only; full-attention layers unchanged)",
       WhatIfValue::kRequired,
       [](WhatIf& w, WhatIfText v) {
         w.value = parse_number(w.text, *v);
         if (!(w.value >= 1) || w.value != std::floor(w.value) || w.value > 1e9) {
           bad_spec(w.text, "the window must be a whole number of keys >= 1");
         }
       },
       [](const WhatIf& w, const Manifest& m) {
         if (m.model.sliding_window <= 0) {
           bad_spec(w.text, "the bundle's model has no sliding window (model.sliding_window)");
         }
       },
       [](const WhatIf& w, WhatIfAt at, StepOverrides& o) { return sliding_window_change(w, at.manifest, o); }},
      {WhatIf::Kind::kSwigluClamp, "swiglu-clamp", "swiglu-clamp=7",
       "every expert's gate clamped to <= 7 and up to [-7, 7] before its activation, as GPT-OSS (model.moe only)",
       WhatIfValue::kRequired,
       [](WhatIf& w, WhatIfText v) {
         w.value = parse_number(w.text, *v);
         if (!(w.value > 0)) bad_spec(w.text, "the limit must be a finite number > 0");
       },
       experts_mlp_only,
       [](const WhatIf& w, WhatIfAt at, StepOverrides& o) { return swiglu_clamp(w, at.manifest, o); }},
      {WhatIf::Kind::kRouterBiasFrozen, "router-bias", "router-bias=frozen",
       "the step replayed with the previous step's router correction bias (DeepSeek-V3's sigmoid_grouped only)",
       WhatIfValue::kRequired,
       [](WhatIf& w, WhatIfText v) {
         if (*v != "frozen") bad_spec(w.text, "the only value is frozen (the previous step's correction bias)");
       },
       grouped_router_only, router_bias_frozen},
      {WhatIf::Kind::kQkClip, "qk-clip", "qk-clip=100",
       "MuonClip at tau: each head whose largest logit of the step exceeds tau gets its q and k rows scaled by "
       "sqrt(tau / max) (Kimi K2; llama only)",
       WhatIfValue::kRequired,
       [](WhatIf& w, WhatIfText v) {
         w.value = parse_number(w.text, *v);
         if (!(w.value > 0)) bad_spec(w.text, "tau must be a finite number > 0");
       },
       llama_only,  // model.mtp's blocks too: their heads are "layer num_layers + k - 1" as their sites name them
       [](const WhatIf& w, WhatIfAt, StepOverrides&) { return "MuonClip at tau " + format_number(w.value); }},
  };
  return rows;
}

const WhatIfRow& what_if_row(WhatIf::Kind kind) {
  for (const WhatIfRow& row : what_if_rows()) {
    if (row.kind == kind) return row;
  }
  throw std::logic_error("a what-if kind without its row");
}

}  // namespace

WhatIf parse_what_if(const std::string& text) {
  const size_t eq = text.find('=');
  const std::string name = text.substr(0, eq);
  const std::optional<std::string> value = eq == std::string::npos ? std::nullopt : std::optional(text.substr(eq + 1));
  const auto& rows = what_if_rows();
  const auto row = std::find_if(rows.begin(), rows.end(), [&](const WhatIfRow& r) { return name == r.name; });
  if (row == rows.end()) {
    std::string names;
    for (const WhatIfRow& r : rows) names += std::string(names.empty() ? "" : ", ") + r.name;
    bad_spec(text, "unknown kind '" + name + "'; known: " + names);
  }
  if (row->value == WhatIfValue::kNone && value) bad_spec(text, std::string(row->name) + " takes no value");
  if (row->value == WhatIfValue::kRequired && (!value || value->empty())) {
    bad_spec(text, "needs a value, e.g. " + std::string(row->example));
  }
  WhatIf w;
  w.kind = row->kind;
  w.text = text;
  if (row->parse) row->parse(w, value);
  return w;
}

void check_what_if(const WhatIf& w, const Manifest& manifest) {
  const WhatIfRow& row = what_if_row(w.kind);
  if (row.check) row.check(w, manifest);
}

std::string what_if_help() {
  std::ostringstream out;
  out << "what-ifs (repeatable; each replays the first non-finite step once with one change):\n";
  for (const WhatIfRow& row : what_if_rows()) {
    out << "  " << std::left << std::setw(36) << row.example << row.meaning << "\n";
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
    overrides.emplace_back();
    outcome.change = what_if_row(w.kind).apply(w, WhatIfTarget{bundle, step, bundle.manifest()}, overrides.back());
    outcomes.push_back(outcome);
  }
  const std::vector<std::string> contaminated = step.nonfinite_params();
  for (size_t i = 0; i < outcomes.size(); ++i) {
    WhatIfOutcome& outcome = outcomes[i];
    std::optional<LoadedStep> clipped;  // qk-clip: the step on its clipped q and k weights (qk_clip_what_if.h)
    if (what_ifs[i].kind == WhatIf::Kind::kQkClip) {
      outcome.change = qk_clip_step(step, what_ifs[i].value, placement, before_pass, clipped, outcome.replays);
    }
    LoadedStep& target = clipped ? *clipped : step;
    const StepScan scan = scan_step(target, overrides[i], /*stop_at_first_bad=*/false, before_pass);
    outcome.replays += scan.passes;
    outcome.resolved = !scan.bad;
    outcome.loss_after = scan.loss;
    outcome.scaler_skipped = scan.scaler_skips;
    if (scan.bad) {
      outcome.after = locate_first(target, overrides[i], scan, outcome.replays, before_pass);
      outcome.after->contaminated_params = contaminated;
    }
  }
  return outcomes;
}

}  // namespace nanreplay
