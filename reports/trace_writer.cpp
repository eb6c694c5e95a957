// Writes and reads trace.h5 (layout in trace_writer.h and docs/trace-format.md)
// with the HDF5 C API. Every column is named once, in the tables below, which
// drive both the writer and the reader. HDF5 only ever works on memory (its
// core driver): the writer builds the file image in memory and writes it to
// disk itself, so a full disk is one checked write(), not an error inside
// HDF5; the reader reads the file, checks its integrity block
// (trace_integrity.h) and only then lets HDF5 parse the bytes, then checks
// every type, shape and size before reading. HDF5 never prints: its errors
// become exceptions. Serial HDF5 is not thread-safe: one write_trace/read_trace
// at a time per process.
#include "reports/trace_writer.h"

#include <fcntl.h>
#include <hdf5.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <new>
#include <set>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "loaders/error.h"
#include "reports/trace_integrity.h"

namespace nanreplay {
namespace {

constexpr const char* kFormatName = "nanreplay.trace";
constexpr int kFormatVersion = 1;
constexpr const char* kProbesGroup = "probes";
constexpr const char* kStepsGroup = "steps";
// Lists the names of TraceHeader::extra (newline-separated), so the reader
// opens attributes by name and never iterates over a file's attributes.
constexpr const char* kExtraAttributesName = "extra_attributes";
// HDF5's core driver grows the in-memory file by this much at a time.
constexpr size_t kImageIncrement = size_t{1} << 20;
// No column may claim more decoded bytes than this many times the file's size
// (deflate's best ratio is about 1032:1): a dataset with no storage but a
// huge shape cannot make the reader allocate memory it would never fill.
constexpr uint64_t kMaxExpansion = 1100;
// Widest string column or attribute the reader accepts.
constexpr size_t kMaxStringWidth = size_t{1} << 20;
// Largest chunk the reader lets HDF5 decompress (the writer's are 256 KiB).
constexpr uint64_t kMaxChunkBytes = uint64_t{1} << 22;
// Columns shorter than this stay contiguous: chunking buys nothing there.
constexpr hsize_t kChunkThreshold = 4096;
constexpr hsize_t kChunkBytes = hsize_t{1} << 18;

// --- HDF5 plumbing -------------------------------------------------------

// Owns one HDF5 identifier and closes it with the matching H5?close.
class Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  Handle() = default;
  Handle(hid_t id, Closer closer) : id_(id), closer_(closer) {}
  Handle(Handle&& other) noexcept : id_(std::exchange(other.id_, -1)), closer_(other.closer_) {}
  Handle& operator=(Handle&& other) noexcept {
    if (this != &other) {
      reset();
      id_ = std::exchange(other.id_, -1);
      closer_ = other.closer_;
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() { reset(); }

  hid_t get() const { return id_; }
  // Closes now and reports whether HDF5 managed to (file close flushes).
  bool close() {
    const herr_t status = id_ >= 0 ? closer_(id_) : 0;
    id_ = -1;
    return status >= 0;
  }

 private:
  void reset() {
    if (id_ >= 0) closer_(id_);
    id_ = -1;
  }
  hid_t id_ = -1;
  Closer closer_ = nullptr;
};

// HDF5 prints its error stack to stderr by default, at the failing call and
// again at exit: switched off for good (per thread in a thread-safe HDF5, so
// at every entry point). The library never prints; errors become exceptions.
void silence_hdf5() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }

// The innermost message on HDF5's error stack (the most specific one), then
// clears the stack. Only its "error message = '...'" part when it has one (a
// system error); one line either way.
std::string take_hdf5_error() {
  std::string detail;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned depth, const H5E_error2_t* error, void* out) -> herr_t {
        if (depth == 0 && error->desc != nullptr) *static_cast<std::string*>(out) = error->desc;
        return 0;
      },
      &detail);
  H5Eclear2(H5E_DEFAULT);
  const std::string marker = "error message = '";
  const size_t at = detail.find(marker);
  if (at != std::string::npos) {
    const size_t begin = at + marker.size();
    detail = detail.substr(begin, detail.find('\'', begin) - begin);
  }
  return printable(detail);
}

// Writer-side HDF5 failures (the file is built in memory: a bug or no
// memory): std::runtime_error naming the file and the step.
[[noreturn]] void fail_write(const std::string& path, const std::string& what) {
  const std::string detail = take_hdf5_error();
  throw std::runtime_error("cannot write trace " + path + ": " + what +
                           (detail.empty() ? "" : " (HDF5: " + detail + ")"));
}

Handle checked(hid_t id, Handle::Closer closer, const std::string& path, const std::string& what) {
  if (id < 0) fail_write(path, what);
  return Handle(id, closer);
}

void checked(herr_t status, const std::string& path, const std::string& what) {
  if (status < 0) fail_write(path, what);
}

std::string errno_text() { return std::strerror(errno); }

// --- The column tables ---------------------------------------------------

enum class Storage { kI32, kI64, kU8, kF64 };

hid_t file_type(Storage storage) {
  switch (storage) {
    case Storage::kI32: return H5T_STD_I32LE;
    case Storage::kI64: return H5T_STD_I64LE;
    case Storage::kU8: return H5T_STD_U8LE;
    case Storage::kF64: return H5T_IEEE_F64LE;
  }
  return H5T_STD_I64LE;
}

template <class Row>
struct IntegerColumn {
  const char* name;
  Storage storage;
  int64_t (*get)(const Row&);
  void (*set)(Row&, int64_t);
};

