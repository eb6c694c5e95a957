// `nanreplay demo [DIR]`: write the built-in incident bundle (layer 2, head 3
// of an fp16 llama overflows at step 105) to DIR/bundle, replay it into
// DIR/report as `run` does, and say whether nanreplay named the planted head.
#include "cli/cli_support.h"
#include "cli/command_table.h"
#include "cli/run_command.h"
#include "cli/synth_command.h"
#include "loaders/base/error.h"
#include "probes/sites.h"
#include "reports/outputs/report_json.h"
#include "reports/results/report.h"
#include "reports/outputs/terminal_text.h"

namespace nanreplay {

namespace fs = std::filesystem;

namespace {

cxxopts::Options demo_options() {
  cxxopts::Options options("nanreplay demo",
                           "Write a built-in incident bundle (a llama model in fp16 whose layer 2, "
                           "head 3 overflows at step 105) and replay it.\n"
                           "Example: nanreplay demo ./nanreplay-demo");
  options.add_options()
      ("dir", "where to put the bundle and the report", cxxopts::value<std::string>()->default_value("nanreplay-demo"))
      ("json", "print one JSON object: bundle, out, named_planted_fault and the replay's report (report.json)")
      ("q,quiet", "print nothing but errors");
  add_progress_flag(options);
  options.add_options()("h,help", "show this help");
  options.parse_positional({"dir"});
  options.positional_help("[DIR]");
  return options;
}

// Whether the replay named the site and head the demo plants.
bool named_the_fault(const ReplayReport& report, const FaultSpec& fault) {
  return report.first_nonfinite && report.first_nonfinite->step == fault.step &&
         report.first_nonfinite->site == SiteRef{SiteId::kAttnScores, fault.layer} &&
         report.first_nonfinite->head == fault.head;
}

void print_demo_verdict(const ReplayReport& report, const FaultSpec& fault, bool named, const fs::path& out,
                        CommandIo& io) {
  io.out << render_verdict(report, {io.color, out.string()}) << "\n"
         << "The demo's model has a head (layer " << fault.layer << ", head " << fault.head
         << ") that amplifies one rare token, first read at step " << fault.step << ": its q k^T overflows fp16 in "
         << site_name(SiteRef{SiteId::kAttnScores, fault.layer}) << ", head " << fault.head << ". "
         << (named ? "nanreplay named it." : "nanreplay did NOT name it (a bug).") << "\n"
         << "open " << (out / "report.html").string() << " in a browser; also report.md, report.json and trace.h5 there\n";
}

constexpr const char* kNotNamed = "internal error: the demo's replay did not name the planted head (a bug)";

// The demo's one object: where it wrote, whether it named the planted head, and the report;
// an "error" as every command's --json has one when the planted head was not named (exit 3).
void print_demo_json(const ReplayReport& report, bool named, const fs::path& bundle, const fs::path& out,
                     CommandIo& io) {
  nlohmann::json demo = {{"bundle", bundle.string()}, {"out", out.string()}, {"named_planted_fault", named},
                         {"report", report_to_json(report)}};
  if (!named) {
    const CommandFailure failure = failure_of(ExitStatus::kInternal, FailureKind::kInternal, kNotNamed);
    demo["error"] = nlohmann::json::parse(failure_json(failure))["error"];
  }
  io.out << demo.dump(2) << "\n";
}

}  // namespace

int demo_command(const CommandArgs& args, CommandIo& io) {
  cxxopts::Options options = demo_options();
  const auto parsed = parse_or_usage(options, args);
  if (parsed.count("help")) {
    io.out << options.help() << exit_status_help("demo");
    return 0;
  }
  const fs::path dir = parsed["dir"].as<std::string>();
  const bool json = parsed.count("json") > 0;
  const bool quiet = parsed.count("quiet") > 0 || json;  // under --json stdout holds the one object
  const ProgressMode progress = progress_mode(parsed, parsed.count("quiet") > 0);
  const SyntheticSpec spec = synthetic_preset("demo");
  const fs::path bundle = dir / "bundle";
  refuse_inside_a_bundle(dir);
  std::error_code ec;
  if (!fs::exists(bundle / "manifest.json", ec)) {
    if (!quiet) io.out << "writing the demo incident bundle to " << bundle.string() << " ...\n";
    write_bundle_for_user(bundle, spec);
  }
  RunSettings settings;
  settings.incident.bundle = bundle;
  settings.out = dir / "report";
  settings.quiet = quiet;
  settings.progress = progress;
  const ReplayReport report = replay_and_write(settings, io);
  const bool named = named_the_fault(report, spec.fault);
  if (json) {
    print_demo_json(report, named, bundle, settings.out, io);
  } else if (!quiet) {
    print_demo_verdict(report, spec.fault, named, settings.out, io);
  }
  if (!named) io.err << "nanreplay: error: " << kNotNamed << "\n";
  return named ? 0 : static_cast<int>(ExitStatus::kInternal);
}

}  // namespace nanreplay
