// `nanreplay import` around its Python helper (cli/import_command.cpp): the
// refusals it makes itself, a helper's one-line refusal passed on, and
// nothing left beside --out when it fails. The imports themselves, format by
// format, are tests/py/test_import_*.py.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>

#include "tests/cli_harness.h"

namespace fs = std::filesystem;
using nanreplay_test::line_count;
using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;

namespace {

// Nothing but `keep` in `dir`: no staging directory was left behind.
bool only(const fs::path& dir, const std::string& keep) {
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().filename() != keep) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("import: its own refusals are one line, exit 2, and leave nothing", "[cli][import]") {
  ScratchDir dir("import-refusals");
  const auto no_out = run_cli({"import", "--checkpoint", (dir / "ckpt").string()});
  CHECK(no_out.status == 2);
  CHECK(line_count(no_out.err) == 1);
  CHECK(no_out.err.find("--out") != std::string::npos);

  fs::create_directories(dir / "taken");
  std::ofstream(dir / "taken" / "file") << "x";
  const auto taken = run_cli({"import", "--checkpoint", (dir / "ckpt").string(), "--out", (dir / "taken").string()});
  CHECK(taken.status == 2);
  CHECK(line_count(taken.err) == 1);
  CHECK(taken.err.find((dir / "taken").string()) != std::string::npos);
  CHECK(taken.err.find("already exists") != std::string::npos);

  const auto no_python = run_cli({"import", "--checkpoint", "x", "--out", (dir / "b").string()},
                                 "env NANREPLAY_PYTHON=" + (dir / "no-python").string());
  CHECK(no_python.status == 2);
  CHECK(line_count(no_python.err) == 1);
  CHECK(no_python.err.find("NANREPLAY_PYTHON") != std::string::npos);
  CHECK(only(dir.path(), "taken"));
}

TEST_CASE("import: a Python without torch, or a helper's refusal, is one line and leaves nothing", "[cli][import]") {
  ScratchDir dir("import-helper");
  // A `torch` that cannot be imported, first on the helper's path.
  fs::create_directories(dir / "shadow" / "torch");
  std::ofstream(dir / "shadow" / "torch" / "__init__.py") << "raise ImportError('not this one')\n";
  const auto no_torch = run_cli({"import", "--checkpoint", "x", "--out", (dir / "b").string()},
                                "env PYTHONPATH=" + (dir / "shadow").string());
  CHECK(no_torch.status == 2);
  CHECK(line_count(no_torch.err) == 1);
  CHECK(no_torch.err.find("torch") != std::string::npos);

  const auto missing = run_cli({"import", "--checkpoint", (dir / "nothing-here").string(), "--data", "d.bin",
                                "--seq-len", "8", "--micro-batch-size", "1", "--sampler-seed", "1", "--log", "l.jsonl",
                                "--steps", "1:2", "--out", (dir / "b").string()});
  CHECK(missing.status == 2);
  CHECK(line_count(missing.err) == 1);
  CHECK(missing.err.find("nothing-here") != std::string::npos);
  CHECK(only(dir.path(), "shadow"));
}

TEST_CASE("import: what the helper prints reaches the terminal only through the guard", "[cli][import]") {
  ScratchDir dir("import-guard");
  // A stand-in helper quoting a hostile tensor name (an OSC title sequence and a bell) on both streams.
  const fs::path helper = dir / "loud_helper.py";
  std::ofstream(helper) << "import sys\n"
                           "name = 'w\\x1b]0;owned\\x07'\n"
                           "print('note: read', name, flush=True)\n"
                           "print('nanreplay: warning: odd', name, file=sys.stderr, flush=True)\n"
                           "sys.exit(2)\n";
  const auto result = run_cli({"import", "--checkpoint", "x", "--out", (dir / "b").string()},
                              "env NANREPLAY_IMPORT_HELPER=" + helper.string());
  CHECK(result.status == 2);
  CHECK(result.out.find("note: read w") != std::string::npos);
  CHECK(result.err.find("warning: odd w") != std::string::npos);
  for (const std::string* text : {&result.out, &result.err}) {
    CHECK(text->find('\x1b') == std::string::npos);
    CHECK(text->find('\x07') == std::string::npos);
  }
  CHECK(only(dir.path(), "loud_helper.py"));
}
