// Tests reports/outputs/trace/trace_writer.cpp: write_trace/read_trace round-trip every field
// (-1 fields, NaN/inf statistics, long site names, zero records), the file opens
// with stock h5dump and with the h5py example of docs/trace-format.md, failures
// leave no temporary file and HDF5 prints nothing. No LibTorch here.
#include <hdf5.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "loaders/base/error.h"
#include "reports/outputs/trace/trace_integrity.h"
#include "reports/outputs/trace/trace_writer.h"

#ifndef NANREPLAY_PYTHON
#define NANREPLAY_PYTHON "/usr/bin/python3"
#endif

namespace nanreplay {
namespace {

namespace fs = std::filesystem;

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
constexpr double kStatInf = std::numeric_limits<double>::infinity();

// A fresh directory per test, removed afterwards.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& name)
      : path_(fs::temp_directory_path() /
              ("nanreplay_" + name + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  std::string file(const std::string& name) const { return (path_ / name).string(); }
  bool holds_temporary_file() const {
    for (const auto& entry : fs::directory_iterator(path_)) {
      if (entry.path().filename().string().find(".tmp") != std::string::npos) return true;
    }
    return false;
  }

 private:
  fs::path path_;
};

// Runs a shell command; returns its stdout and sets its exit status.
std::string run_command(const std::string& command, int& exit_status) {
  std::string output;
  FILE* pipe = ::popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  char buffer[4096];
  size_t got;
  while ((got = std::fread(buffer, 1, sizeof buffer, pipe)) > 0) output.append(buffer, got);
  const int status = ::pclose(pipe);
  exit_status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return output;
}

// Collects what is written to file descriptor 2 while it lives.
class StderrCapture {
 public:
  explicit StderrCapture(std::string path) : path_(std::move(path)) {
    std::fflush(stderr);
    saved_ = ::dup(2);
    FILE* sink = std::fopen(path_.c_str(), "w");
    ::dup2(::fileno(sink), 2);
    std::fclose(sink);
  }
  ~StderrCapture() { restore(); }
  StderrCapture(const StderrCapture&) = delete;
  StderrCapture& operator=(const StderrCapture&) = delete;

  std::string finish() {
    restore();
    std::ifstream in(path_);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

 private:
  void restore() {
    if (saved_ < 0) return;
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    saved_ = -1;
  }
  std::string path_;
  int saved_ = -1;
};

TensorStats finite_stats(int64_t count, double max_abs, double min_nonzero, double sum,
                         double sum_sq) {
  TensorStats stats;
  stats.count = stats.finite_count = count;
  stats.max_abs = max_abs;
  stats.min_nonzero_abs = min_nonzero;
  stats.sum = sum;
  stats.sum_sq = sum_sq;
  return stats;
}

ProbeRecord forward_probe(int64_t step, int micro_batch, int order, const std::string& site) {
  ProbeRecord probe;
  probe.step = step;
  probe.micro_batch = micro_batch;
  probe.rank = 0;
  probe.phase = Phase::kForward;
  probe.order = order;
  probe.site = parse_site_name(site).value();
  probe.shape = {2, 64, 128};
  probe.stats = finite_stats(2 * 64 * 128, 3.5, 1e-6, 12.5, 900.0);
  return probe;
}

// Marks a probe as holding `nonfinite` bad elements, the first at `index`.
void make_nonfinite(ProbeRecord& probe, NonfiniteKind kind, int64_t flat_index,
                    std::vector<int64_t> index, int64_t nonfinite) {
  probe.stats.finite_count = probe.stats.count - nonfinite;
  (kind == NonfiniteKind::kNan ? probe.stats.nan_count : probe.stats.inf_count) = nonfinite;
  probe.stats.first_nonfinite = flat_index;
  probe.stats.first_kind = kind;
  probe.first_index = std::move(index);
}

// A small trace covering every kind of field. The first non-finite forward
// probe in execution order is the one at step 100, micro-batch 0, order 3.
std::vector<ProbeRecord> sample_probes() {
  std::vector<ProbeRecord> probes;
  probes.push_back(forward_probe(100, 0, 0, "embed"));

  ProbeRecord scores = forward_probe(100, 0, 5, "layers.2.attn.scores");
  scores.layer = 2;
  scores.head = 3;
  scores.shape = {2, 12, 64, 64};
  scores.stats.count = 2 * 64 * 65 / 2;  // causal positions only
  make_nonfinite(scores, NonfiniteKind::kPosInf, 3 * 4096 + 64 + 57, {0, 3, 1, 57}, 4);
  scores.sample = 4182;
  scores.position = 1;
  scores.first_head = 3;
  probes.push_back(scores);

  ProbeRecord probs = forward_probe(100, 0, 3, "layers.1.attn.probs");
  probs.layer = 1;
  probs.head = 0;
  probs.shape = {2, 12, 64, 64};
  make_nonfinite(probs, NonfiniteKind::kNan, 5 * 64 + 2, {0, 0, 5, 2}, 100);
  probs.sample = 4182;
  probs.position = 5;
  probs.first_head = 0;
  probes.push_back(probs);

  // Later micro-batch with an earlier site: not first in execution order.
  ProbeRecord later = forward_probe(100, 1, 1, "layers.0.attn_norm");
  later.layer = 0;
  make_nonfinite(later, NonfiniteKind::kNegInf, 7, {0, 0, 7}, 1);
  probes.push_back(later);

  ProbeRecord loss;
  loss.step = 100;
  loss.micro_batch = 0;
  loss.rank = 0;
  loss.phase = Phase::kBackward;
  loss.site = {SiteId::kLoss, -1};
  loss.shape = {};  // a scalar
  loss.stats.count = 1;
  make_nonfinite(loss, NonfiniteKind::kNan, 0, {}, 1);
  probes.push_back(loss);

  ProbeRecord grad;  // micro_batch, rank, layer, head, sample... all -1
  grad.step = 100;
  grad.phase = Phase::kGrad;
  grad.order = 17;
  grad.param = "model.layers.0.self_attn.q_proj.weight." + std::string(300, 'w');
  grad.shape = {4096, 4096};
  grad.stats = finite_stats(4096 * 4096, 0.25, 1e-12, -3.0, 42.0);
  probes.push_back(grad);

  // Statistics that are themselves non-finite (an overflowed sum) survive.
  ProbeRecord overflow = forward_probe(101, 0, 2, "layers.0.mlp.act");
  overflow.stats.max_abs = kNan;
  overflow.stats.min_nonzero_abs = kStatInf;
  overflow.stats.sum = kStatInf;
  overflow.stats.sum_sq = kNan;
  probes.push_back(overflow);
  return probes;
}

std::vector<TraceStepRow> sample_steps() {
  return {{99, 3.25, 3.25, 0.75, true}, {100, kNan, 3.2, kStatInf, false}, {101, 3.0, kNan, 0.5, true}};
}

TraceHeader sample_header() {
  TraceHeader header;
  header.bundle = "/data/incidents/run-42";
  header.tool_version = "0.1.0";
  header.precision = "bf16";
  header.arch = "llama";
  header.extra = {{"note", "replayed twice"}, {"empty", ""}};
  return header;
}

// Equal, or both NaN.
bool same_value(double a, double b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

bool close_value(double a, double b) {
  if (!std::isfinite(a) || !std::isfinite(b)) return same_value(a, b);
  return std::fabs(a - b) <= 1e-12 * std::max(std::fabs(a), std::fabs(b));
}

void require_same_probe(const ProbeRecord& got, const ProbeRecord& want) {
  CAPTURE(probe_name(want));
  REQUIRE(got.step == want.step);
  REQUIRE(got.micro_batch == want.micro_batch);
  REQUIRE(got.rank == want.rank);
  REQUIRE(got.phase == want.phase);
  REQUIRE(got.order == want.order);
  REQUIRE(probe_name(got) == probe_name(want));
  REQUIRE(got.layer == want.layer);
  REQUIRE(got.head == want.head);
  REQUIRE(got.shape == want.shape);
  REQUIRE(got.stats.count == want.stats.count);
  REQUIRE(got.stats.finite_count == want.stats.finite_count);
  REQUIRE(got.stats.nan_count == want.stats.nan_count);
  REQUIRE(got.stats.inf_count == want.stats.inf_count);
  REQUIRE(same_value(got.stats.max_abs, want.stats.max_abs));
  REQUIRE(same_value(got.stats.min_nonzero_abs, want.stats.min_nonzero_abs));
  REQUIRE(close_value(got.stats.mean(), want.stats.mean()));
  REQUIRE(close_value(got.stats.rms(), want.stats.rms()));
  REQUIRE(got.stats.first_nonfinite == want.stats.first_nonfinite);
  REQUIRE(got.stats.first_kind == want.stats.first_kind);
  REQUIRE(got.first_index == want.first_index);
  REQUIRE(got.sample == want.sample);
  REQUIRE(got.position == want.position);
  REQUIRE(got.first_head == want.first_head);
}

void require_same_step(const TraceStepRow& got, const TraceStepRow& want) {
  CAPTURE(want.step);
  REQUIRE(got.step == want.step);
  REQUIRE(same_value(got.loss, want.loss));
  REQUIRE(same_value(got.logged_loss, want.logged_loss));
  REQUIRE(same_value(got.grad_norm, want.grad_norm));
  REQUIRE(got.finite == want.finite);
}

bool python_has_h5py() {
  int status = 0;
  run_command(std::string(NANREPLAY_PYTHON) + " -c 'import h5py' 2>/dev/null", status);
  return status == 0;
}

std::string run_trace_example(const std::string& trace_path, int& status) {
  return run_command(std::string(NANREPLAY_PYTHON) +
                         " " NANREPLAY_SOURCE_DIR "/tests/py/trace_example.py '" + trace_path +
                         "' 2>&1",
                     status);
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Recomputes the integrity block of a trace edited after it was written.
void reseal_trace_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  seal_trace_image(bytes);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// Modifies a written trace with the HDF5 C API to build a broken one, then
// reseals its integrity block, as a deliberate edit would: what these cases
// test is the validation of the HDF5 contents behind a valid block.
class TraceEditor {
 public:
  explicit TraceEditor(const std::string& path)
      : path_(path), file_(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT)) {
    REQUIRE(file_ >= 0);
  }
  ~TraceEditor() {
    H5Fclose(file_);
    reseal_trace_file(path_);
  }
  TraceEditor(const TraceEditor&) = delete;
  TraceEditor& operator=(const TraceEditor&) = delete;

  void remove_link(const char* name) { REQUIRE(H5Ldelete(file_, name, H5P_DEFAULT) >= 0); }
  void set_int_attribute(const char* name, int value) {
    REQUIRE(H5Adelete(file_, name) >= 0);
    const hid_t space = H5Screate(H5S_SCALAR);
    const hid_t attribute = H5Acreate2(file_, name, H5T_STD_I32LE, space, H5P_DEFAULT, H5P_DEFAULT);
    REQUIRE(H5Awrite(attribute, H5T_NATIVE_INT, &value) >= 0);
    H5Aclose(attribute);
    H5Sclose(space);
  }
  void set_string_attribute(const char* name, const std::string& value) {
    REQUIRE(H5Adelete(file_, name) >= 0);
    const hid_t type = H5Tcopy(H5T_C_S1);
    H5Tset_size(type, value.size());
    const hid_t space = H5Screate(H5S_SCALAR);
    const hid_t attribute = H5Acreate2(file_, name, type, space, H5P_DEFAULT, H5P_DEFAULT);
    REQUIRE(H5Awrite(attribute, type, value.data()) >= 0);
    H5Aclose(attribute);
    H5Sclose(space);
    H5Tclose(type);
  }

 private:
  std::string path_;
  hid_t file_;
};

// Calls read_trace and returns the InputError it must throw.
InputError expect_input_error(const std::string& path) {
  try {
    read_trace(path);
  } catch (const InputError& error) {
    return error;
  }
  FAIL("read_trace accepted " << path);
  throw std::logic_error("unreachable");
}

}  // namespace

TEST_CASE("write_trace and read_trace round-trip every field", "[trace]") {
  ScratchDir dir("trace_roundtrip");
  const std::string path = dir.file("trace.h5");
  const std::vector<ProbeRecord> probes = sample_probes();
  const std::vector<TraceStepRow> steps = sample_steps();
  write_trace(path, sample_header(), probes, steps);
  REQUIRE(fs::exists(path));
  REQUIRE_FALSE(dir.holds_temporary_file());

  const TraceContents contents = read_trace(path);
  REQUIRE(contents.header.bundle == "/data/incidents/run-42");
  REQUIRE(contents.header.tool_version == "0.1.0");
  REQUIRE(contents.header.precision == "bf16");
  REQUIRE(contents.header.arch == "llama");
  REQUIRE(contents.header.extra == sample_header().extra);
  REQUIRE(contents.probes.size() == probes.size());
  for (size_t i = 0; i < probes.size(); ++i) require_same_probe(contents.probes[i], probes[i]);
  REQUIRE(contents.steps.size() == steps.size());
  for (size_t i = 0; i < steps.size(); ++i) require_same_step(contents.steps[i], steps[i]);

  // Writing again replaces the file in place.
  write_trace(path, sample_header(), {}, {});
  REQUIRE(read_trace(path).probes.empty());
  REQUIRE_FALSE(dir.holds_temporary_file());
}

TEST_CASE("write_trace output opens with h5dump", "[trace]") {
  ScratchDir dir("trace_h5dump");
  const std::string path = dir.file("trace.h5");
  write_trace(path, sample_header(), sample_probes(), sample_steps());
  int status = -1;
  const std::string listing = run_command("h5dump -H '" + path + "' 2>&1", status);
  REQUIRE(status == 0);
  for (const char* expected : {"ATTRIBUTE \"format\"", "ATTRIBUTE \"format_version\"",
                               "GROUP \"probes\"", "DATASET \"first_index\"", "DATASET \"site\"",
                               "DATASET \"logged_loss\"", "STRPAD H5T_STR_NULLPAD"}) {
    CAPTURE(expected);
    REQUIRE(listing.find(expected) != std::string::npos);
  }
}

TEST_CASE("the h5py example of docs/trace-format.md finds the first bad forward probe", "[trace]") {
  // The doc quotes the script verbatim, so the tested code is the documented code.
  const std::string doc = read_text(NANREPLAY_SOURCE_DIR "/docs/trace-format.md");
  const std::string script = read_text(NANREPLAY_SOURCE_DIR "/tests/py/trace_example.py");
  const size_t open = doc.find("```python\n");
  REQUIRE(open != std::string::npos);
  const size_t body = open + std::string("```python\n").size();
  const std::string example = doc.substr(body, doc.find("```", body) - body);
  REQUIRE(example.size() > 100);
  REQUIRE(script.find(example) != std::string::npos);

  if (!python_has_h5py()) {
    WARN(NANREPLAY_PYTHON " lacks h5py; skipping the run of trace_example.py");
    return;
  }
  ScratchDir dir("trace_example");
  const std::string path = dir.file("trace.h5");
  write_trace(path, sample_header(), sample_probes(), sample_steps());
  int status = -1;
  std::string output = run_trace_example(path, status);
  CAPTURE(output);
  REQUIRE(status == 0);
  REQUIRE(output ==
          "step=100 micro_batch=0 site=layers.1.attn.probs head=0 kind=nan index=0x0x5x2\n");

  write_trace(path, sample_header(), {forward_probe(7, 0, 0, "embed")}, {});
  output = run_trace_example(path, status);
  REQUIRE(status == 0);
  REQUIRE(output == "no non-finite forward probe\n");
}

TEST_CASE("write_trace handles a trace with zero records", "[trace]") {
  ScratchDir dir("trace_empty");
  const std::string path = dir.file("trace.h5");
  TraceHeader header;  // empty strings become 1-byte null-padded attributes
  write_trace(path, header, {}, {});
  const TraceContents contents = read_trace(path);
  REQUIRE(contents.probes.empty());
  REQUIRE(contents.steps.empty());
  REQUIRE(contents.header.bundle.empty());
  REQUIRE(contents.header.extra.empty());
  int status = -1;
  run_command("h5dump -H '" + path + "' > /dev/null 2>&1", status);
  REQUIRE(status == 0);
  if (python_has_h5py()) {
    REQUIRE(run_trace_example(path, status) == "no non-finite forward probe\n");
    REQUIRE(status == 0);
  }
  REQUIRE_FALSE(dir.holds_temporary_file());
}

TEST_CASE("write_trace chunks long columns and still reads back", "[trace]") {
  ScratchDir dir("trace_large");
  const std::string path = dir.file("trace.h5");
  std::vector<ProbeRecord> probes;
  for (int i = 0; i < 20000; ++i) {
    probes.push_back(
        forward_probe(i / 100, 0, i % 100, "layers." + std::to_string(i % 7) + ".output"));
  }
  make_nonfinite(probes[12345], NonfiniteKind::kNegInf, 99, {0, 0, 99}, 1);
  write_trace(path, sample_header(), probes, sample_steps());
  const TraceContents contents = read_trace(path);
  REQUIRE(contents.probes.size() == probes.size());
  for (size_t i : {size_t{0}, size_t{4095}, size_t{4096}, size_t{12345}, size_t{19999}}) {
    require_same_probe(contents.probes[i], probes[i]);
  }
  int status = -1;
  const std::string listing = run_command("h5dump -p -H '" + path + "' 2>&1", status);
  REQUIRE(status == 0);
  REQUIRE(listing.find("CHUNKED") != std::string::npos);
  if (python_has_h5py()) {
    REQUIRE(run_trace_example(path, status) ==
            "step=123 micro_batch=0 site=layers.4.output head=-1 kind=-inf index=0x0x99\n");
  }
}

TEST_CASE("write_trace failures throw, leave no file and print nothing", "[trace]") {
  ScratchDir dir("trace_failures");

  SECTION("the directory does not exist") {
    const std::string path = dir.file("missing/trace.h5");
    StderrCapture capture(dir.file("stderr.txt"));
    REQUIRE_THROWS_WITH(write_trace(path, sample_header(), sample_probes(), sample_steps()),
                        Catch::Contains("cannot write trace") && Catch::Contains(path));
    REQUIRE(capture.finish().empty());
  }
  SECTION("HDF5 fails in the middle of the file") {
    // Default-format attributes are limited to 64 KiB: this one fails after
    // the file was created, so the temporary file must be cleaned up.
    const std::string path = dir.file("trace.h5");
    TraceHeader header = sample_header();
    header.extra["huge"] = std::string(100000, 'x');
    StderrCapture capture(dir.file("stderr.txt"));
    REQUIRE_THROWS_AS(write_trace(path, header, sample_probes(), sample_steps()),
                      std::runtime_error);
    REQUIRE(capture.finish().empty());
    REQUIRE_FALSE(fs::exists(path));
  }
  SECTION("the final name is taken by a directory") {
    const std::string path = dir.file("occupied");
    fs::create_directory(path);
    REQUIRE_THROWS_WITH(write_trace(path, sample_header(), sample_probes(), sample_steps()),
                        Catch::Contains("renaming"));
  }
  SECTION("an extra attribute shadows a reserved one") {
    TraceHeader header = sample_header();
    header.extra["format"] = "other";
    REQUIRE_THROWS_AS(write_trace(dir.file("trace.h5"), header, {}, {}), std::invalid_argument);
  }
  REQUIRE_FALSE(dir.holds_temporary_file());
}

TEST_CASE("read_trace rejects bad files with InputError naming file and key", "[trace]") {
  ScratchDir dir("trace_bad");
  const std::string path = dir.file("trace.h5");

  SECTION("missing file") {
    const InputError error = expect_input_error(dir.file("absent.h5"));
    REQUIRE(error.file() == dir.file("absent.h5"));
  }
  SECTION("not an HDF5 file") {
    std::ofstream(path) << "step,loss\n1,2.0\n";
    StderrCapture capture(dir.file("stderr.txt"));
    const InputError error = expect_input_error(path);
    REQUIRE(capture.finish().empty());
    REQUIRE(error.file() == path);
    REQUIRE(std::string(error.what()).find("not an HDF5 file") != std::string::npos);
  }
  SECTION("missing dataset") {
    write_trace(path, sample_header(), sample_probes(), sample_steps());
    TraceEditor(path).remove_link("/probes/site");
    const InputError error = expect_input_error(path);
    REQUIRE(error.file() == path);
    REQUIRE(error.key() == "/probes/site");
  }
  SECTION("missing group") {
    write_trace(path, sample_header(), sample_probes(), sample_steps());
    TraceEditor(path).remove_link("/steps");
    REQUIRE(expect_input_error(path).key() == "/steps/step");
  }
  SECTION("wrong format attribute") {
    write_trace(path, sample_header(), sample_probes(), sample_steps());
    TraceEditor(path).set_string_attribute("format", "some.other.format");
    const InputError error = expect_input_error(path);
    REQUIRE(error.key() == "format");
    REQUIRE(std::string(error.what()).find("some.other.format") != std::string::npos);
  }
  SECTION("newer format version") {
    write_trace(path, sample_header(), sample_probes(), sample_steps());
    TraceEditor(path).set_int_attribute("format_version", 2);
    const InputError error = expect_input_error(path);
    REQUIRE(error.key() == "format_version");
    REQUIRE(std::string(error.what()).find("nanreplay run") != std::string::npos);
  }
}

}  // namespace nanreplay

namespace nanreplay {
namespace {

// A file-size limit makes every write past it fail with EFBIG, as a full disk
// fails with ENOSPC; SIGXFSZ ignored so the process sees the error instead.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    ::getrlimit(RLIMIT_FSIZE, &saved_);
    previous_handler_ = std::signal(SIGXFSZ, SIG_IGN);
    rlimit limit = saved_;
    limit.rlim_cur = bytes;
    ::setrlimit(RLIMIT_FSIZE, &limit);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &saved_);
    std::signal(SIGXFSZ, previous_handler_);
  }

 private:
  rlimit saved_{};
  void (*previous_handler_)(int) = SIG_DFL;
};

std::vector<ProbeRecord> one_step_of_probes(int64_t step) {
  std::vector<ProbeRecord> records;
  for (int i = 0; i < 300; ++i) records.push_back(forward_probe(step, 0, i, "layers." + std::to_string(i % 7) + ".output"));
  return records;
}

}  // namespace

TEST_CASE("TraceStream appends step by step and reads back as one table", "[trace][stream]") {
  ScratchDir dir("trace_stream");
  const std::string path = dir.file("trace.h5");
  std::vector<ProbeRecord> all;
  {
    TraceStream stream(path);
    for (int64_t step = 0; step < 40; ++step) {
      const std::vector<ProbeRecord> records = one_step_of_probes(step);
      stream.append(records);
      all.insert(all.end(), records.begin(), records.end());
    }
    stream.append({});
    REQUIRE(stream.records_written() == all.size());
    stream.finish(sample_header(), sample_steps());
  }
  const TraceContents contents = read_trace(path);
  REQUIRE(contents.probes.size() == all.size());
  for (size_t i : {size_t{0}, size_t{299}, size_t{300}, size_t{6001}, all.size() - 1}) {
    require_same_probe(contents.probes[i], all[i]);
  }
  REQUIRE(contents.steps.size() == sample_steps().size());
}

TEST_CASE("TraceStream: unfinished, a failing disk or a value too wide leave no file", "[trace][stream]") {
  ScratchDir dir("trace_stream_faults");
  const std::string path = dir.file("trace.h5");
  SECTION("destroyed before finish") {
    {
      TraceStream stream(path);
      stream.append(one_step_of_probes(0));
      REQUIRE(fs::exists(path));
    }
    REQUIRE_FALSE(fs::exists(path));
  }
  SECTION("the disk fails part-way: OutputError naming the file and the system error, nothing left") {
    StderrCapture capture(dir.file("stderr.txt"));
    {
      FileSizeLimit limit(256 * 1024);
      TraceStream stream(path, "out/trace.h5");
      const auto fill = [&] {
        for (int64_t step = 0; step < 2000; ++step) stream.append(one_step_of_probes(step));
        stream.finish(sample_header(), sample_steps());
      };
      REQUIRE_THROWS_WITH(fill(), Catch::Contains("out/trace.h5") && Catch::Contains("File too large"));
    }
    REQUIRE(capture.finish().empty());
    REQUIRE_FALSE(fs::exists(path));
  }
  SECTION("a later value wider than its column's first rows fixed") {
    TraceStream stream(path);
    stream.append(one_step_of_probes(0));
    std::vector<ProbeRecord> wide = one_step_of_probes(1);
    wide[0].phase = Phase::kGrad;
    wide[0].param = std::string(400, 'p');
    REQUIRE_THROWS_WITH(stream.append(wide), Catch::Contains("column site"));
  }
}

}  // namespace nanreplay