template <class Row>
struct RealColumn {
  const char* name;
  double (*get)(const Row&);
  void (*set)(Row&, double);
};

template <class Row>
struct TextColumn {
  const char* name;
  std::string (*get)(const Row&);
  bool (*set)(Row&, const std::string&);  // false: not a valid value
};

std::string join_dims(const std::vector<int64_t>& dims) {
  std::string text;
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? "x" : "") + std::to_string(dims[i]);
  return text;
}

bool split_dims(const std::string& text, std::vector<int64_t>& dims) {
  dims.clear();
  if (text.empty()) return true;
  size_t start = 0;
  while (true) {
    const size_t end = text.find('x', start);
    const std::string part = text.substr(start, end == std::string::npos ? end : end - start);
    if (part.empty() || part.find_first_not_of("0123456789") != std::string::npos) return false;
    int64_t value = 0;
    for (const char digit : part) {
      if (__builtin_mul_overflow(value, 10, &value) || __builtin_add_overflow(value, digit - '0', &value)) {
        return false;
      }
    }
    dims.push_back(value);
    if (end == std::string::npos) return true;
    start = end + 1;
  }
}

bool parse_phase(const std::string& text, Phase& phase) {
  for (Phase candidate : {Phase::kForward, Phase::kBackward, Phase::kGrad}) {
    if (text == phase_name(candidate)) {
      phase = candidate;
      return true;
    }
  }
  return false;
}

bool parse_kind(const std::string& text, NonfiniteKind& kind) {
  for (NonfiniteKind candidate : {NonfiniteKind::kNone, NonfiniteKind::kNan, NonfiniteKind::kPosInf,
                                  NonfiniteKind::kNegInf}) {
    if (text == nonfinite_kind_name(candidate)) {
      kind = candidate;
      return true;
    }
  }
  return false;
}

using Probe = ProbeRecord;

// /probes, in the order of the layout comment. The reader applies integer
// columns before real ones: mean and rms are turned back into sums using
// finite_count (sum and sum_sq themselves are not stored).
const IntegerColumn<Probe> kProbeIntegerColumns[] = {
    {"step", Storage::kI64, [](const Probe& r) -> int64_t { return r.step; },
     [](Probe& r, int64_t v) { r.step = v; }},
    {"micro_batch", Storage::kI32, [](const Probe& r) -> int64_t { return r.micro_batch; },
     [](Probe& r, int64_t v) { r.micro_batch = int(v); }},
    {"rank", Storage::kI32, [](const Probe& r) -> int64_t { return r.rank; },
     [](Probe& r, int64_t v) { r.rank = int(v); }},
    {"order", Storage::kI32, [](const Probe& r) -> int64_t { return r.order; },
     [](Probe& r, int64_t v) { r.order = int(v); }},
    {"layer", Storage::kI32, [](const Probe& r) -> int64_t { return r.layer; },
     [](Probe& r, int64_t v) { r.layer = int(v); }},
    {"head", Storage::kI32, [](const Probe& r) -> int64_t { return r.head; },
     [](Probe& r, int64_t v) { r.head = int(v); }},
    {"count", Storage::kI64, [](const Probe& r) -> int64_t { return r.stats.count; },
     [](Probe& r, int64_t v) { r.stats.count = v; }},
    {"finite_count", Storage::kI64, [](const Probe& r) -> int64_t { return r.stats.finite_count; },
     [](Probe& r, int64_t v) { r.stats.finite_count = v; }},
    {"nan_count", Storage::kI64, [](const Probe& r) -> int64_t { return r.stats.nan_count; },
     [](Probe& r, int64_t v) { r.stats.nan_count = v; }},
    {"inf_count", Storage::kI64, [](const Probe& r) -> int64_t { return r.stats.inf_count; },
     [](Probe& r, int64_t v) { r.stats.inf_count = v; }},
    {"first_nonfinite", Storage::kI64,
     [](const Probe& r) -> int64_t { return r.stats.first_nonfinite; },
     [](Probe& r, int64_t v) { r.stats.first_nonfinite = v; }},
    {"sample", Storage::kI64, [](const Probe& r) -> int64_t { return r.sample; },
     [](Probe& r, int64_t v) { r.sample = v; }},
    {"position", Storage::kI64, [](const Probe& r) -> int64_t { return r.position; },
     [](Probe& r, int64_t v) { r.position = v; }},
    {"first_head", Storage::kI32, [](const Probe& r) -> int64_t { return r.first_head; },
     [](Probe& r, int64_t v) { r.first_head = int(v); }},
};

const RealColumn<Probe> kProbeRealColumns[] = {
    {"max_abs", [](const Probe& r) { return r.stats.max_abs; },
     [](Probe& r, double v) { r.stats.max_abs = v; }},
    {"min_nonzero_abs", [](const Probe& r) { return r.stats.min_nonzero_abs; },
     [](Probe& r, double v) { r.stats.min_nonzero_abs = v; }},
    {"mean", [](const Probe& r) { return r.stats.mean(); },
     [](Probe& r, double v) { r.stats.sum = v * double(r.stats.finite_count); }},
    {"rms", [](const Probe& r) { return r.stats.rms(); },
     [](Probe& r, double v) { r.stats.sum_sq = v * v * double(r.stats.finite_count); }},
    {"headroom_bits", [](const Probe& r) { return r.headroom_bits; },
     [](Probe& r, double v) { r.headroom_bits = v; }},
};

