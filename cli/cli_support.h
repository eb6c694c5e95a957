// What the command handlers share: option parsing that turns cxxopts errors
// into UsageError, the SIGINT/SIGTERM flag every long replay polls, colour
// detection, and the repeatable --what-if option of `run` and `bisect`.
#pragma once

#include <string>
#include <vector>

#include <cxxopts.hpp>

#include "loaders/manifest.h"
#include "replay/what_if.h"

namespace nanreplay {

cxxopts::ParseResult parse_or_usage(cxxopts::Options& options, int argc, char** argv);

// From here on SIGINT/SIGTERM only set a flag; replays poll it between passes.
void install_stop_handlers();
bool stop_requested();

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
