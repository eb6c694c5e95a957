// The CLI's single error boundary; see cli.h.
#include "cli/cli.h"

#include "cli/cli_support.h"
#include "cli/command_table.h"
#include "cli/terminal_guard.h"

namespace nanreplay {

int run_cli(const std::vector<std::string>& args, CommandIo& io) {
  // First: a stop signal at any time ends in exit 130 (cli_support.h).
  install_stop_handlers();
  // Every line printed, error lines included, passes the terminal guard.
  TerminalSafeStream out(io.out, io.color);
  TerminalSafeStream err(io.err, io.err_is_terminal);
  CommandIo guarded{out, err, io.color, io.err_is_terminal};
  try {
    return dispatch_command(args, guarded);
  } catch (...) {
    const CommandFailure failure = describe_failure(std::current_exception());
    guarded.err << "nanreplay: " << failure.line << "\n";
    return failure.exit_status;
  }
}

}  // namespace nanreplay
