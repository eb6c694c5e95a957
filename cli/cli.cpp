// The CLI's single error boundary; see cli.h.
#include "cli/cli.h"

#include "cli/cli_support.h"
#include "cli/command_table.h"

namespace nanreplay {

int run_cli(const std::vector<std::string>& args, CommandIo& io) {
  // First: a stop signal at any time ends in exit 130 (cli_support.h).
  install_stop_handlers();
  try {
    return dispatch_command(args, io);
  } catch (...) {
    const CommandFailure failure = describe_failure(std::current_exception());
    io.err << "nanreplay: " << failure.line << "\n";
    return failure.exit_status;
  }
}

}  // namespace nanreplay
