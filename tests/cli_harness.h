// Runs the real nanreplay binary (the argv path users take) and captures its
// exit status, stdout and stderr: through the shell (run_cli) or with
// fork/exec (spawn_cli, for signals, resource limits, rusage, a working
// directory); plus scratch directories for tests.
#pragma once

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <iostream>
#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/cli.h"
#include "tests/synth_cache.h"

namespace nanreplay_test {

struct CliResult {
  int status = -1;
  std::string out;
  std::string err;
};

inline std::string slurp(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

inline std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

class ScratchDir {
 public:
  explicit ScratchDir(const std::string& tag) {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() /
            ("nanreplay-test-" + tag + "-" + std::to_string(getpid()) + "-" + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& leaf) const { return path_ / leaf; }

 private:
  std::filesystem::path path_;
};

// Whether `part` occurs in `text`; `text` split at its newlines (output of a run).
inline bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }
inline std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The CLI under test: the build's, or a copy named by NANREPLAY_TEST_CLI (so a
// run is not disturbed by a concurrent build relinking the build's binary).
inline std::string cli_under_test() {
  const char* copy = std::getenv("NANREPLAY_TEST_CLI");
  return copy != nullptr && *copy != '\0' ? copy : NANREPLAY_CLI_PATH;
}

// In a child after fork: stdin from /dev/null, stdout and stderr into the two
// files (created or truncated). Only async-signal-safe calls; false when one fails.
inline bool redirect_stdio(const char* out, const char* err) {
  const int in_fd = open("/dev/null", O_RDONLY);
  const int out_fd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  const int err_fd = open(err, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (in_fd < 0 || out_fd < 0 || err_fd < 0) return false;
  return dup2(in_fd, STDIN_FILENO) >= 0 && dup2(out_fd, STDOUT_FILENO) >= 0 && dup2(err_fd, STDERR_FILENO) >= 0;
}

// Whether run_cli may run the command in a forked copy of this test process
// (which links the CLI's code: run_cli of cli/cli.h, what main() calls) instead
// of executing the binary. Each exec pays LibTorch's start-up, about a second
// of CPU with Debian's LibTorch and its 280 libraries, which was most of the
// Catch2 suite's time; a fork costs milliseconds. The binary is still
// executed when the environment changes (`env`), when the command starts
// processes of its own from /proc/self/exe (--nproc), when this process runs
// another thread (a fork copies only the calling one: LibTorch's OpenMP pool
// would be missing in the child), and for every command with
// NANREPLAY_TEST_FORK_CLI=0. spawn_cli always executes the binary (signals,
// limits, rusage), as do the tests of what only the binary does.
inline bool fork_allowed(const std::vector<std::string>& args, const std::string& env) {
  const char* flag = std::getenv("NANREPLAY_TEST_FORK_CLI");
  if (!env.empty() || (flag != nullptr && std::string(flag) == "0")) return false;
  for (const std::string& a : args) {
    if (a == "--nproc" || a.rfind("--nproc=", 0) == 0) return false;
  }
  std::error_code ec;
  size_t threads = 0;
  for (std::filesystem::directory_iterator it("/proc/self/task", ec), end; !ec && it != end; it.increment(ec)) ++threads;
  return !ec && threads == 1;
}

// `nanreplay args...` as main() runs it, in a child of this process with
// stdin from /dev/null, stdout and stderr in the given files and NO_COLOR set;
// returns the wait status.
inline int run_cli_in_child(const std::vector<std::string>& args, const std::string& out, const std::string& err) {
  std::cout.flush();  // nothing of this process's output may reach the child's files
  std::cerr.flush();
  std::fflush(nullptr);
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // The defaults a new process starts with, not Catch2's fatal-signal handlers.
    for (const int sig : {SIGABRT, SIGSEGV, SIGFPE, SIGILL, SIGBUS, SIGINT, SIGTERM, SIGPIPE}) std::signal(sig, SIG_DFL);
    if (!redirect_stdio(out.c_str(), err.c_str())) _exit(126);
    setenv("NO_COLOR", "1", 1);
    nanreplay::CommandIo io{std::cout, std::cerr};
    io.err_is_terminal = false;  // a file, as for the binary run through the shell
    const int status = nanreplay::run_cli(args, io);
    std::cout.flush();
    std::cerr.flush();
    std::fflush(nullptr);
    _exit(status);  // not exit(): this process's static objects are Catch2's
  }
  int raw = 0;
  while (waitpid(pid, &raw, 0) < 0 && errno == EINTR) {
  }
  return raw;
}

// Runs `nanreplay <args...>` with NO_COLOR set and stdin closed; `env` is a
// shell prefix that changes the environment ("env -u VAR NAME=value").
inline CliResult run_cli_uncached(const std::vector<std::string>& args, const std::string& env = "") {
  static int counter = 0;
  const auto base = std::filesystem::temp_directory_path() /
                    ("nanreplay-cli-" + std::to_string(getpid()) + "-" + std::to_string(counter++));
  int raw = 0;
  if (fork_allowed(args, env)) {
    raw = run_cli_in_child(args, base.string() + ".out", base.string() + ".err");
  } else {
    std::string cmd = env + (env.empty() ? "" : " ") + "NO_COLOR=1 " + shell_quote(cli_under_test());
    for (const std::string& a : args) cmd += " " + shell_quote(a);
    cmd += " </dev/null >" + shell_quote(base.string() + ".out") + " 2>" + shell_quote(base.string() + ".err");
    raw = std::system(cmd.c_str());
  }
  CliResult result;
  result.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  result.out = slurp(base.string() + ".out");
  result.err = slurp(base.string() + ".err");
  std::filesystem::remove(base.string() + ".out");
  std::filesystem::remove(base.string() + ".err");
  return result;
}

// A cacheable synth (synth_cache.h) copied from the cache, filled on a miss.
inline CliResult cached_synth(const std::vector<std::string>& args, const std::filesystem::path& target) {
  namespace fs = std::filesystem;
  const fs::path entry = synth_cache::binary_folder(cli_under_test()) / synth_cache::key_of(args);
  std::error_code ec;
  if (!fs::exists(entry, ec)) {
    static int counter = 0;
    const fs::path filling = entry.string() + ".fill-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
    std::vector<std::string> filling_args = args;
    filling_args[2] = filling.string();
    const CliResult made = run_cli_uncached(filling_args);
    if (made.status != 0) {
      fs::remove_all(filling, ec);
      return run_cli_uncached(args);
    }
    // stdout/stderr beside the tree, written before the rename that publishes it.
    std::ofstream(filling.string() + ".out") << synth_cache::replace_all(made.out, filling.string(), synth_cache::kDirMark);
    std::ofstream(filling.string() + ".err") << synth_cache::replace_all(made.err, filling.string(), synth_cache::kDirMark);
    fs::rename(filling.string() + ".out", entry.string() + ".out", ec);
    fs::rename(filling.string() + ".err", entry.string() + ".err", ec);
    fs::rename(filling, entry, ec);
    if (ec) fs::remove_all(filling, ec);  // another process published it first
  }
  fs::copy(entry, target, fs::copy_options::recursive | fs::copy_options::copy_symlinks, ec);
  if (ec) {
    fs::remove_all(target, ec);
    return run_cli_uncached(args);
  }
  CliResult result;
  result.status = 0;
  result.out = synth_cache::replace_all(slurp(entry.string() + ".out"), synth_cache::kDirMark, target.string());
  result.err = synth_cache::replace_all(slurp(entry.string() + ".err"), synth_cache::kDirMark, target.string());
  return result;
}

// run_cli_uncached, but a plain `synth PRESET DIR` comes from the cache.
inline CliResult run_cli(const std::vector<std::string>& args, const std::string& env = "") {
  const auto target = synth_cache::cacheable_target(args, env);
  return target ? cached_synth(args, *target) : run_cli_uncached(args, env);
}

inline nlohmann::json read_json(const std::filesystem::path& path) {
  return nlohmann::json::parse(slurp(path));
}

// One clean-fp32 bundle (llama fp32, F32 checkpoints used in place, steps
// 100..103) per test process, for tests that copy it and break the copy.
inline const std::filesystem::path& shared_clean_bundle() {
  static ScratchDir dir("clean-fp32");
  static const std::filesystem::path bundle = [] {
    const std::filesystem::path path = dir / "bundle";
    REQUIRE(run_cli({"synth", "clean-fp32", path.string()}).status == 0);
    return path;
  }();
  return bundle;
}

// Writes `value` as the bundle's own JSON files are written (indented, a final newline).
inline void write_json(const std::filesystem::path& path, const nlohmann::json& value) {
  std::ofstream(path) << value.dump(2) << "\n";
}

inline size_t line_count(const std::string& text) {
  return static_cast<size_t>(std::count(text.begin(), text.end(), '\n'));
}

struct Spawned {
  pid_t pid = -1;
  std::filesystem::path out;
  std::filesystem::path err;
};

struct SpawnOptions {
  rlim_t address_space_limit = 0;       // > 0: RLIMIT_AS of the child
  std::filesystem::path cwd;            // empty: the test's
  std::vector<std::string> set_env;     // "NAME=value"
  std::vector<std::string> unset_env;   // "NAME"
  std::vector<std::string> wrapper;     // runs `wrapper... nanreplay args...` ("unshare", "--pid", ...)
};

// Starts `nanreplay args...` with NO_COLOR set, stdin from /dev/null and
// stdout/stderr in files under `scratch`.
inline Spawned spawn_cli(const ScratchDir& scratch, const std::vector<std::string>& args,
                         const SpawnOptions& options = {}) {
  static int counter = 0;
  Spawned child;
  child.out = scratch / ("spawn-" + std::to_string(counter) + ".out");
  child.err = scratch / ("spawn-" + std::to_string(counter++) + ".err");
  std::vector<std::string> argv_text = options.wrapper;
  argv_text.push_back(cli_under_test());
  argv_text.insert(argv_text.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& arg : argv_text) argv.push_back(arg.data());
  argv.push_back(nullptr);
  // The child's environment, built before fork: only async-signal-safe calls after it.
  std::vector<std::string> environment;
  std::vector<std::string> set_env = options.set_env;
  set_env.push_back("NO_COLOR=1");
  const auto name_of = [](const std::string& entry) { return entry.substr(0, entry.find('=')); };
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string name = name_of(*entry);
    const auto named = [&](const std::string& other) { return name_of(other) == name; };
    if (std::find(options.unset_env.begin(), options.unset_env.end(), name) != options.unset_env.end()) continue;
    if (std::any_of(set_env.begin(), set_env.end(), named)) continue;
    environment.push_back(*entry);
  }
  environment.insert(environment.end(), set_env.begin(), set_env.end());
  std::vector<char*> envp;
  for (std::string& entry : environment) envp.push_back(entry.data());
  envp.push_back(nullptr);
  child.pid = fork();
  REQUIRE(child.pid >= 0);
  if (child.pid == 0) {
    if (!redirect_stdio(child.out.c_str(), child.err.c_str())) _exit(127);
    if (options.address_space_limit > 0) {
      const rlimit limit{options.address_space_limit, options.address_space_limit};
      if (setrlimit(RLIMIT_AS, &limit) != 0) _exit(127);
    }
    if (!options.cwd.empty() && chdir(options.cwd.c_str()) != 0) _exit(127);
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  return child;
}

struct Finished {
  CliResult result;
  long max_rss_kib = 0;
};

// Waits for the child; a signal death reads as status 128 + signal, as in a shell.
inline Finished wait_cli(const Spawned& child) {
  int raw = 0;
  rusage usage{};
  REQUIRE(wait4(child.pid, &raw, 0, &usage) == child.pid);
  Finished done;
  done.result.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  done.result.out = slurp(child.out);
  done.result.err = slurp(child.err);
  done.max_rss_kib = usage.ru_maxrss;
  return done;
}

// Exit 2, one line "nanreplay: error: ..." naming each of `parts`.
inline void check_one_error_line(const CliResult& result, const std::vector<std::string>& parts) {
  INFO("stderr: " << result.err);
  CHECK(result.status == 2);
  CHECK(line_count(result.err) == 1);
  CHECK(result.err.rfind("nanreplay: error: ", 0) == 0);
  for (const std::string& part : parts) CHECK(result.err.find(part) != std::string::npos);
}

}  // namespace nanreplay_test