const TextColumn<Probe> kProbeTextColumns[] = {
    {"phase", [](const Probe& r) -> std::string { return phase_name(r.phase); },
     [](Probe& r, const std::string& v) { return parse_phase(v, r.phase); }},
    // After "phase": a parameter's key for phase grad, a site's name otherwise.
    {"site", [](const Probe& r) { return probe_name(r); },
     [](Probe& r, const std::string& v) {
       if (r.phase == Phase::kGrad) {
         r.param = v;
         return true;
       }
       const std::optional<SiteRef> site = parse_site_name(v);
       if (site) r.site = *site;
       return site.has_value();
     }},
    {"first_kind",
     [](const Probe& r) -> std::string { return nonfinite_kind_name(r.stats.first_kind); },
     [](Probe& r, const std::string& v) { return parse_kind(v, r.stats.first_kind); }},
    {"shape", [](const Probe& r) { return join_dims(r.shape); },
     [](Probe& r, const std::string& v) { return split_dims(v, r.shape); }},
    {"first_index", [](const Probe& r) { return join_dims(r.first_index); },
     [](Probe& r, const std::string& v) { return split_dims(v, r.first_index); }},
};

using Step = TraceStepRow;

const IntegerColumn<Step> kStepIntegerColumns[] = {
    {"step", Storage::kI64, [](const Step& r) -> int64_t { return r.step; },
     [](Step& r, int64_t v) { r.step = v; }},
    {"finite", Storage::kU8, [](const Step& r) -> int64_t { return r.finite ? 1 : 0; },
     [](Step& r, int64_t v) { r.finite = v != 0; }},
};

const RealColumn<Step> kStepRealColumns[] = {
    {"loss", [](const Step& r) { return r.loss; }, [](Step& r, double v) { r.loss = v; }},
    {"logged_loss", [](const Step& r) { return r.logged_loss; },
     [](Step& r, double v) { r.logged_loss = v; }},
    {"grad_norm", [](const Step& r) { return r.grad_norm; },
     [](Step& r, double v) { r.grad_norm = v; }},
};

// The fewest decoded bytes a row takes over all columns of its table (each
// string column at least one byte): bounds how many rows a file can hold.
constexpr uint64_t kMinProbeRowBytes = 8 * 8 + 6 * 4 + 5 * 8 + 5 * 1;  // i64, i32, f64 and string columns
constexpr uint64_t kMinStepRowBytes = 8 + 1 + 3 * 8;
static_assert(sizeof(kProbeIntegerColumns) / sizeof(kProbeIntegerColumns[0]) == 14, "update kMinProbeRowBytes");
static_assert(sizeof(kProbeRealColumns) / sizeof(kProbeRealColumns[0]) == 5, "update kMinProbeRowBytes");
static_assert(sizeof(kProbeTextColumns) / sizeof(kProbeTextColumns[0]) == 5, "update kMinProbeRowBytes");

// Root attributes written from TraceHeader; with format, format_version and
// created_utc, these names are not available to TraceHeader::extra.
struct HeaderAttribute {
  const char* name;
  std::string TraceHeader::*field;
};
const HeaderAttribute kHeaderAttributes[] = {{"bundle", &TraceHeader::bundle},
                                             {"tool_version", &TraceHeader::tool_version},
                                             {"precision", &TraceHeader::precision},
                                             {"arch", &TraceHeader::arch}};
const std::set<std::string>& reserved_attribute_names() {
  static const std::set<std::string> names = {"format",    "format_version", "created_utc",
                                              "bundle",    "tool_version",   "precision",
                                              "arch",      kExtraAttributesName};
  return names;
}

// --- Writing -------------------------------------------------------------

std::string utc_timestamp() {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return text;
}

// Fixed-length, null-padded ASCII of `width` bytes (HDF5 rejects width 0).
Handle string_type(size_t width, const std::string& path) {
  Handle type = checked(H5Tcopy(H5T_C_S1), H5Tclose, path, "string type");
  checked(H5Tset_size(type.get(), std::max<size_t>(width, 1)), path, "string type");
  checked(H5Tset_strpad(type.get(), H5T_STR_NULLPAD), path, "string type");
  checked(H5Tset_cset(type.get(), H5T_CSET_ASCII), path, "string type");
  return type;
}

class TraceFileWriter {
 public:
  TraceFileWriter(std::string display_path, hid_t file)
      : path_(std::move(display_path)), file_(file) {}

  void write_string_attribute(const char* name, const std::string& value) {
    Handle type = string_type(value.size(), path_);
    Handle space = checked(H5Screate(H5S_SCALAR), H5Sclose, path_, "attribute space");
    Handle attribute =
        checked(H5Acreate2(file_, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT),
                H5Aclose, path_, std::string("attribute ") + name);
    std::string padded = value;
    padded.resize(std::max<size_t>(value.size(), 1), '\0');
    checked(H5Awrite(attribute.get(), type.get(), padded.data()), path_,
            std::string("attribute ") + name);
  }

  void write_int_attribute(const char* name, int value) {
    Handle space = checked(H5Screate(H5S_SCALAR), H5Sclose, path_, "attribute space");
    Handle attribute =
        checked(H5Acreate2(file_, name, H5T_STD_I32LE, space.get(), H5P_DEFAULT, H5P_DEFAULT),
                H5Aclose, path_, std::string("attribute ") + name);
    checked(H5Awrite(attribute.get(), H5T_NATIVE_INT, &value), path_,
            std::string("attribute ") + name);
  }

