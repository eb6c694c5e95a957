// What to do after reading a verdict: one sentence with the commands to run,
// decided once from the settled report so that the terminal, report.md,
// report.html and report.json give the same advice. Pure: no printing.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "reports/results/report.h"

namespace nanreplay {

// The situations a verdict leaves its reader in; each has one row of advice
// in next_step.cpp's table.
enum class NextStepKind : uint8_t {
  kBundleData,         // the shards differ from what the job read
  kFixBundle,          // the replay does not replay the run
  kMachine,            // a flipped bit, a rank or a device that disagrees
  kCheckpoint,         // the checkpoint already held non-finite values
  kReplayNearer,       // the roll-forward left the run before the failure
  kNotReproduced,      // the job failed, the replay does not: the system layer
  kPoisonedSample,     // an origin a data finding explains
  kBadData,            // a data error without an origin
  kAttentionOverflow,  // an attention site overflowed in a low precision
  kRouterOverflow,     // a mixture of experts' router overflowed
  kZeroNorm,           // a norm's 0/0
  kFp8Scale,           // an fp8 scale jumped into the failing step
  kOverflow,           // any other site overflowed in a low precision
  kOrigin,             // an origin nothing more specific explains
  kHandledOverflow,    // only overflow the fp16 loss scaler handles
  kWorthALook,         // a clean window with a warning to read
  kWidenWindow,        // a clean window with nothing to read
};

struct NextStep {
  NextStepKind kind = NextStepKind::kWidenWindow;
  std::string name;                   // stable identifier, report.json's next_step.kind
  std::string text;                   // one sentence; commands and option names between backticks
  std::vector<std::string> commands;  // the `nanreplay ...` commands of text, in order
};

// Where the commands find the files: the bundle is the report's own path,
// `trace` the run's trace.h5 as the reader will reach it.
NextStep decide_next_step(const ReplayReport& report, const std::string& trace = "trace.h5");

// Whether the verdict names a cause: an origin or an error finding (exit 1).
// Without one the window is clean and its root cause only a thing worth a look.
bool verdict_names_a_cause(const ReplayReport& report);

// text cut at its backticks: even pieces are prose, odd pieces code.
std::vector<std::string> split_code_spans(const std::string& text);

// {kind, text, commands}: report.json's next_step.
nlohmann::json next_step_json(const NextStep& step);

}  // namespace nanreplay
