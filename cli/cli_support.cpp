// Shared helpers of the command handlers; see cli_support.h.
#include "cli/cli_support.h"

#include <sstream>

#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "loaders/error.h"
#include "loaders/mapped_file.h"

namespace nanreplay {

namespace {

std::atomic<int> g_stop_signal{0};
std::atomic<int> g_deferrals{0};
constexpr const char* kNothingWritten = "nanreplay: interrupted; nothing was written\n";
std::atomic<const char*> g_interrupted_message{kNothingWritten};

// Signal context: only atomics, write() and _exit().
void on_stop_signal(int signal_number) {
  g_stop_signal.store(signal_number);
  if (g_deferrals.load() > 0) return;
  const char* message = g_interrupted_message.load();
  const ssize_t ignored = ::write(STDERR_FILENO, message, std::strlen(message));
  (void)ignored;
  ::_exit(static_cast<int>(ExitStatus::kInterrupted));
}

// Blocked across the OpenMP re-exec (cli/openmp_wait.cpp): unblocked once handled.
void unblock_stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
}

}  // namespace

StopDeferral::StopDeferral() { g_deferrals.fetch_add(1); }
StopDeferral::~StopDeferral() { g_deferrals.fetch_sub(1); }

cxxopts::ParseResult parse_or_usage(cxxopts::Options& options, int argc, char** argv) {
  try {
    return options.parse(argc, argv);
  } catch (const cxxopts::exceptions::exception& e) {
    throw UsageError(std::string(e.what()) + " (see nanreplay " + options.program().substr(10) + " --help)");
  }
}

void install_stop_handlers() {
  for (const int signal_number : {SIGINT, SIGTERM}) {
    struct sigaction previous {};
    sigaction(signal_number, nullptr, &previous);
    // A signal the caller chose to ignore (a background job's SIGINT) stays ignored.
    if ((previous.sa_flags & SA_SIGINFO) == 0 && previous.sa_handler == SIG_IGN) continue;
    struct sigaction action {};
    action.sa_handler = on_stop_signal;
    sigemptyset(&action.sa_mask);
    sigaction(signal_number, &action, nullptr);
  }
  unblock_stop_signals();
}

bool stop_requested() { return g_stop_signal.load() != 0; }

bool stop_or_changed_bundle() {
  throw_if_mapped_file_changed();
  return stop_requested();
}

void set_interrupted_message(const std::string& line) {
  // Read in signal context, so never freed: set once or twice per run.
  g_interrupted_message.store(strdup(("nanreplay: " + line + "\n").c_str()));
}

void exit_interrupted(const std::string& line) {
  std::fprintf(stderr, "nanreplay: %s\n", line.c_str());
  std::fflush(stderr);
  std::_Exit(static_cast<int>(ExitStatus::kInterrupted));
}

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
