// Writes and reads trace.h5 (layout in trace_writer.h and docs/trace-format.md)
// with the HDF5 C API. Every column is named once, in the tables below, which
// drive both the writer and the reader. The file appears under its final name
// only when complete; HDF5 never prints: its errors become exceptions. Serial
// HDF5 is not thread-safe: one write_trace/read_trace at a time per process.
#include "reports/trace_writer.h"

#include <hdf5.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <set>
#include <stdexcept>
#include <utility>

#include "loaders/error.h"

namespace nanreplay {
namespace {

constexpr const char* kFormatName = "nanreplay.trace";
constexpr int kFormatVersion = 1;
constexpr const char* kProbesGroup = "probes";
constexpr const char* kStepsGroup = "steps";
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

// Switches HDF5's automatic error-stack printing off for one call of ours and
// restores whatever the application had: the library itself never prints.
class QuietHdf5Errors {
 public:
  QuietHdf5Errors() {
    H5Eget_auto2(H5E_DEFAULT, &saved_func_, &saved_data_);
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  }
  ~QuietHdf5Errors() { H5Eset_auto2(H5E_DEFAULT, saved_func_, saved_data_); }
  QuietHdf5Errors(const QuietHdf5Errors&) = delete;
  QuietHdf5Errors& operator=(const QuietHdf5Errors&) = delete;

