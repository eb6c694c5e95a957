// `nanreplay trace TRACE.h5`: query the probes of a trace written by `run`
// (step, phase, site glob, head, expert, sort, the first or every non-finite row).
// --first-nonfinite names origins as the report does: the head's or expert's
// own row, not the whole tensor's.
#include <algorithm>

#include "cli/cli_support.h"
#include "cli/command_table.h"
#include "loaders/base/error.h"
#include "reports/outputs/trace_query.h"
#include "reports/outputs/trace/trace_writer.h"

namespace nanreplay {

namespace {

cxxopts::Options trace_options() {
  cxxopts::Options options("nanreplay trace",
                           "Query the probes of a trace.h5 written by `nanreplay run`.\n"
                           "Example: nanreplay trace triage/trace.h5 --step 105 --phase forward "
                           "--site 'layers.2.*' --sort max_abs\n"
                           "Columns: max|x| and rms are over the finite elements only; nan and inf count the\n"
                           "non-finite ones. headroom is log2(largest value of the type the site is held in /\n"
                           "max|x|): how many doublings the largest value could take before it overflows\n"
                           "(fp16 65504, bf16 and fp32 about 3.4e38); below 1 is a near miss, inf when no finite value is nonzero.\n"
                           "sample and pos locate the row's first non-finite element (-1: none or n/a).");
  options.add_options()
      ("trace", "trace.h5 file", cxxopts::value<std::string>())
      ("step", "only this step", cxxopts::value<int64_t>())
      ("phase", "forward, backward or grad", cxxopts::value<std::string>())
      ("site", "site glob ('*' matches any run), e.g. 'layers.*.attn.scores'", cxxopts::value<std::string>())
      ("head", "only this head (-1: whole-tensor rows)", cxxopts::value<int>())
      ("expert", "only this expert of a mixture of experts (-1: rows not of one expert)", cxxopts::value<int>())
      ("sort", "max_abs: largest max|x| first", cxxopts::value<std::string>())
      ("first-nonfinite", "the first site holding NaN/Inf in execution order, as the row of the head or "
                          "expert that holds its first bad element (the report's origin); with --limit N: the first N sites")
      ("nonfinite", "every row holding NaN/Inf, in execution order (up to --limit)")
      ("limit", "at most N rows (default 50; 1 with --first-nonfinite)", cxxopts::value<size_t>())
      ("json", "print the rows as JSON")
      ("h,help", "show this help");
  options.parse_positional({"trace"});
  options.positional_help("TRACE.h5");
  return options;
}

TraceQuery parse_query(const cxxopts::ParseResult& args) {
  TraceQuery query;
  if (args.count("step")) query.step = args["step"].as<int64_t>();
  if (args.count("phase")) {
    query.phase = parse_phase(args["phase"].as<std::string>());
    if (!query.phase) throw UsageError("--phase: expected forward, backward or grad");
  }
  if (args.count("site")) query.site_pattern = args["site"].as<std::string>();
  if (args.count("head")) query.head = args["head"].as<int>();
  if (args.count("expert")) query.expert = args["expert"].as<int>();
  if (args.count("sort")) {
    if (args["sort"].as<std::string>() != "max_abs") throw UsageError("--sort: only max_abs is supported");
    query.sort_by_max_abs = true;
  }
  const bool first_only = args.count("first-nonfinite") > 0;
  if (first_only && args.count("nonfinite")) {
    throw UsageError("trace: --first-nonfinite and --nonfinite contradict each other (see nanreplay trace --help)");
  }
  query.only_nonfinite = first_only || args.count("nonfinite") > 0;
  // An explicit --head or --expert already picks the part: its rows as they are.
  query.origin_rows = first_only && !query.head && !query.expert;
  query.limit = args.count("limit") ? args["limit"].as<size_t>() : first_only ? 1 : 50;
  return query;
}

}  // namespace

int trace_command(const CommandArgs& args, CommandIo& io) {
  cxxopts::Options options = trace_options();
  const auto parsed = parse_or_usage(options, args);
  if (parsed.count("help")) {
    io.out << options.help() << exit_status_help("trace");
    return 0;
  }
  if (!parsed.count("trace")) throw UsageError("trace: missing TRACE.h5 (see nanreplay trace --help)");
  const TraceQuery query = parse_query(parsed);
  const std::string path = parsed["trace"].as<std::string>();
  const TraceContents trace = read_trace(path);
  const std::vector<int64_t> steps = steps_in(trace.probes);
  if (query.step && !std::binary_search(steps.begin(), steps.end(), *query.step)) {
    throw UsageError("trace: " + path + " has no step " + std::to_string(*query.step) + "; it holds steps " +
                     describe_steps(steps));
  }
  const TraceSelection selection = select_probes(trace.probes, query);
  io.out << (parsed.count("json") ? trace_selection_json(selection).dump(2) + "\n" : render_trace_table(selection));
  return 0;
}

}  // namespace nanreplay
