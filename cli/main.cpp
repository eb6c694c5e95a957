// nanreplay's entry point: builds the real CommandIo (std::cout, std::cerr,
// the terminal facts) and hands the arguments to run_cli (cli/cli.h), which
// returns the exit status. Everything else lives in cli/ and the core library.
#include <unistd.h>

#include <iostream>
#include <string>
#include <vector>

#include "cli/cli.h"
#include "cli/cli_support.h"

namespace {

// LibTorch's static initialisers take a few hundred milliseconds before
// main(); a SIGTERM then would end the process with 143. A .preinit_array
// entry runs before any shared library's initialiser, so from there on a stop
// signal exits 130 with one line like at any other time.
void install_stop_handlers_early(int, char**, char**) { nanreplay::install_stop_handlers(); }

}  // namespace

__attribute__((section(".preinit_array"), used)) void (*const nanreplay_preinit)(int, char**, char**) =
    install_stop_handlers_early;

int main(int argc, char** argv) {
  nanreplay::CommandIo io{std::cout, std::cerr};
  io.color = nanreplay::color_wanted(STDOUT_FILENO);
  io.err_is_terminal = isatty(STDERR_FILENO) != 0;
  const std::vector<std::string> args(argv + (argc > 0 ? 1 : 0), argv + argc);
  return nanreplay::run_cli(args, io);
}
