// What to do after reading a verdict: one sentence with the commands to run,
// decided once from the settled report so that the terminal, report.md,
// report.html and report.json give the same advice. Pure: no printing.
#pragma once

#include <cstdint>
#include <optional>
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
  kRewritten,          // weights rewritten outside the optimizer into a checkpoint
  kSpike,              // a spike's origin, nothing non-finite
  kHandledOverflow,    // only overflow the fp16 loss scaler handles
  kWorthALook,         // a clean window with a warning to read
  kWidenWindow,        // a clean window with nothing to read
};

// The verdict as a runbook, decided with the next step from the same
// situation (docs/report-format.md#the-runbook): whose problem it is, the
// last clean checkpoint to resume from, the samples to skip when a data
// finding names them, and the one command that would confirm the verdict.
struct RunbookSkip {
  int64_t step = 0;
  int64_t sample = -1;
  std::optional<int64_t> original_sample, original_offset;  // the run's numbering, where recorded
};
struct Runbook {
  std::string layer;                   // "infra" (machine, rank, bit flip, capture, non-reproduction) or "job"
  std::optional<int64_t> resume_from;  // step of the last clean checkpoint; none when the window holds none
  std::string resume_why;
  std::vector<RunbookSkip> skip;
  std::string confirm;                 // one `nanreplay ...` command with the bundle's real path
};

struct NextStep {
  NextStepKind kind = NextStepKind::kWidenWindow;
  std::string name;                   // stable identifier, report.json's next_step.kind
  std::string text;                   // one sentence; commands and option names between backticks
  std::vector<std::string> commands;  // the `nanreplay ...` commands of text, in order
  std::optional<Runbook> runbook;     // only when the verdict names a cause (exit 1)
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

// report.json's "runbook": {layer, resume_from: {step, why} | null, skip:
// [{step, sample, original_sample?, original_offset?}], confirm}, or null.
nlohmann::json runbook_json(const std::optional<Runbook>& runbook);
// One line for people, the confirming command between backticks: "infra: resume
// from the checkpoint of step 102 (...); skip ...; confirm with `nanreplay ...`".
std::string runbook_text(const Runbook& runbook);

}  // namespace nanreplay
