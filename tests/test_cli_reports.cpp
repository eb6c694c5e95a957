// The outputs for people, through the CLI: report.md and report.html beside
// report.json, `nanreplay inspect` on good and bad bundles, `nanreplay trace`
// filters on a real trace, and an example in every command's --help.
#include <catch2/catch.hpp>

#include <regex>

#include "cli/terminal_guard.h"
#include "tests/cli_harness.h"

using nanreplay_test::contains;
using nanreplay_test::lines_of;
using nanreplay_test::read_json;
using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;
using nanreplay_test::slurp;

namespace {

// A head-overflow bundle (layer 1, head 2 overflows in fp16) replayed into dir/out.
nlohmann::json replay_head_overflow(const ScratchDir& dir) {
  const auto synth = run_cli({"synth", "head-overflow", (dir / "bundle").string()});
  INFO(synth.err);
  REQUIRE(synth.status == 0);
  const auto run = run_cli({"run", (dir / "bundle").string(), "--out", (dir / "out").string(), "--quiet"});
  INFO(run.err);
  REQUIRE(run.status == 1);
  return read_json(dir / "out" / "report.json");
}

}  // namespace

TEST_CASE("run writes report.md and a self-contained report.html beside report.json", "[cli][reports]") {
  ScratchDir dir("reports");
  const nlohmann::json report = replay_head_overflow(dir);
  const std::string site = report["first_nonfinite"]["site"];
  CHECK(site == "layers.1.attn.scores");

  const std::string md = slurp(dir / "out" / "report.md");
  CHECK(md.rfind("# nanreplay: REPRODUCED at step ", 0) == 0);  // verdict first
  CHECK(contains(md, "`" + site + "`"));
  CHECK(contains(md, "head 2"));
  CHECK(contains(md, "**Root cause**"));
  CHECK(contains(md, "| step | replayed loss | logged loss | grad norm | finite |"));
  CHECK(contains(md, "### data"));
  CHECK(contains(md, "### numeric"));
  CHECK(contains(md, "### system"));
  CHECK(contains(md, "`NUMERIC_OVERFLOW`"));
  CHECK(contains(md, "## Propagation"));
  CHECK(contains(md, "replayed twice"));
  CHECK(contains(md, "[report.json](report.json)"));
  CHECK(contains(md, "[report.html](report.html)"));
  CHECK(contains(md, "[trace.h5](trace.h5)"));

  const std::string html = slurp(dir / "out" / "report.html");
  CHECK(html.rfind("<!DOCTYPE html>", 0) == 0);
  CHECK_FALSE(contains(html, "http://"));
  CHECK_FALSE(contains(html, "https://"));
  CHECK_FALSE(contains(html, "<script src"));
  CHECK_FALSE(contains(html, "<link"));
  CHECK(contains(html, "<style>"));
  CHECK(contains(html, site));
  CHECK(html.find("id=\"verdict\"") < html.find("Triage"));  // verdict first
  CHECK(contains(html, "class=\"nonfinite origin\""));          // the first non-finite cell is marked
  CHECK(contains(html, "Propagation path"));
  CHECK(contains(html, "<svg"));
  CHECK(contains(html, "class=\"tok bad\""));  // the offending token window
  CHECK(contains(html, "document.title = \"nanreplay report ok\""));
}

