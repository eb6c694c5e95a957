// Structural validation of a whole bundle; see bundle_structure.h. Key
// constraint: the messages are the ones the replay's own loaders give, so
// `inspect` and `run` name the same file and key for the same fault.
#include "replay/step/bundle_structure.h"

#include <sstream>
#include <vector>

#include "loaders/base/error.h"
#include "loaders/base/message_text.h"
#include "probes/sites.h"
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

void check_optimizer_state(const SafetensorsFile& optimizer, const ModelConfig& model) {
  const TensorInfo& step = optimizer.at("step");
  if ((step.dtype != DType::kI64 && step.dtype != DType::kF32) || step.numel() != 1) {
    throw InputError(optimizer.label(), "step", "expected an I64 or F32 scalar");
  }
  for (const ParamSpec& spec : parameters_backed_by(optimizer, model)) {
    for (const char* moment : {".exp_avg", ".exp_avg_sq"}) {
      const TensorInfo& info = optimizer.at(spec.name + moment);
      if (!is_parameter_dtype(info.dtype)) {
        throw InputError(optimizer.label(), info.name,
                         std::string("dtype ") + dtype_name(info.dtype) + " is not a moment type (expected F32, "
                                                                            "BF16 or F16)");
      }
      if (info.shape != spec.shape) {
        throw InputError(optimizer.label(), info.name,
                         "has shape " + bracketed_list(info.shape) + ", expected " + bracketed_list(spec.shape) +
                             " (the parameter's)");
      }
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
  }
}

void validate_bundle_structure(const Bundle& bundle) {
  const ModelConfig& model = bundle.manifest().model;
  check_roll_forward(bundle);
  for (const StepFiles& files : bundle.steps()) {
    (void)bundle.load_state(files);
    if (!files.has_model) continue;
    check_checkpoint_matches_model(SafetensorsFile::open(files.model.string(), files.label("model.safetensors")),
                                   model);
    if (bundle.has_optimizer(files)) {
      check_optimizer_state(SafetensorsFile::open(files.optimizer.string(), files.label("optimizer.safetensors")),
                            model);
    }
  }
  check_samples(bundle);
}

}  // namespace nanreplay
