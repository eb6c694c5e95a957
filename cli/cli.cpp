// The CLI's single error boundary; see cli.h.
#include "cli/cli.h"

#include "cli/cli_support.h"
#include "cli/command_table.h"
#include "loaders/error.h"

namespace nanreplay {

int run_cli(const std::vector<std::string>& args, CommandIo& io) {
  // First: a stop signal at any time ends in exit 130 (cli_support.h).
  install_stop_handlers();
  try {
    return dispatch_command(args, io);
  } catch (const Interrupted& stop) {
    io.err << "nanreplay: " << stop.what() << "\n";
    return static_cast<int>(ExitStatus::kInterrupted);
  } catch (const InputError& e) {
    io.err << "nanreplay: error: " << e.what() << "\n";
    return static_cast<int>(ExitStatus::kBadInput);
  } catch (const UsageError& e) {
    io.err << "nanreplay: error: " << e.what() << "\n";
    return static_cast<int>(ExitStatus::kBadInput);
  } catch (const std::exception& e) {
    io.err << "nanreplay: internal error: " << e.what() << "\n";
    return static_cast<int>(ExitStatus::kInternal);
  }
}

}  // namespace nanreplay
