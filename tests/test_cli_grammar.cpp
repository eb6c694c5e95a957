// One grammar for every command, through the real binary: what an exit
// status means (minimize's 0 is "MIN written"; run and bisect agree on a
// bundle whose replay does not reproduce the log), --json's error object on
// stdout beside one stderr line, warnings on stderr only, one error prefix,
// and --progress's plain lines for logs (docs/commands.md).
#include <chrono>
#include <csignal>
#include <string>
#include <vector>

#include "cli/command_table.h"
#include "tests/cli_harness.h"

using namespace nanreplay_test;

namespace {

// --json failed: stdout is one JSON object whose error has this exit code and kind, stderr one error line.
nlohmann::json check_json_error(const CliResult& result, int exit_code, const std::string& kind) {
  INFO("stdout: " << result.out << "\nstderr: " << result.err);
  CHECK(result.status == exit_code);
  CHECK(line_count(result.err) == 1);
  CHECK(result.err.rfind("nanreplay: error: ", 0) == 0);
  const nlohmann::json parsed = nlohmann::json::parse(result.out, nullptr, false);
  REQUIRE(parsed.is_object());
  CHECK(parsed.size() == 1);
  const nlohmann::json& error = parsed["error"];
  CHECK(error["exit_code"] == exit_code);
  CHECK(error["kind"] == kind);
  // The stderr line is the same message, after the one prefix.
  CHECK(result.err == "nanreplay: error: " + error["message"].get<std::string>() + "\n");
  return error;
}

}  // namespace

TEST_CASE("minimize exits 0 when it writes MIN and 1 when there is nothing to minimize", "[cli][grammar]") {
  ScratchDir dir("grammar-minimize");
  REQUIRE(run_cli({"synth", "head-overflow", (dir / "fault").string()}).status == 0);
  REQUIRE(run_cli({"synth", "clean-fp32", (dir / "clean").string()}).status == 0);

  const CliResult written = run_cli({"minimize", (dir / "fault").string(), "--out", (dir / "min").string(), "--json"});
  INFO(written.err);
  CHECK(written.status == 0);
  CHECK(nlohmann::json::parse(written.out)["finding"] == "origin");
  CHECK(std::filesystem::exists(dir / "min" / "manifest.json"));

  const CliResult nothing = run_cli({"minimize", (dir / "clean").string(), "--out", (dir / "none").string(), "--json"});
  INFO(nothing.err);
  CHECK(nothing.status == 1);
  const nlohmann::json report = nlohmann::json::parse(nothing.out);
  CHECK(report["finding"] == "none");
  CHECK(report["out"].is_null());
  CHECK_FALSE(report.contains("error"));  // 1 is an answer, not an error
  CHECK_FALSE(std::filesystem::exists(dir / "none"));
}

TEST_CASE("run and bisect exit alike on the same bundle, a replay that does not reproduce the log included",
          "[cli][grammar]") {
  ScratchDir dir("grammar-agree");
  for (const auto& [preset, expected] : std::vector<std::pair<std::string, int>>{
           {"not-reproducible", 1}, {"clean-fp32", 0}, {"head-overflow", 1}}) {
    const std::filesystem::path bundle = dir / preset;
    REQUIRE(run_cli({"synth", preset, bundle.string()}).status == 0);
    const CliResult run = run_cli({"run", bundle.string(), "--out", (dir / (preset + "-out")).string(), "--quiet"});
    const CliResult bisect = run_cli({"bisect", bundle.string(), "--quiet"});
    INFO(preset << ": run " << run.err << " bisect " << bisect.err);
    CHECK(run.status == expected);
    CHECK(bisect.status == expected);
  }
}

