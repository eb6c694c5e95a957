// The one-line progress display on a terminal's stderr ("\r\033[K" redraws
// it): a replay's step, rank, micro-batch, elapsed time and estimate,
// bisect's stage, and scan-data's share done. Cleared when it goes out of
// scope, so an error or interruption line never lands behind it.
#pragma once

#include <chrono>
#include <ostream>
#include <string>

#include "replay/bisect.h"
#include "replay/replay_engine.h"

namespace nanreplay {

class ProgressLine {
 public:
  // Draws nothing unless `enabled` (the caller asks for progress and `err` is a terminal).
  ProgressLine(std::ostream& err, bool enabled);
  ~ProgressLine();
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

  void update(const ReplayProgress& p);
  void update(const BisectProgress& p);
  void update_scan(double fraction);
  void clear();

 private:
  void draw(const std::string& text);
  double seconds() const;

  std::ostream& err_;
  bool enabled_;
  bool shown_ = false;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace nanreplay
