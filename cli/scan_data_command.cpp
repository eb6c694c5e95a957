// `nanreplay scan-data BUNDLE`: scan every token shard for out-of-range ids,
// long repeated runs and low-entropy samples without replaying, verify the
// shards' checksums, print GB/s; exit 1 when anything is flagged.
#include <algorithm>

#include <nlohmann/json.hpp>

#include "cli/cli_support.h"
#include "cli/command_table.h"
#include "cli/progress_line.h"
#include "loaders/bundle/bundle.h"
#include "loaders/base/error.h"
#include "loaders/base/mapped_file.h"
#include "probes/data_checks.h"

namespace nanreplay {

namespace {

// What one scan found: the data checks and the shards' checksums.
struct ScanOutcome {
  DataScanResult scan;
  std::vector<ChecksumMismatch> mismatches;
  DataCheckOptions checks;
  double gb_per_s = 0.0;
  bool flagged() const {
    return scan.out_of_range_count > 0 || !scan.repeat_runs.empty() || !scan.low_entropy.empty() ||
           !mismatches.empty();
  }
};

cxxopts::Options scan_data_options() {
  cxxopts::Options options("nanreplay scan-data",
                           "Scan every token shard of a bundle for out-of-range ids, long repeated runs and "
                           "low-entropy samples, streaming through the mappings on all cores.\n"
                           "Example: nanreplay scan-data incident-bundle/ --json");
  options.add_options()
      ("bundle", "incident bundle directory", cxxopts::value<std::string>())
      ("threads", "scan threads (0: all cores)", cxxopts::value<int>()->default_value("0"))
      ("repeat-run-min", "flag runs of one token at least this long (0: seq_len/4 in [8, 64])",
       cxxopts::value<int64_t>()->default_value("0"))
      ("low-entropy-z", "robust z-score below the typical sample's entropy", cxxopts::value<double>()->default_value("6"))
      ("low-entropy-ratio", "and below this fraction of the median entropy", cxxopts::value<double>()->default_value("0.6"))
      ("json", "print the result as JSON")
      ("q,quiet", "print nothing but errors");
  add_progress_flag(options);
  options.add_options()("h,help", "show this help");
  options.parse_positional({"bundle"});
  options.positional_help("BUNDLE");
  return options;
}

ScanOutcome scan_bundle(const Bundle& bundle, const cxxopts::ParseResult& args, ProgressMode progress_mode,
                        CommandIo& io) {
  ScanOutcome outcome;
  outcome.checks.repeat_run_min = args["repeat-run-min"].as<int64_t>();
  outcome.checks.low_entropy_z = args["low-entropy-z"].as<double>();
  outcome.checks.low_entropy_ratio = args["low-entropy-ratio"].as<double>();
  {
    ProgressLine progress(io.err, progress_mode, io.err_is_terminal, "scan-data");
    outcome.scan = scan_token_stream(bundle.tokens(), bundle.manifest().data.seq_len,
                                     bundle.manifest().model.vocab_size, outcome.checks, args["threads"].as<int>(),
                                     [&](double fraction) { progress.update_scan(fraction); });
  }
  // A checksum mismatch is a finding like poisoned data (exit 1): the shard is not what was captured.
  outcome.mismatches = bundle.tokens().verify_checksums();
  throw_if_mapped_file_changed();
  const DataScanResult& scan = outcome.scan;
  outcome.gb_per_s = scan.seconds > 0 ? static_cast<double>(scan.bytes) / scan.seconds / 1e9 : 0.0;
  return outcome;
}

nlohmann::json scan_json(const Bundle& bundle, const ScanOutcome& outcome) {
  const DataScanResult& scan = outcome.scan;
  nlohmann::json out = {{"tokens", scan.tokens}, {"bytes", scan.bytes}, {"samples", scan.samples},
                        {"seconds", scan.seconds}, {"gb_per_s", outcome.gb_per_s},
                        {"out_of_range_count", scan.out_of_range_count},
                        {"entropy_median", scan.baseline.median}, {"entropy_mad", scan.baseline.mad},
                        {"out_of_range", nlohmann::json::array()}, {"repeat_runs", nlohmann::json::array()},
                        {"low_entropy", nlohmann::json::array()},
                        {"checksum_mismatches", nlohmann::json::array()}};
  for (const ChecksumMismatch& bad : outcome.mismatches) {
    out["checksum_mismatches"].push_back(
        {{"shard", printable(bad.shard)}, {"expected", bad.expected}, {"actual", bad.actual}});
  }
  for (const OutOfRangeToken& t : scan.out_of_range) {
    out["out_of_range"].push_back({{"shard", bundle.tokens().spec(t.shard).path}, {"offset", t.offset}, {"token", t.token}});
  }
  for (const SampleProfile& p : scan.repeat_runs) {
    out["repeat_runs"].push_back({{"sample", p.sample}, {"position", p.run_position}, {"length", p.longest_run}, {"token", p.run_token}});
  }
  for (const SampleProfile& p : scan.low_entropy) {
    out["low_entropy"].push_back({{"sample", p.sample}, {"entropy_bits", p.entropy_bits}});
  }
  return out;
}

std::string scan_text_findings(const Bundle& bundle, const ScanOutcome& outcome) {
  const DataScanResult& scan = outcome.scan;
  std::string text = format_text("out-of-range token ids: %lld\n", static_cast<long long>(scan.out_of_range_count));
  for (const OutOfRangeToken& t : scan.out_of_range) {
    text += format_text("  %s offset %lld: token %lld\n", bundle.tokens().spec(t.shard).path.c_str(),
                        static_cast<long long>(t.offset), static_cast<long long>(t.token));
  }
  text += format_text("samples with a repeated run >= %lld: %zu\n",
                      static_cast<long long>(outcome.checks.repeat_threshold(bundle.manifest().data.seq_len)),
                      scan.repeat_runs.size());
  for (size_t i = 0; i < std::min<size_t>(scan.repeat_runs.size(), 20); ++i) {
    const SampleProfile& p = scan.repeat_runs[i];
    text += format_text("  sample %lld: token %lld x%lld from position %lld\n", static_cast<long long>(p.sample),
                        static_cast<long long>(p.run_token), static_cast<long long>(p.longest_run),
                        static_cast<long long>(p.run_position));
  }
  text += format_text("low-entropy samples: %zu\n", scan.low_entropy.size());
  for (size_t i = 0; i < std::min<size_t>(scan.low_entropy.size(), 20); ++i) {
    text += format_text("  sample %lld: %.3f bits\n", static_cast<long long>(scan.low_entropy[i].sample),
                        scan.low_entropy[i].entropy_bits);
  }
  return text;
}

std::string scan_text(const Bundle& bundle, const ScanOutcome& outcome) {
  const DataScanResult& scan = outcome.scan;
  std::string text = format_text("scanned %lld tokens (%.1f MB, %lld samples) in %.3fs: %.2f GB/s\n",
                                 static_cast<long long>(scan.tokens), static_cast<double>(scan.bytes) / 1e6,
                                 static_cast<long long>(scan.samples), scan.seconds, outcome.gb_per_s);
  text += format_text("typical sample entropy %.3f bits (MAD %.3f)\n", scan.baseline.median, scan.baseline.mad);
  text += format_text("shard checksums: %s\n", outcome.mismatches.empty() ? "ok (or none declared)" : "MISMATCH");
  for (const ChecksumMismatch& bad : outcome.mismatches) {
    text += format_text("  %s: sha256 is %s, the manifest says %s\n", printable(bad.shard).c_str(),
                        bad.actual.c_str(), bad.expected.c_str());
  }
  return text + scan_text_findings(bundle, outcome);
}

}  // namespace

int scan_data_command(const CommandArgs& args, CommandIo& io) {
  cxxopts::Options options = scan_data_options();
  const auto parsed = parse_or_usage(options, args);
  if (parsed.count("help")) {
    io.out << options.help() << exit_status_help("scan-data");
    return 0;
  }
  if (!parsed.count("bundle")) throw UsageError("scan-data: missing BUNDLE (see nanreplay scan-data --help)");
  const Bundle bundle(parsed["bundle"].as<std::string>());
  const bool json = parsed.count("json") > 0;
  const bool quiet = parsed.count("quiet") > 0;
  const ScanOutcome outcome = scan_bundle(bundle, parsed, progress_mode(parsed, quiet), io);
  if (json) {
    io.out << scan_json(bundle, outcome).dump(2) << "\n";
  } else if (!quiet) {
    io.out << scan_text(bundle, outcome);
  }
  return outcome.flagged() ? static_cast<int>(ExitStatus::kFound) : static_cast<int>(ExitStatus::kClean);
}

}  // namespace nanreplay