  Handle create_group(const char* name) {
    return checked(H5Gcreate2(file_, name, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose, path_,
                   std::string("group /") + name);
  }

  template <class Row, size_t N>
  void write_columns(hid_t group, const std::string& group_name, const std::vector<Row>& rows,
                     const IntegerColumn<Row> (&columns)[N]) {
    std::vector<int64_t> values(rows.size());
    for (const IntegerColumn<Row>& column : columns) {
      for (size_t i = 0; i < rows.size(); ++i) values[i] = column.get(rows[i]);
      // HDF5 narrows the int64 buffer to the column's stored width.
      write_dataset(group, group_name, column.name, file_type(column.storage), H5T_NATIVE_INT64,
                    sizeof(int64_t), rows.size(), values.data());
    }
  }

  template <class Row, size_t N>
  void write_columns(hid_t group, const std::string& group_name, const std::vector<Row>& rows,
                     const RealColumn<Row> (&columns)[N]) {
    std::vector<double> values(rows.size());
    for (const RealColumn<Row>& column : columns) {
      for (size_t i = 0; i < rows.size(); ++i) values[i] = column.get(rows[i]);
      write_dataset(group, group_name, column.name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE,
                    sizeof(double), rows.size(), values.data());
    }
  }

  template <class Row, size_t N>
  void write_columns(hid_t group, const std::string& group_name, const std::vector<Row>& rows,
                     const TextColumn<Row> (&columns)[N]) {
    for (const TextColumn<Row>& column : columns) {
      std::vector<std::string> texts(rows.size());
      size_t width = 1;
      for (size_t i = 0; i < rows.size(); ++i) {
        texts[i] = column.get(rows[i]);
        width = std::max(width, texts[i].size());
      }
      std::vector<char> packed(rows.size() * width, '\0');
      for (size_t i = 0; i < rows.size(); ++i) {
        std::memcpy(packed.data() + i * width, texts[i].data(), texts[i].size());
      }
      Handle type = string_type(width, path_);
      write_dataset(group, group_name, column.name, type.get(), type.get(), width, rows.size(),
                    packed.data());
    }
  }

 private:
  void write_dataset(hid_t group, const std::string& group_name, const char* name, hid_t stored,
                     hid_t in_memory, size_t element_size, size_t length, const void* data) {
    const std::string where = "dataset /" + group_name + "/" + name;
    const hsize_t dims[1] = {length};
    Handle space = checked(H5Screate_simple(1, dims, nullptr), H5Sclose, path_, where);
    Handle properties = checked(H5Pcreate(H5P_DATASET_CREATE), H5Pclose, path_, where);
    if (length >= kChunkThreshold) {
      const hsize_t chunk[1] = {
          std::min<hsize_t>(length, std::max<hsize_t>(1, kChunkBytes / element_size))};
      checked(H5Pset_chunk(properties.get(), 1, chunk), path_, where);
      // Shuffle + deflate are built into every HDF5, so h5dump and h5py read them.
      if (H5Zfilter_avail(H5Z_FILTER_DEFLATE) > 0) {
        checked(H5Pset_shuffle(properties.get()), path_, where);
        checked(H5Pset_deflate(properties.get(), 1), path_, where);
      }
    }
    Handle dataset = checked(
        H5Dcreate2(group, name, stored, space.get(), H5P_DEFAULT, properties.get(), H5P_DEFAULT),
        H5Dclose, path_, where);
    if (length > 0) {
      checked(H5Dwrite(dataset.get(), in_memory, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), path_,
              where);
    }
  }

  std::string path_;
  hid_t file_;
};

void write_trace_file(const std::string& path, hid_t file, const TraceHeader& header,
                      const std::vector<ProbeRecord>& probes,
                      const std::vector<TraceStepRow>& steps) {
  TraceFileWriter writer(path, file);
  writer.write_string_attribute("format", kFormatName);
  writer.write_int_attribute("format_version", kFormatVersion);
  for (const HeaderAttribute& attribute : kHeaderAttributes) {
    writer.write_string_attribute(attribute.name, header.*attribute.field);
  }
  writer.write_string_attribute("created_utc", utc_timestamp());
  std::string extra_names;
  for (const auto& [name, value] : header.extra) {
    writer.write_string_attribute(name.c_str(), value);
    extra_names += (extra_names.empty() ? "" : "\n") + name;
  }
  if (!header.extra.empty()) writer.write_string_attribute(kExtraAttributesName, extra_names);

  Handle probe_group = writer.create_group(kProbesGroup);
  writer.write_columns(probe_group.get(), kProbesGroup, probes, kProbeIntegerColumns);
  writer.write_columns(probe_group.get(), kProbesGroup, probes, kProbeRealColumns);
  writer.write_columns(probe_group.get(), kProbesGroup, probes, kProbeTextColumns);

  Handle step_group = writer.create_group(kStepsGroup);
  writer.write_columns(step_group.get(), kStepsGroup, steps, kStepIntegerColumns);
  writer.write_columns(step_group.get(), kStepsGroup, steps, kStepRealColumns);
}

// --- Reading -------------------------------------------------------------

// Reads a verified file image. Every attribute is opened by name, checked to
// be one value of the expected class before it is read; every column is
// checked for rank, type, filters and size before a byte of it is decoded.
class TraceFileReader {
 public:
  TraceFileReader(std::string path, hid_t file, size_t file_size)
      : path_(std::move(path)), file_(file), file_size_(file_size) {}

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    const std::string detail = take_hdf5_error();
    throw InputError(path_, key, what + (detail.empty() ? "" : " (HDF5: " + detail + ")"));
  }

