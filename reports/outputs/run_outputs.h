// The four results of `nanreplay run` (trace.h5 with its step rows,
// report.json, report.md, report.html), staged in an OutputDir and committed
// as one set, or none of them. Never prints: a stop request while they are
// written is thrown as Interrupted (loaders/base/error.h), a bundle file changed
// while mapped as InputError, and what was staged is removed; the destructor
// removes it too when anything else (an exception unwinding) comes first.
#pragma once

#include <cstddef>
#include <filesystem>
#include <functional>
#include <optional>
#include <vector>

#include "reports/outputs/output_dir.h"
#include "reports/results/report.h"
#include "reports/outputs/trace/trace_writer.h"

namespace nanreplay {

class RunOutputs {
 public:
  // Creates `dir` as OutputDir does (refusals before any replay: inside the
  // bundle, results present with replace_existing false, a result name taken
  // by a directory).
  RunOutputs(const std::filesystem::path& dir, const std::filesystem::path& bundle_root, bool replace_existing);

  // Stages the four results, then, in this order: a stop requested while they
  // were written keeps none of them (Interrupted, naming `steps_replayed`),
  // a bundle file that changed while mapped keeps none (InputError), and the
  // set is committed (OutputError on failure, the previous set kept).
  // Each result's writing is added to report.timings; report.json, written
  // last, holds the others'.
  void write_and_commit(ReplayReport& report, size_t steps_replayed,
                        const std::function<bool()>& stop_requested);

  // Where the replay hands each step's probe records (ReplayOptions::
  // on_step_probes): appended to the staged trace.h5 at once, so memory does
  // not grow with the window; a full disk stops the replay there
  // (OutputError). Without it, the trace takes report.probes.
  std::function<void(const std::vector<ProbeRecord>&)> probe_sink();

 private:
  void stage(ReplayReport& report);
  TraceStream& trace();

  OutputDir dir_;
  bool streamed_ = false;
  std::optional<TraceStream> trace_;  // after dir_: removed before the staging directory
};

}  // namespace nanreplay
