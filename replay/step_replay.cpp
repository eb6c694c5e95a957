// See step_replay.h.
#include "replay/step_replay.h"

#include <stdexcept>
#include <string>

#include <torch/torch.h>

#include "replay/probe_session.h"

namespace nanreplay {

namespace {

const StepEntry& entry_for(const Manifest& m, int64_t step) {
  for (const StepEntry& entry : m.steps) {
    if (entry.step == step) return entry;
  }
  throw std::logic_error("no manifest entry for step " + std::to_string(step));
}

}  // namespace

StepBatch step_batch(const Bundle& bundle, int64_t step) {
  return StepBatch{bundle.sampler().samples_for(entry_for(bundle.manifest(), step))};
}

StepGradients replay_step(const Bundle& bundle, const StepFiles& files, const StepState& state,
                          const StepBatch& batch, ModelCheckpoint& checkpoint, bool probes,
                          const std::function<void(int, int, const char*)>& before_pass,
                          const ComputePlacement& placement) {
  const Manifest& m = bundle.manifest();
  checkpoint.place(placement, static_cast<int>(m.model.num_layers));
  StepComputeOptions compute;
  compute.native_low_precision = placement.native_low_precision;
  compute.probes = probes;
  compute.loss_scale = m.precision.compute == Compute::kFp16 ? state.loss_scale : 1.0;
  compute.fp8_scales = &state.fp8_scales;
  compute.before_pass = before_pass;
  StepGradients step = compute_step_gradients(m, bundle.tokens(), files.step, batch,
                                              checkpoint.compute_params(), checkpoint.order(), compute);
  if (probes) {
    for (size_t i = 0; i < step.grads.size(); ++i) {
      for (ProbeRecord& record : describe_tensor(step.grads[i], nullptr, {})) {
        record.step = files.step;
        record.phase = Phase::kGrad;
        record.order = static_cast<int>(i);
        record.site = checkpoint.order()[i];
        record.layer = layer_of_param(record.site);
        step.probes.push_back(std::move(record));
      }
    }
  }
  return step;
}

}  // namespace nanreplay
