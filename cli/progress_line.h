// Progress of a long command on stderr, as --progress asks (auto, tty,
// plain, none): on a terminal one line redrawn in place ("\r\033[K"), in a
// log a plain line at most every few seconds ("nanreplay: run: replaying
// step 103 (2/4), ..."), so a runbook's log shows where a replay is. What it
// says: a replay's step, rank, micro-batch, elapsed time and estimate,
// bisect's stage, scan-data's share done. Never coloured. The in-place line
// is cleared when it goes out of scope, so an error or interruption line
// never lands behind it.
#pragma once

#include <chrono>
#include <ostream>
#include <string>
#include <vector>

#include <cxxopts.hpp>

#include "replay/workflows/bisect.h"
#include "replay/workflows/replay_engine.h"

namespace nanreplay {

// The values --progress takes, named once (kProgressModeNames, in this order).
enum class ProgressMode { kAuto, kTty, kPlain, kNone };
extern const char* const kProgressModeNames[4];

// Seconds between plain lines: 5, or NANREPLAY_PROGRESS_INTERVAL (seconds, for tests and impatient logs).
double plain_progress_interval();

// Declares --progress on a command's options.
void add_progress_flag(cxxopts::Options& options);
// The mode asked for: --progress, else none under --quiet (`quiet`), else auto. UsageError on another value.
ProgressMode progress_mode(const cxxopts::ParseResult& args, bool quiet);
// Whether the words ask for --progress=tty (or --progress tty): stderr's terminal guard then passes the redraw codes.
bool progress_drawn_in_place(const std::vector<std::string>& args);

class ProgressLine {
 public:
  // `command` names the command in plain lines; `err_is_terminal` decides what auto shows.
  ProgressLine(std::ostream& err, ProgressMode mode, bool err_is_terminal, std::string command);
  ~ProgressLine();
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

  void update(const ReplayProgress& p);
  void update(const BisectProgress& p);
  void update_scan(double fraction);
  void clear();

 private:
  void show(const std::string& text);
  double seconds() const;

  std::ostream& err_;
  bool in_place_ = false;
  bool plain_ = false;
  std::string command_;
  double interval_ = 5.0;
  double last_plain_ = 0.0;  // seconds since start of the last plain line (none yet: 0)
  bool shown_ = false;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace nanreplay