TEST_CASE("json errors: one object on stdout naming the file, one line on stderr, on every command",
          "[cli][grammar]") {
  ScratchDir dir("grammar-json");
  const std::string missing = (dir / "no-such-bundle").string();
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"run", missing, "--out", (dir / "out").string(), "--json"},
           {"bisect", missing, "--json"},
           {"minimize", missing, "--out", (dir / "min").string(), "--json"},
           {"inspect", missing, "--json"},
           {"scan-data", missing, "--json"}}) {
    INFO(args[0]);
    const nlohmann::json error = check_json_error(run_cli(args), 2, "bad_input");
    CHECK(error["file"] == missing);
    CHECK(error.contains("key"));
  }
  const nlohmann::json trace = check_json_error(run_cli({"trace", (dir / "none.h5").string(), "--json"}), 2, "bad_input");
  CHECK(contains(trace["message"].get<std::string>(), "none.h5"));
  // Bad usage, before any command parses its flags, and in commands that had no --json before.
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"runn", "--json"}, {"run", "--json"}, {"version", "--bogus", "--json"},
           {"completion", "tcsh", "--json"}, {"demo", "--json", "--progress", "sometimes"}}) {
    INFO(args[0]);
    const nlohmann::json error = check_json_error(run_cli(args), 2, "usage");
    CHECK_FALSE(error.contains("file"));
  }
  // import's helper finds the checkpoint missing: the command tells it like any error.
  const nlohmann::json import = check_json_error(
      run_cli({"import", "--json", "--checkpoint", (dir / "nothing-here").string(), "--data", "d.bin", "--seq-len",
               "8", "--micro-batch-size", "1", "--sampler-seed", "1", "--log", "l.jsonl", "--steps", "1:2", "--out",
               (dir / "imported").string()}),
      2, "bad_input");
  CHECK(contains(import["file"].get<std::string>(), "nothing-here"));
  CHECK_FALSE(std::filesystem::exists(dir / "imported"));
}

TEST_CASE("json where it was missing: version, demo's usage, synth and completion print one object",
          "[cli][grammar]") {
  const CliResult version = run_cli({"version", "--json"});
  REQUIRE(version.status == 0);
  const nlohmann::json v = nlohmann::json::parse(version.out);
  CHECK(v["version"].is_string());
  CHECK(v["blas"]["threading"].is_string());
  const CliResult completion = run_cli({"completion", "bash", "--json"});
  REQUIRE(completion.status == 0);
  CHECK(contains(nlohmann::json::parse(completion.out)["script"].get<std::string>(), "complete -o filenames"));
  ScratchDir dir("grammar-json-ok");
  const CliResult synth = run_cli({"synth", "clean-fp32", (dir / "b").string(), "--json"});
  REQUIRE(synth.status == 0);
  CHECK(nlohmann::json::parse(synth.out)["bundle"] == (dir / "b").string());
  // Every command's help lists --json and ends with what its exit statuses mean.
  for (const nanreplay::Command& command : nanreplay::command_table()) {
    const CliResult help = run_cli({command.name, "--help"});
    INFO(command.name);
    CHECK(help.status == 0);
    CHECK(contains(help.out, "--json"));
    CHECK(contains(help.out, std::string("\nexit status: ") + command.exit_status + "\n"));
  }
}

TEST_CASE("import's warnings go to stderr, never stdout, in text and under --json", "[cli][grammar]") {
  ScratchDir dir("grammar-warnings");
  const std::vector<std::string> args = {"import", "--trust-pickle", "--checkpoint", (dir / "nothing-here").string(),
                                         "--data", "d.bin", "--seq-len", "8", "--micro-batch-size", "1",
                                         "--sampler-seed", "1", "--log", "l.jsonl", "--steps", "1:2", "--out",
                                         (dir / "imported").string()};
  const CliResult text = run_cli(args);
  INFO(text.err);
  CHECK(text.status == 2);
  CHECK_FALSE(contains(text.out, "warning"));
  const std::vector<std::string> lines = lines_of(text.err);
  REQUIRE(lines.size() == 2);
  CHECK(lines[0].rfind("nanreplay: warning: --trust-pickle: ", 0) == 0);
  CHECK(lines[1].rfind("nanreplay: error: ", 0) == 0);
  std::vector<std::string> json_args = args;
  json_args.push_back("--json");
  const CliResult json = run_cli(json_args);
  CHECK(json.status == 2);
  CHECK(nlohmann::json::parse(json.out)["error"]["exit_code"] == 2);  // stdout: the object alone
  CHECK(contains(json.err, "nanreplay: warning: --trust-pickle"));
}

