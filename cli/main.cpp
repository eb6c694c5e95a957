// nanreplay's entry point: hands argv to the command table and returns its
// exit status. Everything else lives in cli/commands.cpp and the core library.
#include "cli/cli_support.h"
#include "cli/commands.h"

namespace {

// LibTorch's static initialisers take a few hundred milliseconds before
// main(); a SIGTERM then would end the process with 143. A .preinit_array
// entry runs before any shared library's initialiser, so from there on a stop
// signal exits 130 with one line like at any other time.
void install_stop_handlers_early(int, char**, char**) { nanreplay::install_stop_handlers(); }

}  // namespace

__attribute__((section(".preinit_array"), used)) void (*const nanreplay_preinit)(int, char**, char**) =
    install_stop_handlers_early;

int main(int argc, char** argv) { return nanreplay::run_cli(argc, argv); }