 private:
  H5E_auto2_t saved_func_ = nullptr;
  void* saved_data_ = nullptr;
};

// The innermost message on HDF5's error stack (the most specific one, e.g.
// "unable to open file: ... errno = 2"), then clears the stack.
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
  return detail;
}

// Writer-side failures: std::runtime_error naming the file and the step.
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

// File access properties shared by the writer and the reader. Traces often
// live on network file systems without flock(): keep HDF5's file locking
// where it works and carry on without it where the file system refuses it.
Handle file_access_properties() {
  Handle properties(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
#if (H5_VERS_MAJOR == 1 && H5_VERS_MINOR == 10 && H5_VERS_RELEASE >= 7) || \
    (H5_VERS_MAJOR == 1 && H5_VERS_MINOR == 12 && H5_VERS_RELEASE >= 1) || H5_VERSION_GE(1, 13, 0)
  if (properties.get() >= 0) H5Pset_file_locking(properties.get(), true, true);
#endif
  return properties;
}

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
    dims.push_back(std::stoll(part));
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
    {"site", [](const Probe& r) { return r.site; },
     [](Probe& r, const std::string& v) {
       r.site = v;
       return true;
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
  static const std::set<std::string> names = {
      "format", "format_version", "created_utc", "bundle", "tool_version", "precision", "arch"};
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
  for (const auto& [name, value] : header.extra) writer.write_string_attribute(name.c_str(), value);

  Handle probe_group = writer.create_group(kProbesGroup);
  writer.write_columns(probe_group.get(), kProbesGroup, probes, kProbeIntegerColumns);
  writer.write_columns(probe_group.get(), kProbesGroup, probes, kProbeRealColumns);
  writer.write_columns(probe_group.get(), kProbesGroup, probes, kProbeTextColumns);

  Handle step_group = writer.create_group(kStepsGroup);
  writer.write_columns(step_group.get(), kStepsGroup, steps, kStepIntegerColumns);
  writer.write_columns(step_group.get(), kStepsGroup, steps, kStepRealColumns);
}

// --- Reading -------------------------------------------------------------

class TraceFileReader {
 public:
  TraceFileReader(std::string path, hid_t file) : path_(std::move(path)), file_(file) {}

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    const std::string detail = take_hdf5_error();
    throw InputError(path_, key, what + (detail.empty() ? "" : " (HDF5: " + detail + ")"));
  }

  bool has_attribute(const char* name) const { return H5Aexists(file_, name) > 0; }

  std::string read_string_attribute(const char* name) const {
    if (!has_attribute(name)) fail(name, "missing root attribute; " + regenerate_hint());
    Handle attribute(H5Aopen(file_, name, H5P_DEFAULT), H5Aclose);
    Handle type(H5Aget_type(attribute.get()), H5Tclose);
    if (attribute.get() < 0 || type.get() < 0) fail(name, "unreadable attribute");
    if (H5Tget_class(type.get()) != H5T_STRING) fail(name, "attribute is not a string");
    if (H5Tis_variable_str(type.get()) > 0) {  // as h5py writes a Python str
      Handle memory_type(H5Tcopy(H5T_C_S1), H5Tclose);
      H5Tset_size(memory_type.get(), H5T_VARIABLE);
      char* text = nullptr;
      if (H5Aread(attribute.get(), memory_type.get(), &text) < 0) {
        fail(name, "unreadable attribute");
      }
      std::string value = text != nullptr ? text : "";
      H5free_memory(text);
      return value;
    }
    const size_t width = H5Tget_size(type.get());
    Handle memory_type = string_memory_type(width);
    std::vector<char> buffer(width, '\0');
    if (H5Aread(attribute.get(), memory_type.get(), buffer.data()) < 0) {
      fail(name, "unreadable attribute");
    }
    return std::string(buffer.data(), strnlen(buffer.data(), width));
  }

  int64_t read_integer_attribute(const char* name) const {
    if (!has_attribute(name)) fail(name, "missing root attribute; " + regenerate_hint());
    Handle attribute(H5Aopen(file_, name, H5P_DEFAULT), H5Aclose);
    Handle type(H5Aget_type(attribute.get()), H5Tclose);
    if (attribute.get() < 0 || type.get() < 0) fail(name, "unreadable attribute");
    if (H5Tget_class(type.get()) != H5T_INTEGER) fail(name, "attribute is not an integer");
    int64_t value = 0;
    if (H5Aread(attribute.get(), H5T_NATIVE_INT64, &value) < 0) fail(name, "unreadable attribute");
    return value;
  }

  // String attributes beyond the reserved ones, for TraceHeader::extra.
  std::map<std::string, std::string> read_extra_attributes() const {
    std::vector<std::string> names;
    H5Aiterate2(
        file_, H5_INDEX_NAME, H5_ITER_INC, nullptr,
        [](hid_t, const char* name, const H5A_info_t*, void* out) -> herr_t {
          static_cast<std::vector<std::string>*>(out)->push_back(name);
          return 0;
        },
        &names);
    std::map<std::string, std::string> extra;
    for (const std::string& name : names) {
      if (reserved_attribute_names().count(name) != 0) continue;
      Handle attribute(H5Aopen(file_, name.c_str(), H5P_DEFAULT), H5Aclose);
      Handle type(H5Aget_type(attribute.get()), H5Tclose);
      if (type.get() >= 0 && H5Tget_class(type.get()) == H5T_STRING) {
        extra[name] = read_string_attribute(name.c_str());
      }
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
    if (dataset.get() < 0) fail(key, "unreadable dataset");
    Handle space(H5Dget_space(dataset.get()), H5Sclose);
    hsize_t dims[1] = {0};
    if (space.get() < 0 || H5Sget_simple_extent_ndims(space.get()) != 1 ||
        H5Sget_simple_extent_dims(space.get(), dims, nullptr) != 1) {
      fail(key, "expected a 1-D dataset");
    }
    if (expected >= 0 && int64_t(dims[0]) != expected) {
      fail(key, "has " + std::to_string(dims[0]) + " rows, other columns have " +
                    std::to_string(expected));
    }
    expected = int64_t(dims[0]);
    return dataset;
  }

  template <class Row, size_t N>
  void read_columns(const std::string& group, std::vector<Row>& rows,
                    const IntegerColumn<Row> (&columns)[N]) const {
    std::vector<int64_t> values(rows.size());
    for (const IntegerColumn<Row>& column : columns) {
      int64_t length = int64_t(rows.size());
      Handle dataset = open_column(group, column.name, length);
      require_class(dataset, group, column.name, H5T_INTEGER, "an integer");
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
      require_class(dataset, group, column.name, H5T_FLOAT, "a floating-point");
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
      if (type.get() < 0 || H5Tget_class(type.get()) != H5T_STRING ||
          H5Tis_variable_str(type.get()) > 0) {
        fail(key, "expected a fixed-length string dataset");
      }
      const size_t width = H5Tget_size(type.get());
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
  Handle string_memory_type(size_t width) const {
    Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
    if (type.get() < 0 || H5Tset_size(type.get(), std::max<size_t>(width, 1)) < 0 ||
        H5Tset_strpad(type.get(), H5T_STR_NULLPAD) < 0) {
      fail("", "cannot build a string type");
    }
    return type;
  }

  void require_class(const Handle& dataset, const std::string& group, const char* name,
                     H5T_class_t wanted, const char* description) const {
    Handle type(H5Dget_type(dataset.get()), H5Tclose);
    if (type.get() < 0 || H5Tget_class(type.get()) != wanted) {
      fail("/" + group + "/" + name, std::string("expected ") + description + " dataset");
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

}  // namespace

void write_trace(const std::string& path, const TraceHeader& header,
                 const std::vector<ProbeRecord>& probes, const std::vector<TraceStepRow>& steps) {
  for (const auto& entry : header.extra) {
    if (reserved_attribute_names().count(entry.first) != 0 || entry.first.empty()) {
      throw std::invalid_argument("write_trace: extra attribute name '" + entry.first +
                                  "' is reserved");
    }
  }
  QuietHdf5Errors quiet;
  const std::string temporary = path + ".tmp-" + std::to_string(::getpid());
  try {
    Handle file_access = file_access_properties();
    if (file_access.get() < 0) fail_write(path, "file access list");
    // Closing the file closes whatever is still open in it, so no error path
    // can leave the temporary file held open (and unremovable on some systems).
    checked(H5Pset_fclose_degree(file_access.get(), H5F_CLOSE_STRONG), path, "file access list");
    Handle file =
        checked(H5Fcreate(temporary.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, file_access.get()),
                H5Fclose, path, "cannot create " + temporary);
    write_trace_file(path, file.get(), header, probes, steps);
    if (!file.close()) fail_write(path, "closing (flushing) the file");
  } catch (...) {
    std::remove(temporary.c_str());
    throw;
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    const std::string reason = std::strerror(errno);
    std::remove(temporary.c_str());
    throw std::runtime_error("cannot write trace " + path + ": renaming " + temporary +
                             " failed: " + reason);
  }
}

TraceContents read_trace(const std::string& path) {
  QuietHdf5Errors quiet;
  if (::access(path.c_str(), R_OK) != 0) {
    throw InputError(path, "", std::string("cannot open trace: ") + std::strerror(errno));
  }
  Handle file_access = file_access_properties();
  Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, file_access.get()), H5Fclose);
  if (file.get() < 0) {
    const std::string detail = take_hdf5_error();
    throw InputError(path, "",
                     "not an HDF5 file (or a damaged one); expected a trace.h5 "
                     "written by `nanreplay run`" +
                         (detail.empty() ? "" : " (HDF5: " + detail + ")"));
  }
  return read_trace_file(TraceFileReader(path, file.get()));
}

}  // namespace nanreplay