TEST_CASE("progress: plain lines in a log, none when asked, the in-place line only where asked",
          "[cli][grammar][progress]") {
  ScratchDir dir("grammar-progress");
  const std::string bundle = (dir / "bundle").string();
  REQUIRE(run_cli({"synth", "clean-fp32", bundle}).status == 0);
  // auto with stderr captured (not a terminal): plain lines, here on every update (interval 0).
  const CliResult logged = run_cli({"run", bundle, "--out", (dir / "a").string(), "--json"},
                                   "env NANREPLAY_PROGRESS_INTERVAL=0");
  INFO(logged.err);
  REQUIRE(logged.status == 0);
  CHECK(nlohmann::json::parse(logged.out)["steps"].size() == 4);  // stdout untouched
  const std::vector<std::string> lines = lines_of(logged.err);
  CHECK(lines.size() >= 8);  // 4 steps, forward and backward
  for (const std::string& line : lines) CHECK(line.rfind("nanreplay: run: replaying step ", 0) == 0);
  CHECK(contains(logged.err, "nanreplay: run: replaying step 103 (4/4), rank 0, micro-batch 0, backward"));
  CHECK_FALSE(contains(logged.err, "\r"));
  CHECK_FALSE(contains(logged.err, "\033"));
  // plain at the default interval: at most one line per 5 seconds of replay.
  const auto started = std::chrono::steady_clock::now();
  const CliResult paced = run_cli({"run", bundle, "--out", (dir / "b").string(), "--progress=plain"});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  CHECK(paced.status == 0);
  CHECK(static_cast<double>(line_count(paced.err)) <= seconds / 5.0 + 1.0);
  // none, and --quiet, print nothing; tty draws in place even into a file.
  const CliResult none = run_cli({"bisect", bundle, "--progress", "none"}, "env NANREPLAY_PROGRESS_INTERVAL=0");
  CHECK(none.status == 0);
  CHECK(none.err.empty());
  const CliResult quiet = run_cli({"run", bundle, "--out", (dir / "c").string(), "--quiet"},
                                  "env NANREPLAY_PROGRESS_INTERVAL=0");
  CHECK(quiet.err.empty());
  const CliResult tty = run_cli({"run", bundle, "--out", (dir / "d").string(), "--progress=tty"});
  CHECK(contains(tty.err, "\r\033[K  replaying step 100 (1/4)"));
  const CliResult scan = run_cli({"scan-data", bundle, "--progress", "plain"}, "env NANREPLAY_PROGRESS_INTERVAL=0");
  CHECK(scan.status == 0);
  // A small bundle may be scanned before the first report: only plain lines of its own, if any.
  for (const std::string& line : lines_of(scan.err)) CHECK(line.rfind("nanreplay: scan-data: scanning ", 0) == 0);
}

namespace {

// Whether `pid` reaches the stopped state (NANREPLAY_TEST_PAUSE_AT_STEP raises SIGSTOP) within a minute.
bool stopped_in_time(pid_t pid) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline) {
    const std::string stat = slurp("/proc/" + std::to_string(pid) + "/stat");
    const size_t state = stat.rfind(')');
    if (state == std::string::npos || stat.size() < state + 3 || stat[state + 2] == 'Z') return false;
    if (stat[state + 2] == 'T') return true;
    usleep(2000);
  }
  return false;
}

}  // namespace

TEST_CASE("json: an interrupted run prints the interrupted object, exit 130", "[cli][grammar][signals]") {
  ScratchDir dir("grammar-interrupted");
  const std::string bundle = (dir / "bundle").string();
  REQUIRE(run_cli({"synth", "clean-fp32", bundle}).status == 0);
  SpawnOptions options;
  options.set_env = {"NANREPLAY_TEST_PAUSE_AT_STEP=101"};
  const Spawned child = spawn_cli(dir, {"run", bundle, "--out", (dir / "out").string(), "--json"}, options);
  REQUIRE(stopped_in_time(child.pid));
  REQUIRE(::kill(child.pid, SIGINT) == 0);
  REQUIRE(::kill(child.pid, SIGCONT) == 0);
  const CliResult done = wait_cli(child).result;
  INFO(done.out << done.err);
  CHECK(done.status == 130);
  CHECK(line_count(done.err) == 1);
  CHECK(done.err.rfind("nanreplay: interrupted", 0) == 0);
  const nlohmann::json error = nlohmann::json::parse(done.out)["error"];
  CHECK(error["exit_code"] == 130);
  CHECK(error["kind"] == "interrupted");
  CHECK_FALSE(std::filesystem::exists(dir / "out"));
}
