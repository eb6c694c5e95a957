// nanreplay's entry point: hands argv to the command table and returns its
// exit status. Everything else lives in cli/commands.cpp and the core library.
#include "cli/commands.h"

int main(int argc, char** argv) { return nanreplay::run_cli(argc, argv); }
