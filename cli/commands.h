// The command table of the nanreplay CLI and its single error boundary:
// InputError and UsageError end in exit 2 with one line on stderr, anything
// else in exit 3.
#pragma once

namespace nanreplay {

int run_cli(int argc, char** argv);

}  // namespace nanreplay
