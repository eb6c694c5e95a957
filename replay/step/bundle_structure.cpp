// Structural validation of a whole bundle; see bundle_structure.h. Key
// constraint: the messages are the ones the replay's own loaders give, so
// `inspect` and `run` name the same file and key for the same fault.
#include "replay/step/bundle_structure.h"

#include <algorithm>
#include <sstream>
#include <vector>

#include "loaders/base/error.h"
#include "loaders/base/message_text.h"
#include "loaders/bundle/optimizer_manifest.h"
#include "probes/sites.h"
#include "replay/optim/state_layout.h"
#include "replay/step/memory_estimate.h"

namespace nanreplay {

namespace {

// A count held in a double (it may exceed 64 bits), written whole.
std::string format_text_count(double count) {
  std::ostringstream out;
  out.precision(0);
  out << std::fixed << count;
  return out.str();
}

bool is_parameter_dtype(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16;
}

// The parameter list, once its length is known to be backed by the file: a
// manifest claiming more layers than the checkpoint has tensors cannot make
// this build a list of that size (inspect runs no memory estimate first).
std::vector<ParamSpec> parameters_backed_by(const SafetensorsFile& file, const ModelConfig& model) {
  if (model.num_layers > static_cast<int64_t>(file.tensors().size())) {
    throw InputError(file.label(), "",
                     "does not match the manifest's " + std::string(arch_name(model.arch)) + " model: it has " +
                         std::to_string(model.num_layers) + " layers, the file holds only " +
                         std::to_string(file.tensors().size()) + " tensors");
  }
  // Likewise a billion experts in a few layers: counted first. Up to a million
  // tensors (~100 MB of list) the list is built and the mismatch named tensor
  // by tensor; beyond that only a file holding that many tensors gets a list.
  constexpr double kListedCheaply = 1 << 20;
  const double described = count_model_parameters(model).tensors;
  if (described > kListedCheaply && described > static_cast<double>(file.tensors().size())) {
    throw InputError(file.label(), "",
                     "does not match the manifest's " + std::string(arch_name(model.arch)) + " model: it has " +
                         format_text_count(described) + " parameter tensors, the file holds only " +
                         std::to_string(file.tensors().size()) + " tensors");
  }
  return expected_parameters(model);
}

std::string first_problems(const std::vector<std::string>& problems) {
  std::string text;
  for (size_t i = 0; i < problems.size(); ++i) {
    if (i == 6) {
      text += "; and " + std::to_string(problems.size() - i) + " more";
      break;
    }
    text += (i ? "; " : "") + problems[i];
  }
  return text;
}

void check_samples(const Bundle& bundle) {
  const Manifest& m = bundle.manifest();
  for (const StepEntry& entry : m.steps) {
    (void)bundle.sampler().samples_for(entry);
    // The replay compares recorded samples with randperm's, which needs the step inside the epoch.
    if (m.data.sampler.kind == SamplerSpec::Kind::kRandperm) (void)bundle.sampler().randperm_samples(entry.step);
  }
}

}  // namespace

void check_checkpoint_matches_model(const SafetensorsFile& checkpoint, const ModelConfig& model) {
  const std::vector<ParamSpec> expected = parameters_backed_by(checkpoint, model);
  std::vector<std::string> problems;
  for (const ParamSpec& spec : expected) {
    const TensorInfo* info = checkpoint.find(spec.name);
    if (info == nullptr) {
      problems.push_back("missing " + spec.name);
    } else if (info->shape != spec.shape) {
      problems.push_back(spec.name + " has shape " + bracketed_list(info->shape) + ", expected " + bracketed_list(spec.shape));
    }
  }
  if (!problems.empty()) {
    throw InputError(checkpoint.label(), "",
                     "does not match the manifest's " + std::string(arch_name(model.arch)) +
                         " model: " + first_problems(problems));
  }
  for (const ParamSpec& spec : expected) {
    const TensorInfo& info = checkpoint.at(spec.name);
    if (!is_parameter_dtype(info.dtype)) {
      throw InputError(checkpoint.label(), info.name,
                       std::string("dtype ") + dtype_name(info.dtype) +
                           " is not a parameter type (expected F32, BF16 or F16)");
    }
  }
}

void check_optimizer_state(const SafetensorsFile& optimizer, const ModelConfig& model, const OptimizerConfig& config) {
  for (const ParamSpec& spec : parameters_backed_by(optimizer, model)) {
    const OptimizerRule& rule = *rule_of_param(config, spec.name).rule;
    const TensorInfo* own_step = optimizer.find(spec.name + ".step");
    const bool counted = own_step != nullptr || optimizer.find("step") != nullptr;
    if (counted || rule.kind != OptimizerKind::kMuon) {  // Muon keeps no step count
      const TensorInfo& step = own_step != nullptr ? *own_step : optimizer.at("step");
      if ((step.dtype != DType::kI64 && step.dtype != DType::kF32 && step.dtype != DType::kF64) || step.numel() != 1) {
        throw InputError(optimizer.label(), step.name, "expected an I64, F32 or F64 scalar");
      }
    }
    for (const auto& [key, shape] : state_layout(rule, spec.shape)) {
      const TensorInfo& info = optimizer.at(spec.name + "." + key);
      if (!is_parameter_dtype(info.dtype)) {
        throw InputError(optimizer.label(), info.name,
                         std::string("dtype ") + dtype_name(info.dtype) + " is not a moment type (expected F32, "
                                                                            "BF16 or F16)");
      }
      // torch's Adafactor factors may be saved without their kept dimension: same elements, accepted.
      int64_t elements = 1;
      for (int64_t d : shape) elements *= d;
      const bool same = info.shape == shape || (rule.kind == OptimizerKind::kAdafactor && info.numel() == elements);
      if (!same) {
        throw InputError(optimizer.label(), info.name,
                         "has shape " + bracketed_list(info.shape) + ", expected " + bracketed_list(shape) + " (" +
                             optimizer_class_name(rule.kind) + " state of a parameter of shape " +
                             bracketed_list(spec.shape) + ")");
      }
    }
  }
}

void check_optimizer_state(const SafetensorsFile& optimizer, const ModelConfig& model) {
  check_optimizer_state(optimizer, model, OptimizerConfig{});
}

// Muon takes matrices only (its class refuses anything else), and MuonClip
// rescales the q and k heads of the llama family's attention (latent attention's too).
void check_optimizer_fits_model(const Manifest& m) {
  if (!m.optimizer) return;
  const OptimizerConfig& config = *m.optimizer;
  const bool muon = config.kind == OptimizerKind::kMuon ||
                    std::any_of(config.groups.begin(), config.groups.end(),
                                [](const OptimizerGroup& g) { return g.rule.kind == OptimizerKind::kMuon; });
  if (!muon) return;
  for (const ParamSpec& spec : expected_parameters(m.model)) {
    const ParamRule owner = rule_of_param(config, spec.name);
    if (owner.rule->kind == OptimizerKind::kMuon && spec.shape.size() != 2) {
      throw InputError("manifest.json", owner.group == "default" ? "optimizer.kind" : "optimizer.groups",
                       "torch.optim.Muon takes 2-D parameters only; " + spec.name + " has shape " +
                           bracketed_list(spec.shape) + " (give it a group of another kind)");
    }
  }
  if (uses_qk_clip(config) && m.model.arch != Arch::kLlama) {
    throw InputError("manifest.json", "optimizer.qk_clip",
                     "MuonClip rescales q_proj and k_proj heads (the llama family); this model has no separate ones");
  }
}

// Each step whose update the replay derives needs the lr of every group with parameters.
void check_group_lrs(const Bundle& bundle, const StepFiles& files) {
  const StepState state = bundle.load_state(files);
  if (state.lr_by_group.empty()) return;
  for (const ParamSpec& spec : expected_parameters(bundle.manifest().model)) {
    const std::string group = rule_of_param(*bundle.manifest().optimizer, spec.name).group;
    if (!state.lr_of(group)) {
      throw InputError(files.label("state.json"), "lr." + group,
                       "required: optimizer group " + group + " holds " + spec.name + " (\"default\": the top level)");
    }
  }
}

// A step without a checkpoint starts from the tool's own update of the step
// before it: that step must be listed, and its lr known; the first step's
// AdamW state is where the moments come from.
void check_roll_forward(const Bundle& bundle) {
  const std::vector<StepFiles>& steps = bundle.steps();
  if (!bundle.rolls_forward()) return;
  if (!bundle.manifest().optimizer) {
    throw InputError("manifest.json", "optimizer",
                     "required: later steps have no checkpoint, so the replay applies AdamW itself");
  }
  if (!bundle.has_optimizer(steps.front())) {
    throw InputError(steps.front().label("optimizer.safetensors"), "",
                     "missing: later steps have no checkpoint, so the replay rolls forward from this step's "
                     "parameters and AdamW state");
  }
  for (size_t i = 1; i < steps.size(); ++i) {
    if (steps[i].has_model) continue;
    const StepFiles& previous = steps[i - 1];
    if (previous.step + 1 != steps[i].step) {
      throw InputError("manifest.json", "steps",
                       "a gap before step " + std::to_string(steps[i].step) + " (step " +
                           std::to_string(steps[i].step - 1) +
                           " is not listed), which has no model.safetensors: a derived step starts from the "
                           "update of the step before it");
    }
    if (!bundle.load_state(previous).lr) {
      throw InputError(previous.label("state.json"), "lr",
                       "required: step " + std::to_string(steps[i].step) +
                           " has no checkpoint and starts from this step's update");
    }
    check_group_lrs(bundle, previous);
  }
}

void validate_bundle_structure(const Bundle& bundle) {
  const ModelConfig& model = bundle.manifest().model;
  // Before the optimizer files are read: a Muon group over a vector is the manifest's fault, named there.
  // (It lists the parameters only when a Muon rule exists: absurd model sizes are refused by the
  // checkpoint check, which counts before listing, and that runs after.)
  check_optimizer_fits_model(bundle.manifest());
  check_roll_forward(bundle);
  for (const StepFiles& files : bundle.steps()) {
    (void)bundle.load_state(files);
    if (!files.has_model) continue;
    check_checkpoint_matches_model(SafetensorsFile::open(files.model.string(), files.label("model.safetensors")),
                                   model);
    if (bundle.has_optimizer(files)) {
      check_optimizer_state(SafetensorsFile::open(files.optimizer.string(), files.label("optimizer.safetensors")),
                            model, bundle.manifest().optimizer.value_or(OptimizerConfig{}));
    }
  }
  check_samples(bundle);
}

}  // namespace nanreplay
