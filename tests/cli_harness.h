// Runs the real nanreplay binary (the argv path users take) and captures its
// exit status, stdout and stderr; plus scratch directories for tests.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

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

// Runs `nanreplay <args...>` with NO_COLOR set and stdin closed; `env` is a
// shell prefix that changes the environment ("env -u VAR NAME=value").
inline CliResult run_cli(const std::vector<std::string>& args, const std::string& env = "") {
  static int counter = 0;
  const auto base = std::filesystem::temp_directory_path() /
                    ("nanreplay-cli-" + std::to_string(getpid()) + "-" + std::to_string(counter++));
  std::string cmd = env + (env.empty() ? "" : " ") + "NO_COLOR=1 " + shell_quote(NANREPLAY_CLI_PATH);
  for (const std::string& a : args) cmd += " " + shell_quote(a);
  cmd += " </dev/null >" + shell_quote(base.string() + ".out") + " 2>" + shell_quote(base.string() + ".err");
  const int raw = std::system(cmd.c_str());
  CliResult result;
  result.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  result.out = slurp(base.string() + ".out");
  result.err = slurp(base.string() + ".err");
  std::filesystem::remove(base.string() + ".out");
  std::filesystem::remove(base.string() + ".err");
  return result;
}

inline nlohmann::json read_json(const std::filesystem::path& path) {
  return nlohmann::json::parse(slurp(path));
}

}  // namespace nanreplay_test
