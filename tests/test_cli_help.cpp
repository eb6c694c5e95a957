// Help as a newcomer reaches it: `nanreplay help CMD`, shell completion
// generated from the command table, the man page that lists every command,
// and `cmake --install` putting a working nanreplay on PATH.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <fstream>

#include "cli/command_table.h"
#include "tests/cli_harness.h"

using namespace nanreplay_test;

TEST_CASE("help CMD prints that command's help, and names the nearest command when mistyped", "[cli][help]") {
  const CliResult help = run_cli({"help", "run"});
  CHECK(help.status == 0);
  CHECK(help.out == run_cli({"run", "--help"}).out);
  const CliResult wrong = run_cli({"help", "bisekt"});
  CHECK(wrong.status == 2);
  CHECK(contains(wrong.err, "did you mean 'bisect'"));
  CHECK(run_cli({"help"}).status == 0);
}

TEST_CASE("completion scripts name every command and parse in their shell", "[cli][help]") {
  ScratchDir dir("completion");
  const CliResult bash = run_cli({"completion", "bash"});
  REQUIRE(bash.status == 0);
  const size_t list = bash.out.find("compgen -W \"");
  REQUIRE(list != std::string::npos);
  const size_t begin = list + 12;
  const std::string words = " " + bash.out.substr(begin, bash.out.find('"', begin) - begin) + " ";
  for (const nanreplay::Command& c : nanreplay::command_table()) {
    INFO(c.name);
    CHECK(contains(words, std::string(" ") + c.name + " "));
    CHECK(contains(run_cli({"completion", "fish"}).out, std::string("-a ") + c.name + " "));
  }
  std::ofstream(dir / "completion.bash") << bash.out;
  // bash -n parses without running; the script then defines the function and registers it.
  CHECK(std::system(("bash -n " + shell_quote((dir / "completion.bash").string())).c_str()) == 0);
  const std::string registered = "bash -c " + shell_quote("source " + (dir / "completion.bash").string() +
                                                          " && complete -p nanreplay | grep -q _nanreplay");
  CHECK(std::system(registered.c_str()) == 0);
  CHECK(contains(run_cli({"completion", "zsh"}).out, "#compdef nanreplay"));
  const CliResult none = run_cli({"completion", "tcsh"});
  CHECK(none.status == 2);
  CHECK(line_count(none.err) == 1);
}

TEST_CASE("the man page lists every command of the table", "[cli][help]") {
  const std::string page = slurp(std::filesystem::path(NANREPLAY_SOURCE_DIR) / "docs" / "nanreplay.1");
  REQUIRE_FALSE(page.empty());
  for (const nanreplay::Command& c : nanreplay::command_table()) {
    const std::string name = c.name;
    INFO(name);
    std::string escaped;  // roff writes a hyphen as \-
    for (char ch : name) escaped += ch == '-' ? std::string("\\-") : std::string(1, ch);
    CHECK(contains(page, ".B " + escaped));
  }
}

TEST_CASE("cmake --install puts a nanreplay that runs, its helpers and its man page under the prefix",
          "[cli][help]") {
  ScratchDir dir("install");
  const std::filesystem::path build = std::filesystem::path(NANREPLAY_CLI_PATH).parent_path();
  const std::string install = "cmake --install " + shell_quote(build.string()) + " --prefix " +
                              shell_quote(dir.path().string()) + " >/dev/null";
  REQUIRE(std::system(install.c_str()) == 0);
  const std::filesystem::path cli = dir / "bin" / "nanreplay";
  CHECK(std::filesystem::exists(dir / "share" / "man" / "man1" / "nanreplay.1"));
  CHECK(std::filesystem::exists(dir / "share" / "nanreplay" / "capture" / "nanreplay_capture.py"));
  const std::filesystem::path helper = dir / "share" / "nanreplay" / "capture" / "nanreplay_import.py";
  REQUIRE(std::filesystem::exists(helper));
  CHECK(std::system((shell_quote(cli.string()) + " version >/dev/null").c_str()) == 0);
  // `import` runs the installed helper, not the source tree's: a stand-in that says so.
  std::ofstream(helper, std::ios::trunc) << "import sys\nprint('the installed helper ran', file=sys.stderr)\nsys.exit(2)\n";
  const std::string out = (dir / "import.err").string();
  const std::string imported = "env -u NANREPLAY_IMPORT_HELPER " + shell_quote(cli.string()) + " import --out " +
                               shell_quote((dir / "bundle").string()) + " 2>" + shell_quote(out);
  std::system(imported.c_str());
  CHECK(contains(slurp(out), "the installed helper ran"));
}

TEST_CASE("one step-range grammar: A-B and A:B for run and import alike", "[cli][help]") {
  ScratchDir dir("ranges");
  REQUIRE(run_cli({"synth", "clean-fp32", (dir / "bundle").string()}).status == 0);
  std::vector<nlohmann::json> steps;
  for (const std::string range : {"101-102", "101:102"}) {
    const CliResult run = run_cli({"run", (dir / "bundle").string(), "--steps", range, "--no-probes", "--json",
                                   "--out", (dir / ("out" + std::to_string(steps.size()))).string()});
    INFO(range << ": " << run.err);
    REQUIRE(run.status == 0);
    steps.push_back(nlohmann::json::parse(run.out)["steps"]);
  }
  REQUIRE(steps[0].size() == 2);
  CHECK(steps[0][0]["step"] == 101);
  CHECK(steps[0].dump() == steps[1].dump());
  // import reads either form too: a well-formed range gets past --steps to the missing checkpoint.
  const std::vector<std::string> import = {"import", "--checkpoint", (dir / "none.pt").string(), "--data",
                                           (dir / "bundle" / "data").string(), "--seq-len", "8",
                                           "--micro-batch-size", "1", "--sampler-seed", "1", "--log",
                                           (dir / "log.jsonl").string(), "--out", (dir / "imported").string()};
  for (const std::string range : {"5-9", "5:9"}) {
    std::vector<std::string> args = import;
    args.insert(args.end(), {"--steps", range});
    const CliResult imported = run_cli(args);
    INFO(range << ": " << imported.err);
    CHECK(imported.status == 2);
    CHECK_FALSE(contains(imported.err, "--steps"));
  }
}

TEST_CASE("help lists only what a command accepts: minimize takes no --what-if", "[cli][help]") {
  const CliResult help = run_cli({"minimize", "--help"});
  REQUIRE(help.status == 0);
  CHECK_FALSE(contains(help.out, "--what-if"));
  CHECK(contains(run_cli({"bisect", "--help"}).out, "--what-if"));
}

TEST_CASE("a mistyped flag gets the nearest one, in the CLI and in import's helper", "[cli][help]") {
  const CliResult run = run_cli({"run", "bundle/", "--outt", "triage/"});
  CHECK(run.status == 2);
  CHECK(line_count(run.err) == 1);
  CHECK(contains(run.err, "unknown option '--outt'; did you mean '--out'?"));
  CHECK(contains(run_cli({"bisect", "bundle/", "--what-iff", "x"}).err, "did you mean '--what-if'?"));
  const CliResult import = run_cli({"import", "--outt", "x"});
  CHECK(import.status == 2);
  CHECK(contains(import.err, "did you mean '--out'?"));
  ScratchDir dir("typo");
  const CliResult helper = run_cli({"import", "--out", (dir / "b").string(), "--seq-lenn", "8"});
  INFO(helper.err);
  CHECK(helper.status == 2);
  CHECK(contains(helper.err, "did you mean '--seq-len'?"));
  CHECK_FALSE(std::filesystem::exists(dir / "b"));
}
