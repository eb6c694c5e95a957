// The results of `nanreplay run`, written whole or not at all; see run_outputs.h.
#include "reports/outputs/run_outputs.h"

#include <cmath>
#include <string>
#include <vector>

#include "loaders/base/error.h"
#include "loaders/base/mapped_file.h"
#include "reports/outputs/html_report.h"
#include "reports/outputs/markdown_report.h"
#include "reports/outputs/report_json.h"

namespace nanreplay {

namespace {

// One row per step, NaN where a step was not replayed or nothing was logged.
std::vector<TraceStepRow> trace_step_rows(const ReplayReport& report) {
  std::vector<TraceStepRow> rows;
  for (const StepOutcome& s : report.steps) {
    rows.push_back({s.step, s.replayed ? s.loss : std::nan(""), s.logged_loss ? *s.logged_loss : std::nan(""),
                    s.replayed ? s.grad_norm : std::nan(""), s.replayed && s.finite});
  }
  return rows;
}

}  // namespace

RunOutputs::RunOutputs(const std::filesystem::path& dir, const std::filesystem::path& bundle_root,
                       bool replace_existing)
    : dir_(dir, bundle_root, replace_existing, {"report.json", "trace.h5", "report.md", "report.html"}) {}

void RunOutputs::stage(ReplayReport& report) {
  const TraceHeader header{report.bundle, report.tool_version, compute_name(report.precision),
                           arch_name(report.arch), {}};
  {
    const PhaseTimer timer(report.timings, TimedPhase::kTrace);
    if (!streamed_) trace().append(report.probes);
    trace().finish(header, trace_step_rows(report));
  }
  {
    const PhaseTimer timer(report.timings, TimedPhase::kReportMd);
    dir_.write_text("report.md", render_markdown(report));
  }
  {
    const PhaseTimer timer(report.timings, TimedPhase::kReportHtml);
    dir_.write_text("report.html", render_html(report));
  }
  const PhaseTimer timer(report.timings, TimedPhase::kReportJson);
  dir_.write_text("report.json", report_to_json(report).dump(2) + "\n");
}

TraceStream& RunOutputs::trace() {
  if (!trace_) trace_.emplace(dir_.staging_path("trace.h5").string(), dir_.display_path("trace.h5"));
  return *trace_;
}

std::function<void(const std::vector<ProbeRecord>&)> RunOutputs::probe_sink() {
  streamed_ = true;
  return [this](const std::vector<ProbeRecord>& records) { trace().append(records); };
}

void RunOutputs::write_and_commit(ReplayReport& report, size_t steps_replayed,
                                  const std::function<bool()>& stop_requested) {
  stage(report);
  if (stop_requested && stop_requested()) {  // arrived while the outputs were written: keep none of them
    dir_.abandon();
    throw Interrupted("interrupted after all " + std::to_string(steps_replayed) +
                      " steps, while writing the outputs; nothing was written");
  }
  throw_if_mapped_file_changed();
  dir_.commit();
}

}  // namespace nanreplay
