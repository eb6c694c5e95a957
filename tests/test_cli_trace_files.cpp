// Traces nanreplay must refuse: corrupted copies of a real trace (bit flips
// everywhere, truncations at many lengths, bytes appended), a FIFO (which
// used to hang), a device, a directory, an empty file, an HDF5 file without
// the integrity block. In process, read_trace must throw InputError with a
// one-line message and HDF5 must print nothing; through the CLI, `trace` must
// exit 2 with one line. Resealed corruptions (a valid block over damaged HDF5,
// as a deliberate edit would make) reach HDF5, which parses them in a child
// process, and must still end in contents or an InputError, even where HDF5
// itself reads out of bounds (one copy does, under ASan). Last, on the good copy: --first-nonfinite names the
// origin head's own row and a --step the trace lacks is refused.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <signal.h>
#include <hdf5.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loaders/base/error.h"
#include "reports/outputs/trace/trace_integrity.h"
#include "reports/outputs/trace/trace_parse_isolation.h"
#include "reports/outputs/trace/trace_writer.h"
#include "tests/cli_harness.h"

namespace {

namespace fs = std::filesystem;
using nanreplay::InputError;
using nanreplay_test::check_one_error_line;
using nanreplay_test::CliResult;
using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;
using Bytes = std::vector<uint8_t>;

// A real trace: one step of a planted fp16 overflow, every probe (~70 KB).
const Bytes& real_trace() {
  static ScratchDir dir("trace-files-real");
  static const Bytes bytes = [] {
    REQUIRE(run_cli({"synth", "head-overflow", (dir / "bundle").string()}).status == 0);
    REQUIRE(run_cli({"run", (dir / "bundle").string(), "--out", (dir / "out").string(), "--steps", "103",
                     "--quiet"}).status == 1);
    std::ifstream in(dir / "out" / "trace.h5", std::ios::binary);
    return Bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }();
  return bytes;
}

struct Corrupted {
  std::string what;
  Bytes bytes;
};

// `flips` single-bit flips spread over the whole file (a third of them in
// the integrity block and the HDF5 superblock after it), truncations at
// `cuts` lengths (the block's edges among them), and bytes appended.
std::vector<Corrupted> corrupted_copies(const Bytes& good, size_t flips, size_t cuts, unsigned seed) {
  std::mt19937 random(seed);
  std::vector<Corrupted> copies;
  for (size_t i = 0; i < flips; ++i) {
    const size_t at = i % 3 == 0 ? random() % 1024 : random() % good.size();
    const unsigned bit = random() % 8;
    Bytes bad = good;
    bad[at] ^= static_cast<uint8_t>(1u << bit);
    copies.push_back({"bit " + std::to_string(bit) + " of byte " + std::to_string(at) + " flipped", bad});
  }
  std::vector<size_t> lengths = {0, 1, 8, 100, 511, 512, 513, 520, 1024, good.size() - 1};
  while (lengths.size() < cuts) lengths.push_back(random() % good.size());
  for (const size_t length : lengths) {
    copies.push_back({"truncated to " + std::to_string(length) + " bytes", Bytes(good.begin(), good.begin() + length)});
  }
  Bytes longer = good;
  longer.push_back(0);
  copies.push_back({"one byte appended", longer});
  longer.resize(good.size() + 4096, 0x5a);
  copies.push_back({"4 KiB appended", longer});
  return copies;
}

void write_file(const fs::path& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// What is written to file descriptor 2 while it lives (HDF5 prints there).
class StderrToFile {
 public:
  explicit StderrToFile(fs::path path) : path_(std::move(path)) {
    std::fflush(stderr);
    saved_ = ::dup(2);
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 2);
    ::close(fd);
  }
  ~StderrToFile() { restore(); }
  StderrToFile(const StderrToFile&) = delete;
  StderrToFile& operator=(const StderrToFile&) = delete;
  std::string finish() {
    restore();
    return nanreplay_test::slurp(path_);
  }

 private:
  void restore() {
    if (saved_ < 0) return;
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    saved_ = -1;
  }
  fs::path path_;
  int saved_ = -1;
};

// An HDF5 file as another tool (or an older nanreplay) writes it: no integrity block.
void write_plain_hdf5(const fs::path& path) {
  const hid_t file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  REQUIRE(file >= 0);
  const hid_t group = H5Gcreate2(file, "probes", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  H5Gclose(group);
  H5Fclose(file);
}

}  // namespace

TEST_CASE("read_trace refuses corrupted copies of a real trace with one line, and HDF5 prints nothing",
          "[trace][corrupt]") {
  const Bytes& good = real_trace();
  REQUIRE(nanreplay::read_trace_image(good.data(), good.size(), "trace.h5").probes.size() > 100);
  const std::vector<Corrupted> copies = corrupted_copies(good, 400, 200, 16);
  ScratchDir scratch("trace-files-corrupt");
  StderrToFile stderr_file(scratch / "stderr.txt");
  size_t refused = 0;
  for (const Corrupted& copy : copies) {
    try {
      nanreplay::read_trace_image(copy.bytes.data(), copy.bytes.size(), "triage/trace.h5");
      FAIL_CHECK("accepted a copy with " << copy.what);
    } catch (const InputError& error) {
      const std::string message = error.what();
      INFO(copy.what << ": " << message);
      CHECK(message.rfind("triage/trace.h5: ", 0) == 0);
      CHECK(message.find('\n') == std::string::npos);
      ++refused;
    }
  }
  CHECK(stderr_file.finish().empty());
  CHECK(refused == copies.size());
  WARN(refused << " corrupted copies refused");
}

TEST_CASE("resealed corruptions reach HDF5 and still end in contents or an InputError", "[trace][corrupt]") {
  const std::vector<Corrupted> copies = corrupted_copies(real_trace(), 300, 100, 61);
  size_t read = 0;
  size_t refused = 0;
  for (Corrupted copy : copies) {
    if (copy.bytes.size() < nanreplay::kTraceIntegrityBlockBytes) continue;
    nanreplay::seal_trace_image(copy.bytes);
    try {
      nanreplay::read_trace_image(copy.bytes.data(), copy.bytes.size(), "trace.h5");
      ++read;  // a flipped bit in a statistic is still a well-formed trace
    } catch (const InputError& error) {
      CHECK(std::string(error.what()).find('\n') == std::string::npos);
      ++refused;
    }
  }
  CHECK(refused > 0);
  WARN(read << " resealed copies read, " << refused << " refused");
}

TEST_CASE("the child that parses a trace: its rows, its InputError and its crash reach the caller",
          "[trace][corrupt]") {
  const Bytes& good = real_trace();
  const nanreplay::TraceContents direct = nanreplay::read_trace_image(good.data(), good.size(), "trace.h5");
  // The rows cross the pipe bit for bit: probe statistics are sent as stored sums.
  const nanreplay::TraceContents again =
      nanreplay::parse_trace_in_child("trace.h5", [&] { return direct; });
  REQUIRE(again.probes.size() == direct.probes.size());
  REQUIRE(again.steps.size() == direct.steps.size());
  CHECK(again.header.bundle == direct.header.bundle);
  CHECK(again.header.extra == direct.header.extra);
  for (size_t i = 0; i < direct.probes.size(); ++i) {
    const nanreplay::ProbeRecord& a = direct.probes[i];
    const nanreplay::ProbeRecord& b = again.probes[i];
    INFO("probe " << i);
    CHECK(nanreplay::probe_name(a) == nanreplay::probe_name(b));
    CHECK(std::memcmp(&a.stats.sum, &b.stats.sum, sizeof(double)) == 0);
    CHECK(std::memcmp(&a.stats.sum_sq, &b.stats.sum_sq, sizeof(double)) == 0);
    CHECK(a.shape == b.shape);
    CHECK(a.stats.finite_count == b.stats.finite_count);
    CHECK(a.headroom_bits == b.headroom_bits);
  }
  try {
    nanreplay::parse_trace_in_child("t.h5", []() -> nanreplay::TraceContents {
      throw InputError("t.h5", "/probes/site", "row 3: invalid value 'x\x01'");
    });
    FAIL("no error");
  } catch (const InputError& error) {
    CHECK(error.file() == "t.h5");
    CHECK(error.key() == "/probes/site");
    CHECK(std::string(error.what()) == InputError("t.h5", "/probes/site", "row 3: invalid value 'x\x01'").what());
  }
  try {
    nanreplay::parse_trace_in_child("crafted.h5", []() -> nanreplay::TraceContents { ::_exit(0); });
    FAIL("no error");
  } catch (const InputError& error) {
    CHECK(std::string(error.what()).rfind("crafted.h5: HDF5's parser exited", 0) == 0);
  }
  try {
    nanreplay::parse_trace_in_child("crafted.h5", []() -> nanreplay::TraceContents { ::raise(SIGKILL); ::_exit(0); });
    FAIL("no error");
  } catch (const InputError& error) {
    CHECK(std::string(error.what()).find("crafted.h5: HDF5's parser stopped with signal 9 ") == 0);
  }
}

TEST_CASE("trace refuses damaged files and files that are not regular, with exit 2 and one line",
          "[cli][trace][corrupt]") {
  ScratchDir scratch("trace-files-cli");
  // A sample of the copies above through the real CLI (each costs a start of
  // the binary, about 2 s under the sanitizers): the block's edges and eight flips.
  std::vector<Corrupted> copies = corrupted_copies(real_trace(), 8, 10, 7);
  size_t index = 0;
  for (const Corrupted& copy : copies) {
    const fs::path path = scratch / ("copy-" + std::to_string(index++) + ".h5");
    write_file(path, copy.bytes);
    INFO(copy.what);
    check_one_error_line(run_cli({"trace", path.string(), "--first-nonfinite"}), {path.string()});
  }

  const fs::path fifo = scratch / "fifo.h5";
  REQUIRE(::mkfifo(fifo.c_str(), 0644) == 0);
  check_one_error_line(run_cli({"trace", fifo.string()}), {fifo.string(), "not a regular file"});
  check_one_error_line(run_cli({"trace", "/dev/null"}), {"/dev/null", "not a regular file"});
  check_one_error_line(run_cli({"trace", scratch.path().string()}), {"is a directory"});
  write_file(scratch / "empty.h5", {});
  check_one_error_line(run_cli({"trace", (scratch / "empty.h5").string()}), {"empty.h5"});
  write_plain_hdf5(scratch / "plain.h5");
  check_one_error_line(run_cli({"trace", (scratch / "plain.h5").string()}),
                       {"plain.h5", "without nanreplay's integrity block", "regenerate it"});
  WARN(copies.size() << " corrupted copies and 5 special files refused through the CLI");
}

namespace {

int64_t nonfinite_values(const nlohmann::json& row) {
  return row["nan_count"].get<int64_t>() + row["inf_count"].get<int64_t>();
}

}  // namespace

TEST_CASE("trace --first-nonfinite names the origin's own head row, and a step it lacks is refused",
          "[cli][trace]") {
  ScratchDir scratch("trace-origin");
  const std::string path = (scratch / "trace.h5").string();
  write_file(path, real_trace());

  // The planted overflow is one element of one head: the whole-tensor row
  // comes first in execution order, but the origin is that head's row.
  const CliResult first = run_cli({"trace", path, "--first-nonfinite", "--json"});
  REQUIRE(first.status == 0);
  const nlohmann::json rows = nlohmann::json::parse(first.out)["rows"];
  REQUIRE(rows.size() == 1);
  const CliResult whole = run_cli({"trace", path, "--first-nonfinite", "--head", "-1", "--json"});
  REQUIRE(whole.status == 0);
  const nlohmann::json whole_row = nlohmann::json::parse(whole.out)["rows"].at(0);
  CHECK(whole_row["head"] == -1);
  CHECK(rows[0]["head"].get<int>() >= 0);
  CHECK(rows[0]["site"] == whole_row["site"]);
  CHECK(rows[0]["sample"] == whole_row["sample"]);
  CHECK(rows[0]["position"] == whole_row["position"]);
  CHECK(rows[0]["sample"].get<int64_t>() >= 0);
  CHECK(nonfinite_values(rows[0]) > 0);
  CHECK(nonfinite_values(rows[0]) <= nonfinite_values(whole_row));

  // The table counts the non-finite values of the rows it shows.
  const CliResult table = run_cli({"trace", path, "--first-nonfinite", "--limit", "3"});
  REQUIRE(table.status == 0);
  const nlohmann::json three = nlohmann::json::parse(
      run_cli({"trace", path, "--first-nonfinite", "--limit", "3", "--json"}).out)["rows"];
  int64_t nan = 0, inf = 0;
  for (const auto& row : three) nan += row["nan_count"].get<int64_t>(), inf += row["inf_count"].get<int64_t>();
  CHECK(table.out.find("the rows shown hold " + std::to_string(nan) + " nan and " + std::to_string(inf) +
                       " inf values") != std::string::npos);
  CHECK(table.out.find(" sample ") != std::string::npos);

  // A step the trace does not hold is a usage mistake that lists the steps it does hold.
  check_one_error_line(run_cli({"trace", path, "--step", "99"}), {path, "no step 99", "holds steps 10"});
  const CliResult none = run_cli({"trace", path, "--site", "no.such.site"});
  CHECK(none.status == 0);
  CHECK(none.out.find("no row matches; the trace holds steps 10") != std::string::npos);
  const CliResult help = run_cli({"trace", "--help"});
  CHECK(help.out.find("headroom is log2") != std::string::npos);
}
