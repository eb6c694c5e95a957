// The child parses, encodes its result (or its InputError) and leaves with
// _exit; the parent reads the pipe to its end, reaps the child and decodes.
// Rows travel through the trace's own column tables (integers and text), so a
// new column needs no change here; the probe statistics travel as the stored
// sums rather than as mean and rms, so the parent's rows equal the child's
// bit for bit.
#include "reports/outputs/trace/trace_parse_isolation.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "loaders/base/error.h"
#include "reports/outputs/trace/trace_layout.h"

namespace nanreplay {
namespace {

using namespace trace_layout;

// What the child sends first.
enum class Outcome : char { kContents = 'T', kInputError = 'E', kOtherError = 'F' };

// The probe statistics a reader keeps, as stored (mean and rms are derived).
double TensorStats::*const kProbeStatistics[] = {&TensorStats::max_abs, &TensorStats::min_nonzero_abs,
                                                 &TensorStats::sum, &TensorStats::sum_sq};
static_assert(sizeof(kProbeRealColumns) / sizeof(kProbeRealColumns[0]) == 5,
              "a new real probe column travels through kProbeStatistics or as headroom_bits does");

class Encoder {
 public:
  void byte(char value) { out_ += value; }
  void integer(int64_t value) { out_.append(reinterpret_cast<const char*>(&value), sizeof value); }
  void real(double value) { out_.append(reinterpret_cast<const char*>(&value), sizeof value); }
  void text(const std::string& value) {
    integer(static_cast<int64_t>(value.size()));
    out_ += value;
  }
  const std::string& bytes() const { return out_; }

 private:
  std::string out_;
};

class Decoder {
 public:
  Decoder(const std::string& bytes, const std::string& label) : bytes_(bytes), label_(label) {}
  char byte() { return *take(1); }
  int64_t integer() { return load<int64_t>(); }
  double real() { return load<double>(); }
  std::string text() {
    const int64_t size = integer();
    if (size < 0 || static_cast<uint64_t>(size) > bytes_.size() - at_) malformed();
    return std::string(take(size_t(size)), size_t(size));
  }
  // A count of items taking at least `least_bytes` each, checked against what is left.
  size_t count(size_t least_bytes) {
    const int64_t value = integer();
    if (value < 0 || static_cast<uint64_t>(value) > (bytes_.size() - at_) / least_bytes) malformed();
    return size_t(value);
  }
  void finish() const {
    if (at_ != bytes_.size()) malformed();
  }
  [[noreturn]] void malformed() const {
    throw InputError(label_, "", "the isolated HDF5 parse returned malformed rows; regenerate the trace with `nanreplay run`");
  }