TEST_CASE("inspect summarizes a good bundle and exits 0", "[cli][inspect]") {
  ScratchDir dir("inspect");
  REQUIRE(run_cli({"synth", "head-overflow", (dir / "bundle").string()}).status == 0);
  const auto text = run_cli({"inspect", (dir / "bundle").string()});
  INFO(text.err);
  CHECK(text.status == 0);
  CHECK(contains(text.out, "(valid)"));
  CHECK(contains(text.out, "precision  fp16"));
  CHECK(contains(text.out, "sha256 ok"));

  const auto json = run_cli({"inspect", (dir / "bundle").string(), "--json"});
  REQUIRE(json.status == 0);
  const auto summary = nlohmann::json::parse(json.out);
  CHECK(summary["valid"] == true);
  CHECK(summary["model"]["arch"] == "llama");
  CHECK(summary["model"]["parameters"].get<int64_t>() > 0);
  CHECK(summary["precision"] == "fp16");
  REQUIRE(!summary["steps"].empty());
  CHECK(summary["steps"][0].contains("optimizer_state"));
  CHECK(summary["steps"][0].contains("logged_loss"));
  REQUIRE(!summary["data"]["shards"].empty());
  CHECK(summary["data"]["shards"][0]["checksum"] == "ok");
  CHECK(summary["sampler"]["kind"].is_string());
}

TEST_CASE("inspect exits 2 on a checksum mismatch and on a broken bundle", "[cli][inspect]") {
  ScratchDir dir("inspect-bad");
  REQUIRE(run_cli({"synth", "checksum-mismatch", (dir / "bundle").string()}).status == 0);
  const auto mismatch = run_cli({"inspect", (dir / "bundle").string(), "--json"});
  CHECK(mismatch.status == 2);
  const auto summary = nlohmann::json::parse(mismatch.out);
  CHECK(summary["valid"] == false);
  bool any_mismatch = false;
  for (const auto& shard : summary["data"]["shards"]) any_mismatch |= shard["checksum"] == "mismatch";
  CHECK(any_mismatch);

  std::ofstream(dir / "bundle" / "manifest.json") << "{ not json";
  const auto broken = run_cli({"inspect", (dir / "bundle").string()});
  CHECK(broken.status == 2);
  CHECK(lines_of(broken.err).size() == 1);
  CHECK(contains(broken.err, "manifest.json"));
  CHECK(run_cli({"inspect", (dir / "missing").string()}).status == 2);
}

TEST_CASE("trace filters, sorts and finds the first non-finite rows of a real trace", "[cli][trace]") {
  ScratchDir dir("trace");
  const nlohmann::json report = replay_head_overflow(dir);
  const std::string trace = (dir / "out" / "trace.h5").string();
  const int64_t bad_step = report["first_nonfinite"]["step"];
  const std::string site = report["first_nonfinite"]["site"];

  const auto first = run_cli({"trace", trace, "--first-nonfinite", "--json", "--limit", "5"});
  INFO(first.err);
  REQUIRE(first.status == 0);
  const auto rows = nlohmann::json::parse(first.out)["rows"];
  REQUIRE(rows.size() == 5);
  CHECK(rows[0]["step"] == bad_step);
  CHECK(rows[0]["site"] == site);
  CHECK(rows[0]["phase"] == "forward");
  for (const auto& row : rows) CHECK(row["nan_count"].get<int64_t>() + row["inf_count"].get<int64_t>() > 0);

  const auto filtered = run_cli({"trace", trace, "--step", std::to_string(bad_step), "--phase", "forward",
                                 "--site", "layers.*.attn.scores", "--head", "2", "--json", "--limit", "1000"});
  REQUIRE(filtered.status == 0);
  const auto filtered_rows = nlohmann::json::parse(filtered.out)["rows"];
  REQUIRE(!filtered_rows.empty());
  for (const auto& row : filtered_rows) {
    CHECK(row["step"] == bad_step);
    CHECK(row["phase"] == "forward");
    CHECK(row["head"] == 2);
    CHECK(std::regex_match(row["site"].get<std::string>(), std::regex(R"(layers\.\d+\.attn\.scores)")));
  }

  const auto sorted = run_cli({"trace", trace, "--phase", "backward", "--sort", "max_abs", "--json"});
  REQUIRE(sorted.status == 0);
  const auto sorted_rows = nlohmann::json::parse(sorted.out)["rows"];
  REQUIRE(sorted_rows.size() == 50);  // the default limit
  for (size_t i = 1; i < sorted_rows.size(); ++i) {
    if (sorted_rows[i - 1]["max_abs"].is_number() && sorted_rows[i]["max_abs"].is_number()) {
      CHECK(sorted_rows[i - 1]["max_abs"].get<double>() >= sorted_rows[i]["max_abs"].get<double>());
    }
  }

  const auto table = run_cli({"trace", trace, "--first-nonfinite", "--limit", "3"});
  REQUIRE(table.status == 0);
  CHECK(contains(table.out, "headroom"));
  CHECK(contains(table.out, site));
  CHECK(lines_of(table.out).size() == 5);  // header, 3 rows, count line

  std::ofstream(dir / "not-a-trace.h5") << "garbage";
  const auto bad = run_cli({"trace", (dir / "not-a-trace.h5").string()});
  CHECK(bad.status == 2);
  CHECK(lines_of(bad.err).size() == 1);
  CHECK(run_cli({"trace", trace, "--phase", "sideways"}).status == 2);
}

