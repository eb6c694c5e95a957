// steps/<step>/state.json: the per-step scalars and what the job logged.
// Numbers may be given as the strings "nan", "inf", "-inf" (JSON has no NaN).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace nanreplay {

struct Fp8ModuleScales {
  std::optional<double> input;
  std::optional<double> weight;
  std::optional<double> grad_output;
};

struct LoggedMetrics {
  std::optional<double> loss;
  std::optional<double> grad_norm;
  std::vector<double> rank_losses;
  std::vector<double> rank_grad_norms;
};

struct StepState {
  int64_t step = 0;
  std::optional<double> lr;
  double loss_scale = 1.0;
  bool loss_scale_given = false;  // state.json names it (a rolled-forward step otherwise carries the scale on)
  std::map<std::string, Fp8ModuleScales> fp8_scales;  // key: module prefix
  LoggedMetrics logged;
  std::optional<bool> skipped;
};

StepState parse_step_state(const std::string& json_text, const std::string& file_label);

}  // namespace nanreplay