 private:
  const char* take(size_t size) {
    if (size > bytes_.size() - at_) malformed();
    const char* begin = bytes_.data() + at_;
    at_ += size;
    return begin;
  }
  template <class T>
  T load() {
    T value;
    std::memcpy(&value, take(sizeof value), sizeof value);
    return value;
  }
  const std::string& bytes_;
  const std::string& label_;
  size_t at_ = 0;
};

std::string encode_contents(const TraceContents& contents) {
  Encoder out;
  out.byte(static_cast<char>(Outcome::kContents));
  for (const HeaderAttribute& attribute : kHeaderAttributes) out.text(contents.header.*attribute.field);
  out.integer(static_cast<int64_t>(contents.header.extra.size()));
  for (const auto& [name, value] : contents.header.extra) {
    out.text(name);
    out.text(value);
  }
  out.integer(static_cast<int64_t>(contents.probes.size()));
  for (const ProbeRecord& probe : contents.probes) {
    for (const auto& column : kProbeIntegerColumns) out.integer(column.get(probe));
    for (const auto& column : kProbeTextColumns) out.text(column.get(probe));
    for (double TensorStats::*field : kProbeStatistics) out.real(probe.stats.*field);
    out.real(probe.headroom_bits);
  }
  out.integer(static_cast<int64_t>(contents.steps.size()));
  for (const TraceStepRow& step : contents.steps) {
    for (const auto& column : kStepIntegerColumns) out.integer(column.get(step));
    for (const auto& column : kStepRealColumns) out.real(column.get(step));
  }
  return out.bytes();
}

TraceContents decode_contents(Decoder& in) {
  TraceContents contents;
  for (const HeaderAttribute& attribute : kHeaderAttributes) contents.header.*attribute.field = in.text();
  for (size_t i = 0, n = in.count(2 * sizeof(int64_t)); i < n; ++i) {
    std::string name = in.text();
    contents.header.extra[std::move(name)] = in.text();
  }
  contents.probes.resize(in.count(sizeof(int64_t)));
  for (ProbeRecord& probe : contents.probes) {
    for (const auto& column : kProbeIntegerColumns) column.set(probe, in.integer());
    for (const auto& column : kProbeTextColumns) {
      if (!column.set(probe, in.text())) in.malformed();
    }
    for (double TensorStats::*field : kProbeStatistics) probe.stats.*field = in.real();
    probe.headroom_bits = in.real();
  }
  contents.steps.resize(in.count(sizeof(int64_t)));
  for (TraceStepRow& step : contents.steps) {
    for (const auto& column : kStepIntegerColumns) column.set(step, in.integer());
    for (const auto& column : kStepRealColumns) column.set(step, in.real());
  }
  in.finish();
  return contents;
}

std::string encode_input_error(const InputError& error) {
  Encoder out;
  out.byte(static_cast<char>(Outcome::kInputError));
  out.text(error.file());
  out.text(error.key());
  out.text(error.what());
  return out.bytes();
}

std::string encode_other_error(const char* what) {
  Encoder out;
  out.byte(static_cast<char>(Outcome::kOtherError));
  out.text(what);
  return out.bytes();
}

// InputError's text is printable(file: key: detail); the detail is what
// follows that prefix, so the rebuilt error reads exactly as the child's.
[[noreturn]] void rethrow_input_error(Decoder& in) {
  const std::string file = in.text();
  const std::string key = in.text();
  const std::string what = in.text();
  in.finish();
  const std::string prefix = InputError(file, key, "").what();
  const bool has_prefix = what.compare(0, prefix.size(), prefix) == 0;
  throw InputError(file, key, has_prefix ? what.substr(prefix.size()) : what);
}

bool write_all(int fd, const std::string& bytes) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + sent, bytes.size() - sent);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    sent += size_t(n);
  }
  return true;
}

// The parent's handlers are not the child's to run: a test framework's would
// report the crash as its own, the CLI's interrupt handler would clean up the
// parent's outputs. A crash or a signal simply ends the child.
void restore_default_signals() {
  for (const int signal : {SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGINT, SIGTERM, SIGPIPE}) {
    ::signal(signal, SIG_DFL);
  }
}

[[noreturn]] void run_child(int fd, const std::function<TraceContents()>& parse) {
  restore_default_signals();
  std::string message;
  try {
    message = encode_contents(parse());
  } catch (const InputError& error) {
    message = encode_input_error(error);
  } catch (const std::exception& error) {
    message = encode_other_error(error.what());
  } catch (...) {
    message = encode_other_error("unknown failure");
  }
  // _exit: the child must not run the parent's exit handlers or destructors.
  ::_exit(write_all(fd, message) ? 0 : 1);
}

std::string read_all(int fd) {
  std::string bytes;
  char chunk[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, chunk, sizeof chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return bytes;
    bytes.append(chunk, size_t(n));
  }
}

int reap(pid_t child) {
  int status = 0;
  while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  return status;
}

[[noreturn]] void child_died(const std::string& label, int status) {
  const std::string how = WIFSIGNALED(status) ? "stopped with signal " + std::to_string(WTERMSIG(status))
                                              : "exited with status " + std::to_string(WEXITSTATUS(status));
  throw InputError(label, "",
                   "HDF5's parser " + how + " on this file, whose integrity block checks out: it was edited and "
                   "resealed, or crafted; regenerate it with `nanreplay run`");
}

}  // namespace

TraceContents parse_trace_in_child(const std::string& label, const std::function<TraceContents()>& parse) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("cannot read trace " + label + ": pipe: " + errno_text());
  std::fflush(nullptr);  // nothing buffered is written twice
  const pid_t child = ::fork();
  if (child < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    throw std::runtime_error("cannot read trace " + label + ": fork: " + errno_text());
  }
  if (child == 0) {
    ::close(fds[0]);
    run_child(fds[1], parse);
  }
  ::close(fds[1]);
  const std::string bytes = read_all(fds[0]);
  ::close(fds[0]);
  const int status = reap(child);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || bytes.empty()) child_died(label, status);
  Decoder in(bytes, label);
  switch (static_cast<Outcome>(in.byte())) {
    case Outcome::kContents: return decode_contents(in);
    case Outcome::kInputError: rethrow_input_error(in);
    case Outcome::kOtherError: throw std::runtime_error(in.text());
  }
  in.malformed();
}

}  // namespace nanreplay