TEST_CASE("every command's --help shows an example", "[cli][help]") {
  const auto usage = run_cli({"--help"});
  REQUIRE(usage.status == 0);
  std::vector<std::string> commands;
  bool in_list = false;
  for (const std::string& line : lines_of(usage.out)) {
    if (line == "commands:") {
      in_list = true;
    } else if (in_list && line.rfind("  ", 0) == 0) {
      commands.push_back(line.substr(2, line.find(' ', 2) - 2));
    } else if (in_list) {
      break;
    }
  }
  REQUIRE(commands.size() >= 7);
  for (const std::string& command : commands) {
    INFO(command);
    const auto help = run_cli({command, "--help"});
    CHECK(help.status == 0);
    CHECK(contains(help.out, "Example"));
  }
}

TEST_CASE("run --timings: where the time went, on stderr and in report.json", "[cli][reports]") {
  ScratchDir dir("timings");
  REQUIRE(run_cli({"synth", "clean-fp32", (dir / "bundle").string()}).status == 0);
  const auto run = run_cli({"run", (dir / "bundle").string(), "--out", (dir / "out").string(), "--timings", "--quiet"});
  INFO(run.err);
  REQUIRE(run.status == 0);
  for (const char* phase : {"load", "data_checks", "replay", "update_checks", "determinism", "trace.h5",
                            "report.md", "report.html", "report.json", "total"}) {
    CHECK(run.err.find(std::string("  ") + phase + " ") != std::string::npos);
  }
  const nlohmann::json t = read_json(dir / "out" / "report.json")["timings"];
  double sum = 0;
  for (const auto& [phase, seconds] : t["seconds"].items()) {
    CHECK(seconds.get<double>() >= 0);
    sum += seconds.get<double>();
  }
  CHECK(t["seconds"]["replay"].get<double>() > 0);
  CHECK(t["seconds"].count("report.json") == 0);
  REQUIRE(t["steps"].size() == 4);
  double steps = 0;
  for (const auto& s : t["steps"]) steps += s["seconds"].get<double>();
  CHECK(steps == Approx(t["seconds"]["replay"].get<double>()).epsilon(1e-9));
  CHECK(sum <= t["total_seconds"].get<double>() * (1 + 1e-9));
}

namespace {

// Bytes a terminal acts on: every control character but '\n' and '\t', DEL, and the C1 controls.
std::string terminal_controls_in(const std::string& text) {
  std::string found;
  for (size_t i = 0; i < text.size(); ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    const auto next = i + 1 < text.size() ? static_cast<unsigned char>(text[i + 1]) : 0;
    const bool c1 = byte == 0xC2 && next >= 0x80 && next <= 0x9F;
    if ((byte < 0x20 && byte != '\n' && byte != '\t') || byte == 0x7F || c1) found += std::to_string(byte) + " ";
  }
  return found;
}

// No '/': it names one directory.
const std::string kHostileText = "evil<script>alert(1)\x1b]0;pwned\x07\x1b[32m\xc2\x9b" "2J";

}  // namespace

