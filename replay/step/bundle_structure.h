// Everything about a bundle's structure that `run` needs, checked before any
// replay, and the one place both `run` and `inspect` check it: every step's
// state.json; every checkpoint's header, tensor names, dtypes and shapes
// against the manifest's model; every optimizer state's header, step count and
// moments; every step's samples (explicit indices in range, randperm steps
// inside the epoch). Passing means `run` will not reject the bundle for its
// structure; it says nothing about whether the bundle is faithful to the run
// (only a replay that reproduces the logged losses shows that). Headers are
// read through the mappings; no tensor data is touched.
#pragma once

#include "loaders/bundle/bundle.h"
#include "loaders/formats/safetensors.h"

namespace nanreplay {

// Throws InputError naming the file and the key (tensor, manifest key path).
void validate_bundle_structure(const Bundle& bundle);

// The checkpoint holds every parameter of `model` with the expected shape and
// a parameter dtype (F32, BF16, F16). One error lists what is missing or
// mismatched; names `checkpoint.label()`.
void check_checkpoint_matches_model(const SafetensorsFile& checkpoint, const ModelConfig& model);

// AdamW state per the bundle spec: a scalar `step` (I64 or F32), and for every
// parameter `<name>.exp_avg` and `<name>.exp_avg_sq` with its shape and a
// floating-point dtype.
void check_optimizer_state(const SafetensorsFile& optimizer, const ModelConfig& model);
// The same under `config`: each parameter's state as its group's rule keeps it
// (docs/optimizers.md), its update count `<param>.step` or `step`.
void check_optimizer_state(const SafetensorsFile& optimizer, const ModelConfig& model, const OptimizerConfig& config);

}  // namespace nanreplay
