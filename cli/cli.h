// The nanreplay CLI as one function: `main` and the in-process tests call
// run_cli with the words after the program name and a CommandIo, the streams
// and terminal facts every command writes through (no handler touches
// std::cout, std::cerr or the file descriptors). It is the one error
// boundary: Interrupted ends in exit 130, InputError and UsageError in exit 2,
// anything else in exit 3, each with one line on the error stream ("nanreplay:
// error: ..." but for an interruption) and, when the words hold --json, the
// same as one {"error": {...}} object on the result stream.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace nanreplay {

struct CommandIo {
  std::ostream& out;  // results: the verdict, JSON, tables
  std::ostream& err;  // error lines and the progress line
  bool color = false;             // `out` wants colour (a terminal, NO_COLOR unset)
  bool err_is_terminal = false;   // progress lines on `err`
};

// `args`: the command and its arguments ({"run", "bundle/", "--out", "triage/"}).
// Returns the exit status (loaders/base/error.h).
int run_cli(const std::vector<std::string>& args, CommandIo& io);

}  // namespace nanreplay