TEST_CASE("bundle text reaches no terminal and no Markdown raw: run inspect bisect and error lines",
          "[cli][reports][escaping]") {
  ScratchDir dir("hostile-text");
  const std::filesystem::path bundle = dir / kHostileText;
  REQUIRE(run_cli({"synth", "head-overflow", bundle.string()}).status == 0);
  {  // a symptom from the bundle, quoted by report.md
    nlohmann::json manifest = read_json(bundle / "manifest.json");
    manifest["incident"]["symptom"] = kHostileText;
    std::ofstream(bundle / "manifest.json") << manifest.dump(2);
  }
  const auto run = run_cli({"run", bundle.string(), "--out", (dir / "out").string()});
  INFO(run.err);
  REQUIRE(run.status == 1);
  CHECK(contains(run.out, "evil<script>alert(1)\\x1b]0;pwned\\x07\\x1b[32m\\u009b2J"));
  CHECK(terminal_controls_in(run.out + run.err).empty());

  const std::string md = slurp(dir / "out" / "report.md");
  CHECK(terminal_controls_in(md).empty());
  CHECK_FALSE(contains(md, "<script>"));
  CHECK(contains(md, "evil\\<script\\>alert(1)"));  // shown, behind backslashes
  CHECK_FALSE(contains(slurp(dir / "out" / "report.html"), "<script>alert"));

  const auto inspect = run_cli({"inspect", bundle.string()});
  CHECK(inspect.status == 0);
  CHECK(terminal_controls_in(inspect.out + inspect.err).empty());
  const auto bisect = run_cli({"bisect", bundle.string(), "--no-samples"});
  CHECK(bisect.status == 1);
  CHECK(terminal_controls_in(bisect.out + bisect.err).empty());
  // Error lines: a missing bundle and a broken manifest, both named by a hostile path.
  const auto missing = run_cli({"inspect", (dir / (kHostileText + "-missing")).string()});
  CHECK(missing.status == 2);
  CHECK(lines_of(missing.err).size() == 1);
  CHECK(terminal_controls_in(missing.err).empty());
  std::ofstream(bundle / "manifest.json") << "{ \"x\": \"" << kHostileText << "\" ";
  const auto broken = run_cli({"run", bundle.string(), "--out", (dir / "out2").string()});
  CHECK(broken.status == 2);
  CHECK(lines_of(broken.err).size() == 1);
  CHECK(terminal_controls_in(broken.err).empty());
}

TEST_CASE("the terminal guard passes the tool's own colour and progress codes and escapes the rest",
          "[reports][escaping]") {
  std::ostringstream colour;
  {
    nanreplay::TerminalSafeStream out(colour, true);
    out << "\r\x1b[K" << "\x1b[1;31mNO\x1b[0m" << kHostileText << "\tend\n\x1b[1";
  }
  CHECK(colour.str() == "\r\x1b[K\x1b[1;31mNO\x1b[0mevil<script>alert(1)\\u001b]0;pwned\\u0007\x1b[32m\\u009b2J"
                        "\tend\n\\u001b[1");
  std::ostringstream plain;
  {
    nanreplay::TerminalSafeStream out(plain, false);
    out << "\r\x1b[K" << kHostileText.substr(0, 30) << "\xc3\xa9";  // é passes
    out.flush();
    out << "\x7f";
  }
  CHECK(plain.str() == "\\u000d\\u001b[Kevil<script>alert(1)\\u001b]0;pwned\\u0007\xc3\xa9\\u007f");
  CHECK(nanreplay::terminal_safe("a\x1b[31mb\x1b") == "a\\u001b[31mb\\u001b");
  // In --json output an escaped byte is a JSON escape of the same character.
  std::ostringstream json_text;
  {
    nanreplay::TerminalSafeStream out(json_text, false);
    out << nlohmann::json{{"path", "a\x7f\xc2\x9b" "b"}}.dump();
  }
  CHECK(nlohmann::json::parse(json_text.str())["path"] == "a\x7f\xc2\x9b" "b");
}
