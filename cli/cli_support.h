// What the command handlers share: option parsing that turns cxxopts errors
// into UsageError, SIGINT/SIGTERM handling, colour detection, and the
// repeatable --what-if option of `run` and `bisect`.
#pragma once

#include <string>
#include <vector>

#include <cxxopts.hpp>

#include "loaders/manifest.h"
#include "replay/what_if.h"

namespace nanreplay {

cxxopts::ParseResult parse_or_usage(cxxopts::Options& options, int argc, char** argv);

// SIGINT/SIGTERM handling, installed before LibTorch's static initialisers
// run (cli/main.cpp) and again by run_cli. While no StopDeferral is alive
// nothing is on disk to clean up: a stop signal ends the process at once,
// exit 130 and one line. Inside a StopDeferral (a command that has staged
// output) it only sets a flag that the command polls at safe points, removes
// what it staged and exits 130. Idempotent; also unblocks the two signals
// (blocked across the OpenMP re-exec, so one arriving then stays pending).
void install_stop_handlers();
bool stop_requested();
// The line an immediate stop prints (default "...; nothing was written").
void set_interrupted_message(const std::string& line);
// Prints `line` (one line, "nanreplay: " prefixed) and exits 130.
[[noreturn]] void exit_interrupted(const std::string& line);

// The poll of every replay loop: a bundle file that changed while mapped ends
// the command (InputError, exit 2) before a stop request is considered.
bool stop_or_changed_bundle();

class StopDeferral {
 public:
  StopDeferral();
  ~StopDeferral();
  StopDeferral(const StopDeferral&) = delete;
  StopDeferral& operator=(const StopDeferral&) = delete;
};

bool color_wanted(int fd);

// Adds `--what-if SPEC` (repeatable) to `options`.
void add_what_if_option(cxxopts::Options& options);
// Every --what-if in the order given, parsed (UsageError on a malformed one).
std::vector<WhatIf> parse_what_if_options(const cxxopts::ParseResult& args);
// Checks them against the bundle before anything is replayed (UsageError).
void check_what_ifs(const std::vector<WhatIf>& what_ifs, const Manifest& manifest);

// `nanreplay bisect` (cli/bisect_command.cpp).
int bisect_main(int argc, char** argv);

// "cuda:0,cuda:1" -> {"cuda:0", "cuda:1"}: the --device option of run and bisect.
std::vector<std::string> split_devices(const std::string& text);

}  // namespace nanreplay
