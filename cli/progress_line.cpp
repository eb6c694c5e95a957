// The terminal progress line; see progress_line.h.
#include "cli/progress_line.h"

#include "cli/cli_support.h"

namespace nanreplay {

ProgressLine::ProgressLine(std::ostream& err, bool enabled)
    : err_(err), enabled_(enabled), start_(std::chrono::steady_clock::now()) {}

ProgressLine::~ProgressLine() { clear(); }

void ProgressLine::update(const ReplayProgress& p) {
  if (!enabled_) return;
  const double elapsed = seconds();
  const double done = static_cast<double>(p.step_index);
  const std::string eta =
      done > 0 ? std::to_string(static_cast<int>(elapsed / done * (p.step_count - done))) + "s" : "?";
  // A layer-streamed step is long: it says which block it is in.
  const std::string block = p.layer >= 0 ? format_text(" layer %d/%d", p.layer + 1, p.num_layers) : "";
  draw(format_text("  replaying step %lld (%zu/%zu), rank %d, micro-batch %d, %s%s  %.1fs elapsed, ~%s left",
                   static_cast<long long>(p.step), p.step_index + 1, p.step_count, p.rank, p.micro_batch,
                   p.phase.c_str(), block.c_str(), elapsed, eta.c_str()));
}

void ProgressLine::update(const BisectProgress& p) {
  if (!enabled_) return;
  draw(format_text("  bisect: %s stage, step %lld, replay %lld  %.1fs elapsed", p.stage.c_str(),
                   static_cast<long long>(p.step), static_cast<long long>(p.replays + 1), seconds()));
}

void ProgressLine::update_scan(double fraction) {
  if (enabled_) draw(format_text("  scanning %.0f%%", fraction * 100));
}

void ProgressLine::clear() {
  if (shown_) err_ << "\r\033[K" << std::flush;
  shown_ = false;
}

void ProgressLine::draw(const std::string& text) {
  err_ << "\r\033[K" << text << std::flush;
  shown_ = true;
}

double ProgressLine::seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

}  // namespace nanreplay
