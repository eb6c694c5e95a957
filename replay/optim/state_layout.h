// Which state tensors each optimizer kind keeps per parameter, under the
// bundle format's names (`<param>.<name>` in optimizer.safetensors), with
// their shapes. Torch-free: the bundle's structure check reads it too.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "loaders/bundle/manifest.h"

namespace nanreplay {

using StateLayout = std::vector<std::pair<std::string, std::vector<int64_t>>>;

// Adam/AdamW: exp_avg, exp_avg_sq (+ max_exp_avg_sq with amsgrad);
// torch Adafactor: row_var [.., n, 1], col_var [.., 1, m] (matrices) or variance;
// Hugging Face Adafactor: exp_avg_sq_row [.., n], exp_avg_sq_col [.., m] (matrices)
// or exp_avg_sq, and exp_avg with beta1; Muon: momentum_buffer.
StateLayout state_layout(const OptimizerRule& rule, const std::vector<int64_t>& shape);

}  // namespace nanreplay
