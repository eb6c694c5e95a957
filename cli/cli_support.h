// What the command handlers share: option parsing that turns cxxopts errors
// into UsageError, SIGINT/SIGTERM handling (process-wide, so it stays in the
// CLI), colour detection and printf-style text.
#pragma once

#include <exception>
#include <string>
#include <vector>

#include <cxxopts.hpp>

#include "cli/command_table.h"

namespace nanreplay {

// Parses `args` (the command's name first); UsageError naming the command's --help.
cxxopts::ParseResult parse_or_usage(cxxopts::Options& options, const CommandArgs& args);

// The candidate closest to `name` by edit distance, if within two edits:
// what "did you mean" suggests, for commands and flags alike.
std::string nearest_name(const std::string& name, const std::vector<std::string>& candidates);

// SIGINT/SIGTERM handling, installed before LibTorch's static initialisers
// run (cli/main.cpp) and again by run_cli. While no StopDeferral is alive
// nothing is on disk to clean up: a stop signal ends the process at once,
// exit 130 and one line. Inside a StopDeferral (a command that has staged
// output) it only sets a flag that the command polls at safe points; the
// command then throws Interrupted, which removes what it staged on its way to
// run_cli (exit 130). Idempotent; also unblocks the two signals (a parent
// may have started us with them blocked).
void install_stop_handlers();
bool stop_requested();
// The line an immediate stop prints (default "...; nothing was written").
void set_interrupted_message(const std::string& line);

class StopDeferral {
 public:
  StopDeferral();
  ~StopDeferral();
  StopDeferral(const StopDeferral&) = delete;
  StopDeferral& operator=(const StopDeferral&) = delete;
};

// The exit status and the one line an exception ends the command with (cli/cli.cpp's boundary).
struct CommandFailure {
  int exit_status;
  std::string line;  // after "nanreplay: "
};
CommandFailure describe_failure(std::exception_ptr error);

// NO_COLOR unset and `fd` a terminal.
bool color_wanted(int fd);

// printf into a string, for the handlers' fixed-width and %.Nf text.
std::string format_text(const char* format, ...) __attribute__((format(printf, 1, 2)));

}  // namespace nanreplay