  bool has_attribute(const char* name) const { return H5Aexists(file_, name) > 0; }

  std::string read_string_attribute(const char* name) const {
    const Handle attribute = open_scalar_attribute(name);
    Handle type(H5Aget_type(attribute.get()), H5Tclose);
    if (type.get() < 0) fail(name, "unreadable attribute");
    if (H5Tget_class(type.get()) != H5T_STRING) fail(name, "attribute is not a string");
    if (H5Tis_variable_str(type.get()) > 0) {  // as h5py writes a Python str
      Handle memory_type(H5Tcopy(H5T_C_S1), H5Tclose);
      if (memory_type.get() < 0 || H5Tset_size(memory_type.get(), H5T_VARIABLE) < 0) {
        fail(name, "cannot build a string type");
      }
      char* text = nullptr;
      if (H5Aread(attribute.get(), memory_type.get(), &text) < 0) fail(name, "unreadable attribute");
      std::string value = text != nullptr ? std::string(text, strnlen(text, kMaxStringWidth)) : "";
      H5free_memory(text);
      return value;
    }
    const size_t width = H5Tget_size(type.get());
    if (width == 0 || width > kMaxStringWidth) fail(name, "attribute has an implausible width");
    Handle memory_type = string_memory_type(width);
    std::vector<char> buffer(width, '\0');
    if (H5Aread(attribute.get(), memory_type.get(), buffer.data()) < 0) fail(name, "unreadable attribute");
    return std::string(buffer.data(), strnlen(buffer.data(), width));
  }

  int64_t read_integer_attribute(const char* name) const {
    const Handle attribute = open_scalar_attribute(name);
    Handle type(H5Aget_type(attribute.get()), H5Tclose);
    if (type.get() < 0) fail(name, "unreadable attribute");
    if (H5Tget_class(type.get()) != H5T_INTEGER) fail(name, "attribute is not an integer");
    int64_t value = 0;
    if (H5Aread(attribute.get(), H5T_NATIVE_INT64, &value) < 0) fail(name, "unreadable attribute");
    return value;
  }

  // TraceHeader::extra, by the names the writer listed.
  std::map<std::string, std::string> read_extra_attributes() const {
    std::map<std::string, std::string> extra;
    if (!has_attribute(kExtraAttributesName)) return extra;
    std::istringstream names(read_string_attribute(kExtraAttributesName));
    for (std::string name; std::getline(names, name);) {
      if (name.empty() || reserved_attribute_names().count(name) != 0) {
        fail(kExtraAttributesName, "lists the invalid name '" + name + "'");
      }
      extra[name] = read_string_attribute(name.c_str());
    }
    return extra;
  }

  // Opens /group/name as a 1-D dataset; its length must equal `expected`
  // (pass -1 to accept any and learn it).
  Handle open_column(const std::string& group, const char* name, int64_t& expected) const {
    const std::string key = "/" + group + "/" + name;
    if (H5Lexists(file_, group.c_str(), H5P_DEFAULT) <= 0 ||
        H5Lexists(file_, key.c_str(), H5P_DEFAULT) <= 0) {
      fail(key, "missing dataset; " + regenerate_hint());
    }
    Handle dataset(H5Dopen2(file_, key.c_str(), H5P_DEFAULT), H5Dclose);
    if (dataset.get() < 0) fail(key, "expected a readable dataset");
    Handle space(H5Dget_space(dataset.get()), H5Sclose);
    hsize_t dims[1] = {0};
    if (space.get() < 0 || H5Sget_simple_extent_type(space.get()) != H5S_SIMPLE ||
        H5Sget_simple_extent_ndims(space.get()) != 1 ||
        H5Sget_simple_extent_dims(space.get(), dims, nullptr) != 1) {
      fail(key, "expected a 1-D dataset");
    }
    if (expected >= 0 && dims[0] != static_cast<hsize_t>(expected)) {
      fail(key, "has " + std::to_string(dims[0]) + " rows, other columns have " + std::to_string(expected));
    }
    require_known_filters(dataset, key);
    require_small_chunks(dataset, key);
    // Every row of a table costs at least `row_bytes` decoded bytes over its
    // columns: more rows than the file's size allows cannot be real, and are
    // refused before rows are allocated for them.
    const uint64_t row_bytes = group == kProbesGroup ? kMinProbeRowBytes : kMinStepRowBytes;
    if (dims[0] > file_size_ * kMaxExpansion / row_bytes) {
      fail(key, "claims " + std::to_string(dims[0]) + " rows, more than a file of " + std::to_string(file_size_) +
                    " bytes can hold");
    }
    expected = static_cast<int64_t>(dims[0]);
    return dataset;
  }

  template <class Row, size_t N>
  void read_columns(const std::string& group, std::vector<Row>& rows,
                    const IntegerColumn<Row> (&columns)[N]) const {
    std::vector<int64_t> values(rows.size());
    for (const IntegerColumn<Row>& column : columns) {
      int64_t length = int64_t(rows.size());
      Handle dataset = open_column(group, column.name, length);
      require_type(dataset, group, column.name, file_type(column.storage));
      read_all(dataset, group, column.name, H5T_NATIVE_INT64, values.data(), rows.size());
      for (size_t i = 0; i < rows.size(); ++i) column.set(rows[i], values[i]);
    }
  }

