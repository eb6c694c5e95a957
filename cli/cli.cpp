// The CLI's single error boundary; see cli.h.
#include "cli/cli.h"

#include "cli/cli_support.h"
#include "cli/command_table.h"
#include "cli/launch.h"
#include "cli/progress_line.h"
#include "cli/terminal_guard.h"

namespace nanreplay {

int run_cli(const std::vector<std::string>& args, CommandIo& io) {
  // First: a stop signal at any time ends in exit 130 (cli_support.h).
  install_stop_handlers();
  const bool json = json_requested(args);
  set_json_errors(json);
  // Every line printed, error lines included, passes the terminal guard;
  // --progress=tty draws the in-place line even where stderr is no terminal.
  TerminalSafeStream out(io.out, io.color);
  TerminalSafeStream err(io.err, io.err_is_terminal || progress_drawn_in_place(args));
  CommandIo guarded{out, err, io.color, io.err_is_terminal};
  try {
    return dispatch_command(args, guarded);
  } catch (...) {
    // The one place a failure is told: a line on stderr always, and under --json its object on stdout.
    const CommandFailure failure = describe_failure(std::current_exception());
    guarded.err << "nanreplay: " << failure.line << "\n";
    if (json && !is_secondary_process()) guarded.out << failure_json(failure) << "\n";
    return failure.exit_status;
  }
}

}  // namespace nanreplay
