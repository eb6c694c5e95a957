// Shared helpers of the command handlers; see cli_support.h.
#include "cli/cli_support.h"

#include <sstream>

#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdlib>

#include "loaders/error.h"

namespace nanreplay {

namespace {

std::atomic<int> g_stop_signal{0};

void on_stop_signal(int signal) { g_stop_signal.store(signal); }

}  // namespace

cxxopts::ParseResult parse_or_usage(cxxopts::Options& options, int argc, char** argv) {
  try {
    return options.parse(argc, argv);
  } catch (const cxxopts::exceptions::exception& e) {
    throw UsageError(std::string(e.what()) + " (see nanreplay " + options.program().substr(10) + " --help)");
  }
}

void install_stop_handlers() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
}

bool stop_requested() { return g_stop_signal.load() != 0; }

bool color_wanted(int fd) { return std::getenv("NO_COLOR") == nullptr && isatty(fd); }

void add_what_if_option(cxxopts::Options& options) {
  // A plain string, read back from arguments(): a vector option would split
  // "drop-samples=12,40" at its comma.
  options.add_options()("what-if", "replay the first non-finite step with one change (repeatable; see below)",
                        cxxopts::value<std::string>(), "SPEC");
}

std::vector<WhatIf> parse_what_if_options(const cxxopts::ParseResult& args) {
  std::vector<WhatIf> what_ifs;
  for (const cxxopts::KeyValue& kv : args.arguments()) {
    if (kv.key() == "what-if") what_ifs.push_back(parse_what_if(kv.value()));
  }
  return what_ifs;
}

void check_what_ifs(const std::vector<WhatIf>& what_ifs, const Manifest& manifest) {
  for (const WhatIf& w : what_ifs) check_what_if(w, manifest);
}

std::vector<std::string> split_devices(const std::string& text) {
  std::vector<std::string> devices;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) devices.push_back(item);
  return devices;
}

}  // namespace nanreplay
