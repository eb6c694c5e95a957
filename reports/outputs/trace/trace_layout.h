// The layout of trace.h5 as both sides of it see it: the format's names,
// every column once (the tables drive the writer and the reader), HDF5
// handles that close themselves and errors that name the file. Internal to
// reports/outputs/trace/trace_writer.cpp and reports/outputs/trace/trace_reader.cpp.
#pragma once

#include <hdf5.h>

#include <cerrno>
#include <cstring>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "loaders/base/message_text.h"
#include "reports/outputs/trace/trace_writer.h"

namespace nanreplay::trace_layout {

constexpr const char* kFormatName = "nanreplay.trace";
constexpr int kFormatVersion = 1;
constexpr const char* kProbesGroup = "probes";
constexpr const char* kStepsGroup = "steps";
// Lists the names of TraceHeader::extra (newline-separated), so the reader
// opens attributes by name and never iterates over a file's attributes.
constexpr const char* kExtraAttributesName = "extra_attributes";
// HDF5's core driver (the reader's) grows the in-memory file by this much at a time.
constexpr size_t kImageIncrement = size_t{1} << 20;
// No column may claim more decoded bytes than this many times the file's size
// (deflate's best ratio is about 1032:1): a dataset with no storage but a
// huge shape cannot make the reader allocate memory it would never fill.
constexpr uint64_t kMaxExpansion = 1100;
// Widest string column or attribute the reader accepts.
constexpr size_t kMaxStringWidth = size_t{1} << 20;
// Largest chunk the reader lets HDF5 decompress (the writer's are at most kChunkBytes).
constexpr uint64_t kMaxChunkBytes = uint64_t{1} << 22;
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
inline void silence_hdf5() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }

// The innermost message on HDF5's error stack (the most specific one), then
// clears the stack. Only its "error message = '...'" part when it has one (a
// system error); one line either way.
inline std::string take_hdf5_error() {
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


// Writer-side HDF5 failures (I/O errors are latched by the file driver and
// reported apart): std::runtime_error naming the file and the step.
[[noreturn]] inline void fail_write(const std::string& path, const std::string& what) {
  const std::string detail = take_hdf5_error();
  throw std::runtime_error("cannot write trace " + path + ": " + what +
                           (detail.empty() ? "" : " (HDF5: " + detail + ")"));
}

inline Handle checked(hid_t id, Handle::Closer closer, const std::string& path, const std::string& what) {
  if (id < 0) fail_write(path, what);
  return Handle(id, closer);
}

inline void checked(herr_t status, const std::string& path, const std::string& what) {
  if (status < 0) fail_write(path, what);
}


// --- The column tables ---------------------------------------------------

enum class Storage { kI32, kI64, kU8, kF64 };

inline hid_t file_type(Storage storage) {
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
  // Added after the format's first release: a file without it reads as -1.
  bool optional = false;
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
  // Least stored width in bytes. A streamed column's width is fixed by its
  // first rows (at least this): a longer value later is refused by the writer.
  size_t width;
  std::string (*get)(const Row&);
  bool (*set)(Row&, const std::string&);  // false: not a valid value
};

inline std::string join_dims(const std::vector<int64_t>& dims) {
  std::string text;
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? "x" : "") + std::to_string(dims[i]);
  return text;
}

inline bool split_dims(const std::string& text, std::vector<int64_t>& dims) {
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

inline bool parse_phase(const std::string& text, Phase& phase) {
  for (Phase candidate : {Phase::kForward, Phase::kBackward, Phase::kGrad}) {
    if (text == phase_name(candidate)) {
      phase = candidate;
      return true;
    }
  }
  return false;
}

inline bool parse_kind(const std::string& text, NonfiniteKind& kind) {
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
    // Mixture-of-experts models (absent from older files).
    {"expert", Storage::kI32, [](const Probe& r) -> int64_t { return r.expert; },
     [](Probe& r, int64_t v) { r.expert = int(v); }, true},
    {"first_expert", Storage::kI32, [](const Probe& r) -> int64_t { return r.first_expert; },
     [](Probe& r, int64_t v) { r.first_expert = int(v); }, true},
    {"routed_tokens", Storage::kI64, [](const Probe& r) -> int64_t { return r.routed_tokens; },
     [](Probe& r, int64_t v) { r.routed_tokens = v; }, true},
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
    {"phase", 16, [](const Probe& r) -> std::string { return phase_name(r.phase); },
     [](Probe& r, const std::string& v) { return parse_phase(v, r.phase); }},
    // After "phase": a parameter's key for phase grad, a site's name otherwise.
    {"site", 256, [](const Probe& r) { return probe_name(r); },
     [](Probe& r, const std::string& v) {
       if (r.phase == Phase::kGrad) {
         r.param = v;
         return true;
       }
       const std::optional<SiteRef> site = parse_site_name(v);
       if (site) r.site = *site;
       return site.has_value();
     }},
    {"first_kind", 16,
     [](const Probe& r) -> std::string { return nonfinite_kind_name(r.stats.first_kind); },
     [](Probe& r, const std::string& v) { return parse_kind(v, r.stats.first_kind); }},
    {"shape", 192, [](const Probe& r) { return join_dims(r.shape); },
     [](Probe& r, const std::string& v) { return split_dims(v, r.shape); }},
    {"first_index", 192, [](const Probe& r) { return join_dims(r.first_index); },
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
// The optional columns are left out: a file may lack them.
constexpr uint64_t kMinProbeRowBytes = 8 * 8 + 6 * 4 + 5 * 8 + 5 * 1;  // i64, i32, f64 and string columns
constexpr uint64_t kMinStepRowBytes = 8 + 1 + 3 * 8;
static_assert(sizeof(kProbeIntegerColumns) / sizeof(kProbeIntegerColumns[0]) == 14 + 3, "update kMinProbeRowBytes");
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
inline const std::set<std::string>& reserved_attribute_names() {
  static const std::set<std::string> names = {"format",    "format_version", "created_utc",
                                              "bundle",    "tool_version",   "precision",
                                              "arch",      kExtraAttributesName};
  return names;
}

}  // namespace nanreplay::trace_layout
