// Shared helpers of the command handlers; see cli_support.h.
#include "cli/cli_support.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <csignal>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cli/terminal_guard.h"
#include "loaders/error.h"
#include "replay/distributed.h"

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

// A parent may start us with them blocked (a launcher's own handling): unblocked once handled.
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

namespace {

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// Every --flag a command's help names: the one list of what it accepts.
std::vector<std::string> flags_in_help(const std::string& help) {
  std::vector<std::string> flags;
  for (size_t at = help.find("--"); at != std::string::npos; at = help.find("--", at + 2)) {
    size_t end = at + 2;
    while (end < help.size() && (std::isalnum(static_cast<unsigned char>(help[end])) || help[end] == '-')) ++end;
    if (end > at + 2) flags.push_back(help.substr(at, end - at));
  }
  return flags;
}

// The first argument that looks like a flag the command does not know.
std::string unknown_flag(const CommandArgs& args, const std::vector<std::string>& known) {
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string flag = args[i].substr(0, args[i].find('='));
    if (flag.rfind("--", 0) == 0 && std::find(known.begin(), known.end(), flag) == known.end()) return flag;
  }
  return "";
}

}  // namespace

std::string nearest_name(const std::string& name, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_distance = 3;
  for (const std::string& candidate : candidates) {
    const size_t d = edit_distance(name, candidate);
    if (d < best_distance) {
      best_distance = d;
      best = candidate;
    }
  }
  return best;
}

cxxopts::ParseResult parse_or_usage(cxxopts::Options& options, const CommandArgs& args) {
  std::vector<const char*> argv;
  for (const std::string& arg : args) argv.push_back(arg.c_str());
  argv.push_back(nullptr);
  const std::string see = " (see nanreplay " + options.program().substr(10) + " --help)";
  try {
    return options.parse(static_cast<int>(args.size()), argv.data());
  } catch (const cxxopts::exceptions::no_such_option& e) {
    const std::vector<std::string> known = flags_in_help(options.help());
    const std::string flag = unknown_flag(args, known);
    if (flag.empty()) throw UsageError(std::string(e.what()) + see);  // a short option
    const std::string suggestion = nearest_name(flag, known);
    throw UsageError("unknown option '" + flag + "'" +
                     (suggestion.empty() ? "" : "; did you mean '" + suggestion + "'?") + see);
  } catch (const cxxopts::exceptions::exception& e) {
    throw UsageError(std::string(e.what()) + see);
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

void set_interrupted_message(const std::string& line) {
  // Read in signal context, so never freed: set once or twice per run.
  // Written by the signal handler itself, past the terminal guard: escaped here.
  g_interrupted_message.store(strdup(("nanreplay: " + terminal_safe(line) + "\n").c_str()));
}

CommandFailure describe_failure(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const Interrupted& stop) {
    return {static_cast<int>(ExitStatus::kInterrupted), stop.what()};
  } catch (const InputError& e) {
    return {static_cast<int>(ExitStatus::kBadInput), std::string("error: ") + e.what()};
  } catch (const UsageError& e) {
    return {static_cast<int>(ExitStatus::kBadInput), std::string("error: ") + e.what()};
  } catch (const PeerError& e) {
    const bool interrupted = e.exit_status() == static_cast<int>(ExitStatus::kInterrupted);
    return {e.exit_status(), (interrupted ? "" : "error: ") + std::string(e.what())};
  } catch (const std::exception& e) {
    return {static_cast<int>(ExitStatus::kInternal), std::string("internal error: ") + e.what()};
  }
}

bool color_wanted(int fd) { return std::getenv("NO_COLOR") == nullptr && isatty(fd); }

std::string format_text(const char* format, ...) {
  va_list args;
  va_start(args, format);
  va_list again;
  va_copy(again, args);
  const int size = std::vsnprintf(nullptr, 0, format, args);
  va_end(args);
  std::string text(size > 0 ? static_cast<size_t>(size) : 0, '\0');
  if (size > 0) std::vsnprintf(text.data(), text.size() + 1, format, again);
  va_end(again);
  return text;
}

}  // namespace nanreplay
