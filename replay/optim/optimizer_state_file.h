// A parameter's optimizer state as optimizer.safetensors holds it: the
// tensors of its rule's layout (`<param>.<name>`) and its update count
// (`<param>.step`, else the file's scalar `step`).
#pragma once

#include <string>
#include <vector>

#include "loaders/formats/safetensors.h"
#include "replay/optim/optimizer.h"

namespace nanreplay {

// `<name>.step` when the file has it, else `step`: an I64, F32 or F64 scalar;
// -1 when the file has neither.
int64_t stored_update_count(const SafetensorsFile& optimizer, const std::string& name);

// Owned fp32 copies, each in its layout's shape (a stored tensor with the same
// element count, torch's row_var saved without its kept dimension for one, is
// reshaped). InputError names a missing or mis-sized tensor.
ParamState read_param_state(const SafetensorsFile& optimizer, const std::string& name,
                            const std::vector<int64_t>& shape, const OptimizerRule& rule);

// The state's tensors under their file names (`<name>.<key>`) and `<name>.step`, as fp32 / I64.
void add_param_state(SafetensorsWriter& writer, const std::string& name, const ParamState& state);

}  // namespace nanreplay
