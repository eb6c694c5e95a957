// DeepSeek-V3's correction bias (e_score_correction_bias) moved on by the
// job's balancing rule after a step (model.moe.score_bias_update), so a
// rolled-forward step without a logged bias replays with the one its job held
// (docs/rolling-forward.md, "The router's correction bias").
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "loaders/arch/model_config.h"

namespace nanreplay {

// The bias of the step after one whose router added `bias` (by layer with
// experts) and sent tokens[layer][expert] tokens to each expert over all of
// its micro-batches and ranks. Computed in fp32 as the job's buffer is.
std::map<int, std::vector<double>> updated_score_bias(const MoeConfig::ScoreBiasUpdate& update,
                                                      const std::map<int, std::vector<double>>& bias,
                                                      const std::vector<std::vector<int64_t>>& tokens);

// The bias from step to step along a rolled-forward window: torchtitan's hook
// runs before each optimizer step on every token counted since the last one
// (then zeroes the counts). A step the fp16 loss scaler skips runs no
// optimizer step: its bias stays and its tokens wait for the next update.
class ScoreBiasSteps {
 public:
  explicit ScoreBiasSteps(MoeConfig::ScoreBiasUpdate update) : update_(update) {}
  // The next step's bias, after a step whose router added `used` and counted `tokens`.
  std::map<int, std::vector<double>> after_step(const std::map<int, std::vector<double>>& used,
                                                const std::vector<std::vector<int64_t>>& tokens,
                                                bool optimizer_stepped);

 private:
  MoeConfig::ScoreBiasUpdate update_;
  std::vector<std::vector<int64_t>> pending_;  // [layer][expert] since the last optimizer step
};

}  // namespace nanreplay