  template <class Row, size_t N>
  void read_columns(const std::string& group, std::vector<Row>& rows,
                    const RealColumn<Row> (&columns)[N]) const {
    std::vector<double> values(rows.size());
    for (const RealColumn<Row>& column : columns) {
      int64_t length = int64_t(rows.size());
      Handle dataset = open_column(group, column.name, length);
      require_type(dataset, group, column.name, H5T_IEEE_F64LE);
      read_all(dataset, group, column.name, H5T_NATIVE_DOUBLE, values.data(), rows.size());
      for (size_t i = 0; i < rows.size(); ++i) column.set(rows[i], values[i]);
    }
  }

  template <class Row, size_t N>
  void read_columns(const std::string& group, std::vector<Row>& rows,
                    const TextColumn<Row> (&columns)[N]) const {
    for (const TextColumn<Row>& column : columns) {
      const std::string key = "/" + group + "/" + column.name;
      int64_t length = int64_t(rows.size());
      Handle dataset = open_column(group, column.name, length);
      Handle type(H5Dget_type(dataset.get()), H5Tclose);
      if (type.get() < 0 || H5Tget_class(type.get()) != H5T_STRING || H5Tis_variable_str(type.get()) != 0) {
        fail(key, "expected a fixed-length string dataset");
      }
      const size_t width = H5Tget_size(type.get());
      if (width == 0 || width > kMaxStringWidth ||
          static_cast<uint64_t>(width) * rows.size() > file_size_ * kMaxExpansion) {
        fail(key, "has an implausible string width " + std::to_string(width));
      }
      Handle memory_type = string_memory_type(width);
      std::vector<char> packed(rows.size() * width + 1, '\0');
      read_all(dataset, group, column.name, memory_type.get(), packed.data(), rows.size());
      for (size_t i = 0; i < rows.size(); ++i) {
        const char* text = packed.data() + i * width;
        const std::string value(text, strnlen(text, width));
        if (!column.set(rows[i], value)) {
          fail(key, "row " + std::to_string(i) + ": invalid value '" + value + "'");
        }
      }
    }
  }

  static std::string regenerate_hint() {
    return "the file is not a complete nanreplay trace; regenerate it with `nanreplay run`";
  }

 private:
  // One value of any type: reading a larger dataspace into one value's buffer would overrun it.
  Handle open_scalar_attribute(const char* name) const {
    if (!has_attribute(name)) fail(name, "missing root attribute; " + regenerate_hint());
    Handle attribute(H5Aopen(file_, name, H5P_DEFAULT), H5Aclose);
    if (attribute.get() < 0) fail(name, "unreadable attribute");
    Handle space(H5Aget_space(attribute.get()), H5Sclose);
    if (space.get() < 0 || H5Sget_simple_extent_npoints(space.get()) != 1) {
      fail(name, "expected a single value");
    }
    return attribute;
  }

  Handle string_memory_type(size_t width) const {
    Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
    if (type.get() < 0 || H5Tset_size(type.get(), std::max<size_t>(width, 1)) < 0 ||
        H5Tset_strpad(type.get(), H5T_STR_NULLPAD) < 0) {
      fail("", "cannot build a string type");
    }
    return type;
  }

  // Exactly the stored type the writer uses: no conversion from exotic types.
  void require_type(const Handle& dataset, const std::string& group, const char* name, hid_t wanted) const {
    Handle type(H5Dget_type(dataset.get()), H5Tclose);
    if (type.get() < 0 || H5Tequal(type.get(), wanted) <= 0) {
      fail("/" + group + "/" + name, "expected the column type nanreplay writes (see docs/trace-format.md)");
    }
  }

  // A chunk is decompressed whole: its size is bounded like everything else.
  void require_small_chunks(const Handle& dataset, const std::string& key) const {
    Handle properties(H5Dget_create_plist(dataset.get()), H5Pclose);
    if (properties.get() < 0) fail(key, "unreadable dataset properties");
    if (H5Pget_layout(properties.get()) != H5D_CHUNKED) return;
    hsize_t chunk[1] = {0};
    Handle type(H5Dget_type(dataset.get()), H5Tclose);
    const size_t element = type.get() >= 0 ? H5Tget_size(type.get()) : 0;
    if (H5Pget_chunk(properties.get(), 1, chunk) != 1 || element == 0 || chunk[0] == 0 ||
        chunk[0] > kMaxChunkBytes / element) {
      fail(key, "has a chunk layout nanreplay never writes");
    }
  }

  // Only the filters the writer uses (shuffle, deflate), both built into HDF5.
  void require_known_filters(const Handle& dataset, const std::string& key) const {
    Handle properties(H5Dget_create_plist(dataset.get()), H5Pclose);
    if (properties.get() < 0) fail(key, "unreadable dataset properties");
    const int count = H5Pget_nfilters(properties.get());
    if (count < 0) fail(key, "unreadable dataset filters");
    for (int i = 0; i < count; ++i) {
      unsigned flags = 0;
      size_t values = 0;
      unsigned config = 0;
      const H5Z_filter_t filter =
          H5Pget_filter2(properties.get(), static_cast<unsigned>(i), &flags, &values, nullptr, 0, nullptr, &config);
      if (filter != H5Z_FILTER_DEFLATE && filter != H5Z_FILTER_SHUFFLE) {
        fail(key, "uses HDF5 filter " + std::to_string(filter) + ", which nanreplay never writes");
      }
    }
  }

