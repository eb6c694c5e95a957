// See minimize_output.h.
#include "reports/outputs/minimize_output.h"

#include <sstream>

#include "loaders/base/message_text.h"
#include "reports/outputs/report_json.h"
#include "reports/outputs/spike_output.h"
#include "reports/results/number_text.h"

namespace nanreplay {

namespace {


nlohmann::json size_json(const BundleSize& s) {
  return {{"bytes", s.bytes},           {"steps", s.steps},
          {"checkpoints", s.checkpoints}, {"samples", s.samples},
          {"tokens", s.tokens},         {"layers", s.layers},
          {"world_size", s.world_size}, {"grad_accum_steps", s.grad_accum_steps},
          {"micro_batch_size", s.micro_batch_size}};
}

std::string bytes_text(uint64_t bytes) {
  std::ostringstream out;
  if (bytes >= (1u << 20)) {
    out.precision(3);
    out << static_cast<double>(bytes) / (1u << 20) << " MiB";
  } else if (bytes >= 1024) {
    out.precision(3);
    out << static_cast<double>(bytes) / 1024 << " KiB";
  } else {
    out << bytes << " B";
  }
  return out.str();
}

nlohmann::json flip_json(const std::optional<FlippedBit>& f) {
  if (!f) return nullptr;
  return {{"step", f->step},
          {"param", f->param},
          {"index", f->index},
          {"bit", f->bit},
          {"before", f->before},
          {"after", f->after},
          {"expected", f->expected},
          {"tensor", "steps/" + std::to_string(f->step) + "/model.safetensors"},
          {"update_from", f->step - 1},
          {"message", f->message}};
}

double ratio(const MinimizeReport& r) {
  return r.before.bytes == 0 ? 0.0 : static_cast<double>(r.after.bytes) / static_cast<double>(r.before.bytes);
}

}  // namespace

nlohmann::json minimize_to_json(const MinimizeReport& r) {
  nlohmann::json attempts = nlohmann::json::array();
  for (const MinimizeAttempt& a : r.attempts) {
    attempts.push_back({{"cut", a.cut}, {"reproduced", a.reproduced}, {"outcome", a.outcome}});
  }
  nlohmann::json out = {{"minimize_version", kMinimizeVersion},
                        {"tool", {{"name", "nanreplay"}, {"version", r.tool_version}}},
                        {"bundle", r.bundle},
                        {"out", r.written() ? nlohmann::json(r.out) : nlohmann::json(nullptr)},
                        {"finding", r.finding},
                        {"origin", first_nonfinite_json(r.origin)},
                        {"origin_after", first_nonfinite_json(r.origin_after)},
                        {"original_sample",
                         r.original_sample ? nlohmann::json(*r.original_sample) : nlohmann::json(nullptr)},
                        {"original_offset", r.origin && r.origin->original_offset ? nlohmann::json(*r.origin->original_offset)
                                                                                : nlohmann::json(nullptr)},
                        {"spike", spike_json(r.spike)},
                        {"spike_after", spike_json(r.spike_after)},
                        {"bit_flip", flip_json(r.flip)},
                        {"bit_flip_after", flip_json(r.flip_after)},
                        {"reason", r.reason.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.reason)},
                        {"not_minimized", r.not_minimized},
                        {"before", size_json(r.before)},
                        {"after", r.written() ? size_json(r.after) : nlohmann::json(nullptr)},
                        {"ratio", r.written() ? nlohmann::json(ratio(r)) : nlohmann::json(nullptr)},
                        {"kept", r.kept},
                        {"removed", r.removed},
                        {"kept_samples_original", r.kept_samples_original},
                        {"attempts", attempts},
                        {"reproduce", r.written() ? nlohmann::json(r.reproduce_command) : nlohmann::json(nullptr)},
                        {"elapsed_seconds", r.elapsed_seconds}};
  return out;
}

std::string render_minimize(const MinimizeReport& r, const TextStyle& style) {
  std::ostringstream out;
  out << "minimize  " << r.bundle << "\n";
  if (!r.origin && !r.flip && !r.spike) {
    out << paint(style, "1;32", "NOTHING TO MINIMIZE") << "  " << r.reason << "; nothing was written\n";
    if (!r.not_minimized.empty()) {
      out << "  error findings not minimized:";
      for (const std::string& code : r.not_minimized) out << " " << code;
      out << "\n";
    }
    return out.str();
  }
  if (r.origin) {
    const FirstNonfinite& f = *r.origin;
    out << paint(style, "1;31", "ORIGIN") << "  step " << f.step << ", " << phase_name(f.phase) << ", "
        << paint(style, "1", f.name());
    if (f.head >= 0) out << " head " << f.head;
    if (f.expert >= 0) out << " expert " << f.expert;
    if (f.sample >= 0) out << ", sample " << f.sample << " of the bundle" << run_numbering_note(f, " (also the run's index)");
  } else if (r.spike && r.spike->origin) {
    const SpikeOrigin& s = *r.spike->origin;
    out << paint(style, "1;31", "SPIKE") << "  step " << s.step << ", " << phase_name(s.phase) << ", "
        << paint(style, "1", s.name());
    if (s.head >= 0) out << " head " << s.head;
    if (s.expert >= 0) out << " expert " << s.expert;
    out << " (" << s.statistic << ", score " << format_number(s.score) << ")";
    if (s.sample >= 0) out << ", sample " << s.sample << " of the bundle";
  } else {
    const FlippedBit& f = *r.flip;
    out << paint(style, "1;31", "BIT FLIP") << "  step " << f.step << ", " << paint(style, "1", f.param)
        << " element " << bracketed_list(f.index) << ", bit " << f.bit << " (SYSTEM_BIT_FLIP, no non-finite value)\n"
        << "  shown by  " << f.param << " in steps/" << f.step << "/model.safetensors against AdamW from step "
        << f.step - 1 << ": " << format_number(f.before) << " became " << format_number(f.after);
  }
  out << "\n";
  for (const MinimizeAttempt& a : r.attempts) {
    out << "  " << (a.reproduced ? "kept    " : "rejected") << "  " << a.cut << ": " << a.outcome << "\n";
  }
  out << "\n  " << paint(style, "1", "kept") << "\n";
  for (const std::string& line : r.kept) out << "    " << line << "\n";
  out << "  " << paint(style, "1", "removed") << "\n";
  for (const std::string& line : r.removed) out << "    " << line << "\n";
  out << "\n  size    " << bytes_text(r.before.bytes) << " -> " << bytes_text(r.after.bytes) << "  (ratio "
      << format_number(ratio(r)) << ")\n"
      << "  steps " << r.before.steps << " -> " << r.after.steps << " | samples " << r.before.samples << " -> "
      << r.after.samples << " | layers " << r.before.layers << " -> " << r.after.layers << " | ranks "
      << r.before.world_size << " -> " << r.after.world_size << " | micro-batches " << r.before.grad_accum_steps
      << " -> " << r.after.grad_accum_steps << "\n"
      << "\n" << paint(style, "1;32", "WROTE") << "  " << r.out
      << (r.origin  ? " (replayed: same origin)\n"
          : r.spike ? " (replayed: same spike origin, reproduced)\n"
                    : " (update check replayed: same flipped bit)\n")
      << "  reproduce: " << r.reproduce_command << "\n";
  return out.str();
}

}  // namespace nanreplay
