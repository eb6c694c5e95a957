// What the command handlers share: option parsing that turns cxxopts errors
// into UsageError, SIGINT/SIGTERM handling (process-wide, so it stays in the
// CLI), colour detection and printf-style text.
#pragma once

#include <exception>
#include <string>
#include <vector>

#include <cxxopts.hpp>

#include "cli/command_table.h"
#include "loaders/base/error.h"

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
// Under --json an immediate stop also prints its error object on stdout (cli/cli.cpp sets it first).
void set_json_errors(bool json);

class StopDeferral {
 public:
  StopDeferral();
  ~StopDeferral();
  StopDeferral(const StopDeferral&) = delete;
  StopDeferral& operator=(const StopDeferral&) = delete;
};

// What an exception ends the command with (cli/cli.cpp's boundary): the exit
// status, the one line on stderr, and the same as --json's error object.
struct CommandFailure {
  int exit_status;
  std::string kind;     // failure_kind_name of its FailureKind
  std::string message;  // without any prefix
  bool names_input = false;  // an InputError: `file` and `key` (either may be empty) belong in the object
  std::string file;
  std::string key;
  std::string line;     // after "nanreplay: ": "error: " + message, or an interruption's own words
};
CommandFailure describe_failure(std::exception_ptr error);
// The error kinds a failure can have: usage (exit 2), bad_input (2), output
// (2, the output location cannot take the result), internal (3), interrupted
// (130); failure_kind_name holds their names, once.
enum class FailureKind { kUsage, kBadInput, kOutput, kInternal, kInterrupted };
const char* failure_kind_name(FailureKind kind);

// A failure not thrown (a command that reports one and returns its status); `line` is "error: " + message.
CommandFailure failure_of(ExitStatus status, FailureKind kind, const std::string& message);

// {"error": {"exit_code", "kind", "message"[, "file", "key"]}}: what --json prints on stdout for a failure.
std::string failure_json(const CommandFailure& failure);

// Whether the words ask for --json: errors are then printed as failure_json too.
bool json_requested(const std::vector<std::string>& args);

// NO_COLOR unset and `fd` a terminal.
bool color_wanted(int fd);

// printf into a string, for the handlers' fixed-width and %.Nf text.
std::string format_text(const char* format, ...) __attribute__((format(printf, 1, 2)));

}  // namespace nanreplay
