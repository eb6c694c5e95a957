// The advice after a verdict; see next_step.h. docs/report-format.md lists
// the kinds. The what-ifs named here are replay/workflows/what_if.h's, the commands
// cli/command_table.cpp's: keep them real.
#include "reports/outputs/next_step.h"

#include <algorithm>
#include <cctype>
#include <map>

namespace nanreplay {

namespace {

using Kind = NextStepKind;

// One row per kind: its stable name and its sentence, with {placeholders}
// filled from the report (fill_placeholders).
struct NextStepRow {
  Kind kind;
  const char* name;
  const char* advice;
};

// "...if the job did fail, the failure lies outside the window": the advice of every clean window.
#define NANREPLAY_WIDEN_WINDOW                                                                              \
  "if the job did fail, its failure lies outside this window: capture a wider one (the recorder's "        \
  "`window=`, or `nanreplay import --steps FIRST:LAST` ending at the failing step) and check that the step " \
  "numbers the job logged are the bundle's (an off-by-one moves every step)"

const std::vector<NextStepRow>& next_step_table() {
  static const std::vector<NextStepRow> table = {
      {Kind::kBundleData, "bundle_data",
       "copy the shards again from the job's storage (the bundle's data is not what the job read), check them with "
       "`nanreplay inspect {bundle}`, then replay"},
      {Kind::kFixBundle, "fix_bundle",
       "make the bundle describe the run before reading anything else: compare the settings "
       "BUNDLE_DOES_NOT_REPRODUCE lists with the job's (`nanreplay inspect {bundle}` shows the defaulted ones), "
       "then replay again"},
      {Kind::kMachine, "check_machine",
       "suspect the machine, not the model: take the host or rank the system findings name out of service for "
       "hardware diagnostics and resume from a checkpoint written before the fault"},
      {Kind::kCheckpoint, "checkpoint_nonfinite",
       "the values came in with the checkpoint: replay the steps that wrote it from an earlier checkpoint "
       "(`nanreplay import --steps FIRST:LAST`, LAST the first step holding them) and resume from the last clean one"},
      {Kind::kReplayNearer, "replay_nearer",
       "the roll-forward left the run before the failure: give the bundle a checkpoint nearer the failing step "
       "(the recorder's `snapshot_every`, or `nanreplay import` from a later checkpoint) and replay again"},
      {Kind::kNotReproduced, "check_system",
       "the replay does not reproduce what the job logged: look at the system layer first (hardware, ranks, a "
       "nondeterministic step: the system findings), not the model or the data; `nanreplay inspect {bundle}` "
       "shows the settings the bundle's writer assumed"},
      {Kind::kPoisonedSample, "drop_sample",
       "confirm the sample is the cause: `nanreplay bisect {bundle} --what-if drop-samples={sample}`; look for "
       "others like it in the shards: `nanreplay scan-data {bundle}`; attach a small repro: "
       "`nanreplay minimize {bundle} --out {bundle_min}`"},
      {Kind::kBadData, "scan_data",
       "find every such sample in the shards: `nanreplay scan-data {bundle}`, and fix what wrote them "
       "(tokenizer, vocabulary, data pipeline) before resuming"},
      {Kind::kAttentionOverflow, "attention_overflow",
       "test the usual fixes on the failing step: `nanreplay bisect {bundle} {attention_what_ifs}`; watch `{site}` "
       "grow step by step: `nanreplay trace {trace} --site {site}`"},
      {Kind::kRouterOverflow, "router_overflow",
       "test a full-precision router on the failing step: `nanreplay bisect {bundle} --what-if router-fp32`; "
       "watch the router's logits step by step: `nanreplay trace {trace} --site {site}`"},
      {Kind::kZeroNorm, "zero_norm",
       "test a norm epsilon on the failing step: `nanreplay bisect {bundle} --what-if norm-eps=1e-5`; then "
       "find what zeroed the norm's input: `nanreplay trace {trace} --first-nonfinite`"},
      {Kind::kFp8Scale, "fp8_scale",
       "test a damped scale on the failing step: `nanreplay bisect {bundle} --what-if damp-fp8-scale`; attach a "
       "small repro: `nanreplay minimize {bundle} --out {bundle_min}`"},
      {Kind::kOverflow, "overflow",
       "test that block in fp32 on the failing step: `nanreplay bisect {bundle} --what-if fp32-layers={layers}`; "
       "watch `{site}` grow step by step: `nanreplay trace {trace} --site {site}`"},
      {Kind::kOrigin, "origin",
       "see how `{site}` got there, step by step: `nanreplay trace {trace} --site {site}`; attach a small repro: "
       "`nanreplay minimize {bundle} --out {bundle_min}`"},
      {Kind::kRewritten, "rewritten_weights",
       "find what wrote {rewritten} outside the optimizer (a script, a merge, a checkpoint of another run) and "
       "resume from a checkpoint written before it; `nanreplay bisect {bundle}` names the same tensors; attach a "
       "small repro: `nanreplay minimize {bundle} --out {bundle_min}`"},
      {Kind::kSpike, "spike",
       "confirm where the spike starts: `nanreplay bisect {bundle}` names the same origin; watch `{spike_site}` "
       "step by step: `nanreplay trace {trace} --site {spike_site}`"},
      {Kind::kHandledOverflow, "nothing_to_fix",
       "nothing to fix: the loss scaler handles this overflow; " NANREPLAY_WIDEN_WINDOW},
      {Kind::kWorthALook, "worth_a_look",
       "nothing failed in these steps, so read `{code}` above as context, not as a cause; " NANREPLAY_WIDEN_WINDOW},
      {Kind::kWidenWindow, "widen_window", "nothing failed in these steps; " NANREPLAY_WIDEN_WINDOW},
  };
  return table;
}

#undef NANREPLAY_WIDEN_WINDOW

const NextStepRow& row_of(Kind kind) {
  const auto& table = next_step_table();
  return *std::find_if(table.begin(), table.end(), [&](const NextStepRow& r) { return r.kind == kind; });
}

// A path as one shell word: as it is when it needs no quoting, else in single quotes.
std::string shell_word(const std::string& text) {
  const bool plain = !text.empty() && std::all_of(text.begin(), text.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || std::string("_-./+,:=@%").find(c) != std::string::npos;
  });
  if (plain) return text;
  std::string quoted = "'";
  for (char c : text) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

std::string fill_placeholders(const std::string& advice, const std::map<std::string, std::string>& values) {
  std::string out;
  for (size_t i = 0; i < advice.size(); ++i) {
    const size_t close = advice[i] == '{' ? advice.find('}', i) : std::string::npos;
    const auto found = close == std::string::npos ? values.end() : values.find(advice.substr(i + 1, close - i - 1));
    if (found == values.end()) {
      out += advice[i];
      continue;
    }
    out += found->second;
    i = close;
  }
  return out;
}

bool has_code(const ReplayReport& report, FindingCode code) {
  return report.root_cause && report.root_cause->code == code;
}

// An origin: what explains it, then where it is.
Kind origin_kind(const ReplayReport& report) {
  const FirstNonfinite& f = *report.first_nonfinite;
  const TriageLayer layer = report.root_cause ? report.root_cause->layer : TriageLayer::kNumeric;
  if (layer == TriageLayer::kData && f.sample >= 0) return Kind::kPoisonedSample;
  if (layer == TriageLayer::kData) return Kind::kBadData;
  if (has_code(report, FindingCode::kNumericZeroNorm)) return Kind::kZeroNorm;
  if (has_code(report, FindingCode::kNumericFp8ScaleJump)) return Kind::kFp8Scale;
  if (report.precision == Compute::kFp32 || f.phase == Phase::kGrad) return Kind::kOrigin;
  const std::string site = f.name();
  if (site.find("mlp.router") != std::string::npos) return Kind::kRouterOverflow;
  if (site.find("attn.") != std::string::npos) return Kind::kAttentionOverflow;
  return Kind::kOverflow;
}

// No origin: a clean window, or a failure the replay does not show.
Kind clean_kind(const ReplayReport& report) {
  if (!report.root_cause || !report.root_cause->code) return Kind::kWidenWindow;
  if (has_code(report, FindingCode::kNumericLossScaleOverflow)) return Kind::kHandledOverflow;
  if (!verdict_names_a_cause(report)) return Kind::kWorthALook;
  if (report.root_cause->layer == TriageLayer::kData) return Kind::kBadData;
  if (report.root_cause->layer == TriageLayer::kSystem) return Kind::kNotReproduced;
  return Kind::kWorthALook;
}

bool rolled_forward_divergence(const ReplayReport& report) {
  return std::any_of(report.findings.begin(), report.findings.end(), [](const Finding& f) {
    return f.code == FindingCode::kSystemTrajectoryDiverged &&
           f.evidence.text(EvidenceKey::kReplayedFrom) != std::optional<std::string>("checkpoint");
  });
}

Kind next_step_kind(const ReplayReport& report) {
  // What the bundle or the machine did comes before anything the replay shows.
  static const std::vector<std::pair<FindingCode, Kind>> overriding = {
      {FindingCode::kBundleChecksumMismatch, Kind::kBundleData},
      {FindingCode::kBundleDoesNotReproduce, Kind::kFixBundle},
      {FindingCode::kSystemBitFlip, Kind::kMachine},
      {FindingCode::kSystemRankMismatch, Kind::kMachine},
      {FindingCode::kSystemDeviceMismatch, Kind::kMachine},
      {FindingCode::kSystemSiteMismatch, Kind::kMachine},
      {FindingCode::kSystemUpdateMismatch, Kind::kRewritten},
      {FindingCode::kCheckpointNonfinite, Kind::kCheckpoint},
      {FindingCode::kSystemTrajectoryDiverged, Kind::kReplayNearer},
      {FindingCode::kSystemNotReproducible, Kind::kNotReproduced},
      {FindingCode::kDataTokenOutOfRange, Kind::kBadData},
  };
  for (const auto& [code, kind] : overriding) {
    // A checkpoint step off the log needs no nearer checkpoint: it started from one.
    if (code == FindingCode::kSystemTrajectoryDiverged && !rolled_forward_divergence(report)) continue;
    const bool needs_cause = kind == Kind::kNotReproduced || kind == Kind::kRewritten;
    if (has_code(report, code) && (!needs_cause || verdict_names_a_cause(report))) return kind;
  }
  // A spike's origin with no finding behind it (name_spike_as_cause).
  const bool spike_named = report.spike && report.spike->origin && !report.first_nonfinite;
  if (spike_named && !(report.root_cause && report.root_cause->code)) return Kind::kSpike;
  return report.first_nonfinite ? origin_kind(report) : clean_kind(report);
}

std::map<std::string, std::string> placeholder_values(const ReplayReport& report, const std::string& trace) {
  std::map<std::string, std::string> values = {
      {"bundle", shell_word(report.bundle)},
      {"bundle_min", shell_word(report.bundle + "-min")},
      {"trace", shell_word(trace)},
      {"code", report.root_cause && report.root_cause->code ? code_name(*report.root_cause->code) : "the findings"},
  };
  if (report.spike && report.spike->origin) values["spike_site"] = shell_word(report.spike->origin->name());
  for (const Finding& f : report.findings) {
    if (f.code != FindingCode::kSystemUpdateMismatch || f.severity != Severity::kError) continue;
    values["rewritten"] = values.count("rewritten") ? values["rewritten"] + " and others"
                                                    : f.evidence.text(EvidenceKey::kParam).value_or("the weights");
    if (values["rewritten"].find(" and others") != std::string::npos) break;
  }
  if (report.first_nonfinite) {
    const FirstNonfinite& f = *report.first_nonfinite;
    values["site"] = shell_word(f.name());
    values["sample"] = std::to_string(f.sample);
    values["layers"] = f.layer >= 0 ? std::to_string(f.layer) : "all";
    // qk-norm exists for llama only; gpt2 keeps its own block in fp32 instead.
    values["attention_what_ifs"] = report.arch == Arch::kLlama
                                       ? "--what-if qk-norm --what-if stable-softmax"
                                       : "--what-if stable-softmax --what-if fp32-layers=" + values["layers"];
  }
  return values;
}

// ---- the runbook -------------------------------------------------------------

bool is_infra(Kind kind) {
  switch (kind) {
    case Kind::kBundleData: case Kind::kFixBundle: case Kind::kMachine: case Kind::kReplayNearer:
    case Kind::kNotReproduced: case Kind::kRewritten:
      return true;
    default:
      return false;
  }
}

// The step whose checkpoint first holds what the root cause names, when the
// cause came in with a checkpoint (a flipped bit, rewritten weights, non-finite values).
std::optional<int64_t> corrupted_checkpoint(const ReplayReport& report) {
  if (!report.root_cause || !report.root_cause->code) return std::nullopt;
  const FindingCode code = *report.root_cause->code;
  if (code != FindingCode::kSystemBitFlip && code != FindingCode::kSystemUpdateMismatch &&
      code != FindingCode::kCheckpointNonfinite) {
    return std::nullopt;
  }
  for (const Finding& f : report.findings) {
    if (f.code == code && f.severity == Severity::kError) return f.evidence.integer(EvidenceKey::kStep);
  }
  return std::nullopt;
}

// Where the trouble shows first: the origin's step, the spike origin's, or the root cause's evidence.
std::optional<int64_t> failing_step(const ReplayReport& report) {
  if (report.first_nonfinite) return report.first_nonfinite->step;
  if (report.spike && report.spike->origin) return report.spike->origin->step;
  if (!report.root_cause || !report.root_cause->code) return std::nullopt;
  for (const Finding& f : report.findings) {
    if (f.code == *report.root_cause->code && f.severity == Severity::kError) return f.evidence.integer(EvidenceKey::kStep);
  }
  return std::nullopt;
}

// The last step of the window with a checkpoint at or before `step` (strictly before with `before`).
std::optional<int64_t> checkpoint_at_or_before(const ReplayReport& report, int64_t step, bool before) {
  std::optional<int64_t> found;
  for (const StepOutcome& s : report.steps) {
    if (!s.derived && (before ? s.step < step : s.step <= step)) found = s.step;
  }
  return found;
}

void decide_resume(const ReplayReport& report, Runbook& book) {
  if (const std::optional<int64_t> corrupted = corrupted_checkpoint(report)) {
    book.resume_from = checkpoint_at_or_before(report, *corrupted, true);
    book.resume_why = "the last checkpoint of the window before step " + std::to_string(*corrupted) +
                      ", whose checkpoint first holds what the root cause names";
    if (!book.resume_from) book.resume_why = "none in the window: resume from the job's last checkpoint before step " +
                                             std::to_string(*corrupted);
    return;
  }
  const std::optional<int64_t> failing = failing_step(report);
  if (!failing) return;
  book.resume_from = checkpoint_at_or_before(report, *failing, false);
  book.resume_why = book.resume_from == failing
                        ? "the checkpoint of the failing step " + std::to_string(*failing) + ", written before its batch ran"
                        : "the last checkpoint of the window before the failing step " + std::to_string(*failing);
  if (!book.resume_from) book.resume_why = "none in the window: resume from the job's last checkpoint before step " +
                                           std::to_string(*failing);
}

// The origin's sample when a data finding explains the origin.
std::vector<RunbookSkip> samples_to_skip(const ReplayReport& report) {
  if (!report.first_nonfinite || !report.root_cause || report.root_cause->layer != TriageLayer::kData) return {};
  const FirstNonfinite& f = *report.first_nonfinite;
  if (f.sample < 0) return {};
  return {{f.step, f.sample, f.original_sample, f.original_offset}};
}

Runbook decide_runbook(const ReplayReport& report, Kind kind, const NextStep& step,
                       const std::map<std::string, std::string>& values) {
  Runbook book;
  book.layer = is_infra(kind) ? "infra" : "job";
  decide_resume(report, book);
  book.skip = samples_to_skip(report);
  // The advice's own bisect where it has one (a what-if that would remove the cause), else bisect itself.
  for (const std::string& command : step.commands) {
    if (command.rfind("nanreplay bisect ", 0) == 0) {
      book.confirm = command;
      break;
    }
  }
  if (book.confirm.empty()) book.confirm = "nanreplay bisect " + values.at("bundle");
  return book;
}

}  // namespace

nlohmann::json runbook_json(const std::optional<Runbook>& runbook) {
  if (!runbook) return nullptr;
  const Runbook& b = *runbook;
  nlohmann::json skip = nlohmann::json::array();
  for (const RunbookSkip& s : b.skip) {
    nlohmann::json one = {{"step", s.step}, {"sample", s.sample}};
    if (s.original_sample) one["original_sample"] = *s.original_sample;
    if (s.original_offset) one["original_offset"] = *s.original_offset;
    skip.push_back(one);
  }
  nlohmann::json resume = nullptr;
  if (b.resume_from) resume = {{"step", *b.resume_from}, {"why", b.resume_why}};
  return {{"layer", b.layer}, {"resume_from", resume}, {"skip", skip}, {"confirm", b.confirm}};
}

std::string runbook_text(const Runbook& b) {
  std::string text = b.layer == "infra" ? "infra (the machine or the capture, not the model or the data)"
                                        : "the job (its data or its numerics)";
  if (b.resume_from) {
    text += "; resume from the checkpoint of step " + std::to_string(*b.resume_from) + " (" + b.resume_why + ")";
  } else if (!b.resume_why.empty()) {
    text += "; resume from: " + b.resume_why;
  }
  for (const RunbookSkip& s : b.skip) {
    text += "; skip sample " + std::to_string(s.sample) + " of step " + std::to_string(s.step);
    if (s.original_sample) text += " (the run's sample " + std::to_string(*s.original_sample) + ")";
    if (s.original_offset) text += " (the run's token offset " + std::to_string(*s.original_offset) + ")";
  }
  return text + "; confirm with `" + b.confirm + "`";
}

bool verdict_names_a_cause(const ReplayReport& report) { return exit_status_for(report) != 0; }

std::vector<std::string> split_code_spans(const std::string& text) {
  std::vector<std::string> pieces(1);
  for (char c : text) {
    if (c == '`') {
      pieces.emplace_back();
    } else {
      pieces.back() += c;
    }
  }
  return pieces;
}

NextStep decide_next_step(const ReplayReport& report, const std::string& trace) {
  const NextStepRow& row = row_of(next_step_kind(report));
  const std::map<std::string, std::string> values = placeholder_values(report, trace);
  NextStep step{row.kind, row.name, fill_placeholders(row.advice, values), {}, std::nullopt};
  const std::vector<std::string> pieces = split_code_spans(step.text);
  for (size_t i = 1; i < pieces.size(); i += 2) {
    // A runnable command: not an option name, not a placeholder like FIRST:LAST left for the reader.
    if (pieces[i].rfind("nanreplay ", 0) == 0 && pieces[i].find("FIRST") == std::string::npos &&
        pieces[i] != "nanreplay import") {
      step.commands.push_back(pieces[i]);
    }
  }
  if (verdict_names_a_cause(report)) step.runbook = decide_runbook(report, row.kind, step, values);
  return step;
}

nlohmann::json next_step_json(const NextStep& step) {
  return {{"kind", step.name}, {"text", step.text}, {"commands", step.commands}};
}

}  // namespace nanreplay