  void read_all(const Handle& dataset, const std::string& group, const char* name,
                hid_t memory_type, void* out, size_t length) const {
    if (length == 0) return;
    if (H5Dread(dataset.get(), memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out) < 0) {
      fail("/" + group + "/" + name, "unreadable dataset");
    }
  }

  std::string path_;
  hid_t file_;
  uint64_t file_size_;
};

TraceContents read_trace_file(const TraceFileReader& reader) {
  const std::string format = reader.read_string_attribute("format");
  if (format != kFormatName) {
    reader.fail("format",
                "is '" + format + "', expected '" + kFormatName + "': not a nanreplay trace");
  }
  const int64_t version = reader.read_integer_attribute("format_version");
  if (version != kFormatVersion) {
    reader.fail("format_version",
                "is " + std::to_string(version) + "; this nanreplay reads " +
                    std::to_string(kFormatVersion) +
                    " (regenerate the trace with this version's `nanreplay run`)");
  }
  TraceContents contents;
  for (const HeaderAttribute& attribute : kHeaderAttributes) {
    contents.header.*attribute.field = reader.read_string_attribute(attribute.name);
  }
  contents.header.extra = reader.read_extra_attributes();

  int64_t probe_count = -1;
  reader.open_column(kProbesGroup, kProbeIntegerColumns[0].name, probe_count);
  contents.probes.resize(size_t(probe_count));
  reader.read_columns(kProbesGroup, contents.probes, kProbeIntegerColumns);
  reader.read_columns(kProbesGroup, contents.probes, kProbeRealColumns);
  reader.read_columns(kProbesGroup, contents.probes, kProbeTextColumns);

  int64_t step_count = -1;
  reader.open_column(kStepsGroup, kStepIntegerColumns[0].name, step_count);
  contents.steps.resize(size_t(step_count));
  reader.read_columns(kStepsGroup, contents.steps, kStepIntegerColumns);
  reader.read_columns(kStepsGroup, contents.steps, kStepRealColumns);
  return contents;
}

// --- Files ---------------------------------------------------------------

// HDF5's core driver on the caller's buffer, read-only and without a copy:
// the file image callbacks hand HDF5 the buffer itself wherever it would copy
// it, and never free it (what H5LTopen_file_image does, without the HL
// library and its per-call leak in HDF5 1.10). HDF5 parses exactly the bytes
// that were verified.
struct BorrowedImage {
  const uint8_t* bytes;
  size_t size;
};

void* borrowed_malloc(size_t size, H5FD_file_image_op_t, void* image) {
  auto* borrowed = static_cast<BorrowedImage*>(image);
  return size == borrowed->size ? const_cast<uint8_t*>(borrowed->bytes) : nullptr;
}
void* borrowed_memcpy(void* dest, const void* src, size_t size, H5FD_file_image_op_t, void* image) {
  const auto* borrowed = static_cast<const BorrowedImage*>(image);
  // Every copy HDF5 asks for is of the buffer onto itself.
  return dest == borrowed->bytes && src == borrowed->bytes && size == borrowed->size ? dest : nullptr;
}
void* borrowed_realloc(void*, size_t, H5FD_file_image_op_t, void*) { return nullptr; }  // read-only
herr_t borrowed_free(void*, H5FD_file_image_op_t, void*) { return 0; }
void* borrowed_udata_copy(void* image) { return image; }
herr_t borrowed_udata_free(void*) { return 0; }

