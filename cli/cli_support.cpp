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

#include <nlohmann/json.hpp>

#include "cli/terminal_guard.h"
#include "loaders/base/error.h"
#include "replay/step/ranks/distributed.h"

namespace nanreplay {

namespace {

std::atomic<int> g_stop_signal{0};
std::atomic<int> g_deferrals{0};
constexpr const char* kNothingWritten = "nanreplay: interrupted; nothing was written\n";
std::atomic<const char*> g_interrupted_message{kNothingWritten};
std::atomic<const char*> g_interrupted_json{nullptr};  // set under --json: the error object for stdout
std::atomic<bool> g_json_errors{false};

// Signal context: only atomics, write() and _exit().
void on_stop_signal(int signal_number) {
  g_stop_signal.store(signal_number);
  if (g_deferrals.load() > 0) return;
  const char* message = g_interrupted_message.load();
  ssize_t ignored = ::write(STDERR_FILENO, message, std::strlen(message));
  if (const char* json = g_interrupted_json.load()) ignored = ::write(STDOUT_FILENO, json, std::strlen(json));
  (void)ignored;
  ::_exit(static_cast<int>(ExitStatus::kInterrupted));
}

// The object an interruption prints under --json, for the signal handler (never freed, like the line).
const char* interrupted_json(const std::string& line) {
  const CommandFailure failure = failure_of(ExitStatus::kInterrupted, FailureKind::kInterrupted, line);
  return strdup((failure_json(failure) + "\n").c_str());
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
  if (g_json_errors.load()) g_interrupted_json.store(interrupted_json(terminal_safe(line)));
}

void set_json_errors(bool json) {
  g_json_errors.store(json);
  const std::string line = g_interrupted_message.load();  // "nanreplay: ...\n"
  g_interrupted_json.store(json ? interrupted_json(line.substr(11, line.size() - 12)) : nullptr);
}

const char* failure_kind_name(FailureKind kind) {
  static const char* const kNames[] = {"usage", "bad_input", "output", "internal", "interrupted"};
  return kNames[static_cast<int>(kind)];
}

CommandFailure failure_of(ExitStatus status, FailureKind kind, const std::string& message) {
  const bool interrupted = status == ExitStatus::kInterrupted;
  return {static_cast<int>(status), failure_kind_name(kind), message, false, "", "",
          (interrupted ? "" : "error: ") + message};
}

namespace {

CommandFailure input_failure(const InputError& e, FailureKind kind) {
  CommandFailure failure = failure_of(ExitStatus::kBadInput, kind, e.what());
  failure.names_input = true;
  failure.file = printable(e.file());
  failure.key = printable(e.key());
  return failure;
}

}  // namespace

CommandFailure describe_failure(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const Interrupted& stop) {
    return failure_of(ExitStatus::kInterrupted, FailureKind::kInterrupted, stop.what());
  } catch (const OutputError& e) {
    return input_failure(e, FailureKind::kOutput);
  } catch (const InputError& e) {
    return input_failure(e, FailureKind::kBadInput);
  } catch (const UsageError& e) {
    return failure_of(ExitStatus::kBadInput, FailureKind::kUsage, e.what());
  } catch (const PeerError& e) {
    // A peer's failure carries its status: the kind follows from it.
    const auto status = static_cast<ExitStatus>(e.exit_status());
    const FailureKind kind = status == ExitStatus::kInterrupted ? FailureKind::kInterrupted
                             : status == ExitStatus::kBadInput  ? FailureKind::kBadInput
                                                                : FailureKind::kInternal;
    CommandFailure failure = failure_of(status, kind, e.what());
    failure.exit_status = e.exit_status();
    return failure;
  } catch (const std::exception& e) {
    return failure_of(ExitStatus::kInternal, FailureKind::kInternal, std::string("internal error: ") + e.what());
  }
}

std::string failure_json(const CommandFailure& failure) {
  nlohmann::json error = {{"exit_code", failure.exit_status}, {"kind", failure.kind}, {"message", failure.message}};
  if (failure.names_input) {
    error["file"] = failure.file;
    error["key"] = failure.key;
  }
  // A message quotes bytes from a bundle, not always UTF-8: replaced, so the object is always written.
  return nlohmann::json{{"error", error}}.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
}

bool json_requested(const std::vector<std::string>& args) {
  return std::find(args.begin(), args.end(), "--json") != args.end();
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
