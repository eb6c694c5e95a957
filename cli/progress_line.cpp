// Progress on stderr, in place or as plain lines; see progress_line.h.
#include "cli/progress_line.h"

#include <cstdlib>
#include <utility>

#include "cli/cli_support.h"
#include "loaders/base/error.h"

namespace nanreplay {

const char* const kProgressModeNames[4] = {"auto", "tty", "plain", "none"};

double plain_progress_interval() {
  const char* given = std::getenv("NANREPLAY_PROGRESS_INTERVAL");
  if (given == nullptr || *given == '\0') return 5.0;
  char* end = nullptr;
  const double seconds = std::strtod(given, &end);
  // A value that is not a number of seconds is ignored rather than fatal: progress is never worth a failed run.
  return end != given && *end == '\0' && seconds >= 0 ? seconds : 5.0;
}

void add_progress_flag(cxxopts::Options& options) {
  options.add_options()("progress",
                        "auto (in place on a terminal, else a plain line every 5s), tty, plain or none "
                        "(default: auto; none with --quiet)",
                        cxxopts::value<std::string>(), "WHEN");
}

ProgressMode progress_mode(const cxxopts::ParseResult& args, bool quiet) {
  if (!args.count("progress")) return quiet ? ProgressMode::kNone : ProgressMode::kAuto;
  const std::string given = args["progress"].as<std::string>();
  for (int i = 0; i < 4; ++i) {
    if (given == kProgressModeNames[i]) return static_cast<ProgressMode>(i);
  }
  throw UsageError("--progress " + given + ": auto, tty, plain or none");
}

bool progress_drawn_in_place(const std::vector<std::string>& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--progress=tty" || (args[i] == "--progress" && i + 1 < args.size() && args[i + 1] == "tty")) {
      return true;
    }
  }
  return false;
}

ProgressLine::ProgressLine(std::ostream& err, ProgressMode mode, bool err_is_terminal, std::string command)
    : err_(err), command_(std::move(command)), start_(std::chrono::steady_clock::now()) {
  in_place_ = mode == ProgressMode::kTty || (mode == ProgressMode::kAuto && err_is_terminal);
  plain_ = mode == ProgressMode::kPlain || (mode == ProgressMode::kAuto && !err_is_terminal);
  if (plain_) interval_ = plain_progress_interval();
}

ProgressLine::~ProgressLine() { clear(); }

void ProgressLine::update(const ReplayProgress& p) {
  if (!in_place_ && !plain_) return;
  const double elapsed = seconds();
  const double done = static_cast<double>(p.step_index);
  const std::string eta =
      done > 0 ? std::to_string(static_cast<int>(elapsed / done * (p.step_count - done))) + "s" : "?";
  // A layer-streamed step is long: it says which block it is in.
  const std::string block = p.layer >= 0 ? format_text(" layer %d/%d", p.layer + 1, p.num_layers) : "";
  show(format_text("replaying step %lld (%zu/%zu), rank %d, micro-batch %d, %s%s  %.1fs elapsed, ~%s left",
                   static_cast<long long>(p.step), p.step_index + 1, p.step_count, p.rank, p.micro_batch,
                   p.phase.c_str(), block.c_str(), elapsed, eta.c_str()));
}

void ProgressLine::update(const BisectProgress& p) {
  if (!in_place_ && !plain_) return;
  // minimize bisects first: its lines say so; bisect's own plain lines already name it.
  const std::string what = command_ == "bisect" && plain_ ? "" : "bisect: ";
  show(what + format_text("%s stage, step %lld, replay %lld  %.1fs elapsed", p.stage.c_str(),
                          static_cast<long long>(p.step), static_cast<long long>(p.replays + 1), seconds()));
}

void ProgressLine::update_scan(double fraction) {
  if (in_place_ || plain_) show(format_text("scanning %.0f%%  %.1fs elapsed", fraction * 100, seconds()));
}

void ProgressLine::clear() {
  if (shown_) err_ << "\r\033[K" << std::flush;
  shown_ = false;
}

void ProgressLine::show(const std::string& text) {
  if (in_place_) {
    err_ << "\r\033[K  " << text << std::flush;
    shown_ = true;
    return;
  }
  // A log gets a line when the interval has passed since the start or the last line, not on every update.
  const double now = seconds();
  if (now < last_plain_ + interval_) return;
  last_plain_ = now;
  err_ << "nanreplay: " << command_ << ": " << text << std::endl;
}

double ProgressLine::seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

}  // namespace nanreplay
