// The one table of nanreplay's subcommands: it drives dispatch, the listing
// in `nanreplay --help` and "did you mean" suggestions. Each handler lives in
// its own file (cli/<name>_command.cpp), parses its options, calls the core
// library once and renders through its CommandIo.
#pragma once

#include <string>
#include <vector>

#include "cli/cli.h"

namespace nanreplay {

// The command's name first, then its arguments (argv as the handler sees it).
using CommandArgs = std::vector<std::string>;
using CommandHandler = int (*)(const CommandArgs& args, CommandIo& io);

struct Command {
  const char* name;
  const char* summary;
  const char* example;
  CommandHandler handler;
  // What each exit status means for this command, as its --help ends ("0 ..., 1 ..., 2 ...").
  // The same in every command: 0 done with nothing to report, 1 done with the other answer (never an
  // error), 2 bad usage or bad input, 3 internal error, 130 interrupted (docs/commands.md).
  const char* exit_status;
};

const std::vector<Command>& command_table();

// "\nexit status: ...\n" of the command `name`, for the end of its --help.
std::string exit_status_help(const std::string& name);

// Runs the command `args` names. No command: the usage text, exit 2; an
// unknown one: UsageError with the nearest name.
int dispatch_command(const CommandArgs& args, CommandIo& io);

int run_command(const CommandArgs& args, CommandIo& io);        // cli/run_command.cpp
int bisect_command(const CommandArgs& args, CommandIo& io);     // cli/bisect_command.cpp
int minimize_command(const CommandArgs& args, CommandIo& io);   // cli/minimize_command.cpp
int demo_command(const CommandArgs& args, CommandIo& io);       // cli/demo_command.cpp
int scan_data_command(const CommandArgs& args, CommandIo& io);  // cli/scan_data_command.cpp
int synth_command(const CommandArgs& args, CommandIo& io);      // cli/synth_command.cpp
int inspect_command(const CommandArgs& args, CommandIo& io);    // cli/inspect_command.cpp
int import_command(const CommandArgs& args, CommandIo& io);     // cli/import_command.cpp
int trace_command(const CommandArgs& args, CommandIo& io);      // cli/trace_command.cpp
int version_command(const CommandArgs& args, CommandIo& io);    // here
int completion_command(const CommandArgs& args, CommandIo& io); // cli/completion_command.cpp

}  // namespace nanreplay