Handle open_borrowed_image(BorrowedImage& image) {
  Handle access(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  H5FD_file_image_callbacks_t callbacks = {borrowed_malloc, borrowed_memcpy, borrowed_realloc, borrowed_free,
                                           borrowed_udata_copy, borrowed_udata_free, &image};
  if (access.get() < 0 || H5Pset_fapl_core(access.get(), kImageIncrement, /*backing_store=*/false) < 0 ||
      H5Pset_fclose_degree(access.get(), H5F_CLOSE_STRONG) < 0 ||
      H5Pset_file_image_callbacks(access.get(), &callbacks) < 0 ||
      H5Pset_file_image(access.get(), const_cast<uint8_t*>(image.bytes), image.size) < 0) {
    return Handle();
  }
  static std::atomic<unsigned> images{0};
  const std::string name = "nanreplay-trace-read-" + std::to_string(images++);
  return Handle(H5Fopen(name.c_str(), H5F_ACC_RDONLY, access.get()), H5Fclose);
}


// The whole file in memory (HDF5's core driver, nothing on disk), with room
// for the integrity block before it. HDF5 1.10 returns the image from its base
// address, after the userblock; a version that includes the userblock is
// recognised by where the signature lies.
std::vector<uint8_t> build_trace_image(const std::string& label, const TraceHeader& header,
                                       const std::vector<ProbeRecord>& probes,
                                       const std::vector<TraceStepRow>& steps) {
  Handle access = checked(H5Pcreate(H5P_FILE_ACCESS), H5Pclose, label, "file access list");
  checked(H5Pset_fapl_core(access.get(), kImageIncrement, /*backing_store=*/false), label, "file access list");
  // Closing the file closes whatever is still open in it: no error path leaves it held.
  checked(H5Pset_fclose_degree(access.get(), H5F_CLOSE_STRONG), label, "file access list");
  Handle creation = checked(H5Pcreate(H5P_FILE_CREATE), H5Pclose, label, "file creation list");
  checked(H5Pset_userblock(creation.get(), kTraceIntegrityBlockBytes), label, "file creation list");
  static std::atomic<unsigned> images{0};
  const std::string name = "nanreplay-trace-image-" + std::to_string(images++);
  Handle file = checked(H5Fcreate(name.c_str(), H5F_ACC_TRUNC, creation.get(), access.get()), H5Fclose, label,
                        "creating the file in memory");
  write_trace_file(label, file.get(), header, probes, steps);
  checked(H5Fflush(file.get(), H5F_SCOPE_GLOBAL), label, "flushing the file");
  const ssize_t size = H5Fget_file_image(file.get(), nullptr, 0);
  if (size <= 0) fail_write(label, "reading back the file image");
  std::vector<uint8_t> image(kTraceIntegrityBlockBytes + static_cast<size_t>(size));
  if (H5Fget_file_image(file.get(), image.data() + kTraceIntegrityBlockBytes, static_cast<size_t>(size)) != size) {
    fail_write(label, "reading back the file image");
  }
  if (!file.close()) fail_write(label, "closing the file");
  static const uint8_t kSignature[8] = {0x89, 'H', 'D', 'F', '\r', '\n', 0x1a, '\n'};
  const auto signature_at = [&](size_t offset) {
    return image.size() >= offset + 8 && std::memcmp(image.data() + offset, kSignature, 8) == 0;
  };
  if (!signature_at(kTraceIntegrityBlockBytes)) {
    if (!signature_at(2 * kTraceIntegrityBlockBytes)) fail_write(label, "unexpected file image layout");
    image.erase(image.begin(), image.begin() + kTraceIntegrityBlockBytes);  // it held the userblock
  }
  seal_trace_image(image);
  return image;
}

// Writes `bytes` under a temporary name beside `path`, flushed to disk, and
// renames it into place: `path` is whole or absent. OutputError on failure.
void write_file_whole(const std::string& path, const std::string& label, const std::vector<uint8_t>& bytes) {
  std::string temporary = path + ".tmp-XXXXXX";
  const int fd = ::mkstemp(temporary.data());
  if (fd < 0) throw OutputError(label, "cannot write trace: " + errno_text());
  const auto fail = [&](const std::string& reason) {
    ::close(fd);
    ::unlink(temporary.c_str());
    throw OutputError(label, "cannot write trace: " + reason);
  };
  if (::fchmod(fd, 0644) != 0) fail(errno_text());
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(n < 0 ? errno_text() : "nothing written");
    written += static_cast<size_t>(n);
  }
  // A full disk or a quota often shows only here (delayed allocation, NFS).
  if (::fsync(fd) != 0) fail(errno_text());
  if (::close(fd) != 0) {
    const std::string reason = errno_text();
    ::unlink(temporary.c_str());
    throw OutputError(label, "cannot write trace: " + reason);
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    const std::string reason = errno_text();
    ::unlink(temporary.c_str());
    throw OutputError(label, "cannot write trace: renaming " + temporary + " into place failed: " + reason);
  }
}

// A regular file, read whole. O_NONBLOCK: opening a FIFO must not wait for a writer.
std::vector<uint8_t> read_regular_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw InputError(path, "", "cannot open trace: " + errno_text());
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat info {};
  if (::fstat(fd, &info) != 0) throw InputError(path, "", "cannot open trace: " + errno_text());
  if (S_ISDIR(info.st_mode)) throw InputError(path, "", "is a directory; expected a trace.h5 written by `nanreplay run`");
  if (!S_ISREG(info.st_mode)) {
    throw InputError(path, "", "is not a regular file (a FIFO, socket or device); expected a trace.h5 written by "
                               "`nanreplay run`");
  }
  std::vector<uint8_t> bytes;
  try {
    bytes.resize(static_cast<size_t>(info.st_size));
  } catch (const std::bad_alloc&) {
    throw InputError(path, "", "is " + std::to_string(info.st_size) + " bytes, too large to read into memory");
  }
  size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t n = ::read(fd, bytes.data() + got, bytes.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw InputError(path, "", "cannot read trace: " + errno_text());
    if (n == 0) throw InputError(path, "", "changed while being read (it shrank)");
    got += static_cast<size_t>(n);
  }
  return bytes;
}

}  // namespace

void write_trace(const std::string& path, const TraceHeader& header, const std::vector<ProbeRecord>& probes,
                 const std::vector<TraceStepRow>& steps, const std::string& label) {
  for (const auto& entry : header.extra) {
    if (reserved_attribute_names().count(entry.first) != 0 || entry.first.empty() ||
        entry.first.find('\n') != std::string::npos) {
      throw std::invalid_argument("write_trace: extra attribute name '" + entry.first + "' is reserved or invalid");
    }
  }
  silence_hdf5();
  const std::string shown = label.empty() ? path : label;
  write_file_whole(path, shown, build_trace_image(shown, header, probes, steps));
}

TraceContents read_trace_image(const uint8_t* bytes, size_t size, const std::string& label) {
  verify_trace_image(bytes, size, label);
  silence_hdf5();
  BorrowedImage image{bytes, size};
  Handle file = open_borrowed_image(image);
  if (file.get() < 0) {
    const std::string detail = take_hdf5_error();
    throw InputError(label, "",
                     "not an HDF5 file (or a damaged one); expected a trace.h5 written by `nanreplay run`" +
                         (detail.empty() ? "" : " (HDF5: " + detail + ")"));
  }
  return read_trace_file(TraceFileReader(label, file.get(), size));
}

TraceContents read_trace(const std::string& path) {
  const std::vector<uint8_t> bytes = read_regular_file(path);
  return read_trace_image(bytes.data(), bytes.size(), path);
}

}  // namespace nanreplay
