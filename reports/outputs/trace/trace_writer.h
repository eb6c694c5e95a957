// trace.h5: every probe of every step and phase as one columnar table,
// plus the per-step summary. The layout (version 1) is documented in
// docs/trace-format.md and summarised here:
//
//   bytes 0-511       integrity block (an HDF5 userblock): length and SHA-256
//                     of the rest of the file (reports/outputs/trace/trace_integrity.h)
//   /                 attrs: format="nanreplay.trace", format_version=1,
//                            bundle, tool_version, precision, arch, created_utc,
//                            extra_attributes (names of the extra ones, when any)
//   /probes/<column>  1-D datasets of equal length N, one row per probe:
//                     step i64, micro_batch i32, rank i32, phase (string),
//                     order i32, site (string), layer i32, head i32,
//                     count, finite_count, nan_count, inf_count i64,
//                     max_abs, min_nonzero_abs, mean, rms, headroom_bits f64,
//                     first_nonfinite i64, first_kind (string),
//                     sample i64, position i64, first_head i32, shape (string "2x64x128"),
//                     first_index (string "0x3x17x5": coordinates of first_nonfinite,
//                     empty when none)
//   /steps/<column>   step i64, loss f64, logged_loss f64 (NaN when absent),
//                     grad_norm f64, finite u8
//
// Strings are fixed-length, null-padded ASCII. -1 marks "not applicable".
// Columns are chunked, extendible and compressed (shuffle + deflate): the
// records of each step are appended as the step ends (TraceStream), so a
// replay holds one step's records however long the window.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "probes/probe_record.h"

namespace nanreplay {

struct TraceStepRow {
  int64_t step = 0;
  double loss = 0.0;
  double logged_loss = 0.0;  // NaN when the job logged none
  double grad_norm = 0.0;
  bool finite = true;
};

struct TraceHeader {
  std::string bundle;
  std::string tool_version;
  std::string precision;
  std::string arch;
  std::map<std::string, std::string> extra;  // further string attributes
};

// trace.h5 written as the replay goes: append() each step's records, then
// finish() with the header and the step rows, which seals the file (its
// integrity block). Until finish() returns, the file at `path` is incomplete,
// and it is removed when the stream is destroyed unfinished. An I/O failure
// (a full disk, a read-only file system, a missing directory) is OutputError
// naming `label` (default: `path`), from the call that met it or the next
// one; an HDF5 failure std::runtime_error. Never prints.
class TraceStream {
 public:
  explicit TraceStream(std::string path, std::string label = "");
  ~TraceStream();
  TraceStream(const TraceStream&) = delete;
  TraceStream& operator=(const TraceStream&) = delete;

  void append(const std::vector<ProbeRecord>& records);
  void finish(const TraceHeader& header, const std::vector<TraceStepRow>& steps);
  uint64_t records_written() const;

 private:
  struct File;
  template <class Work>
  void guarded(Work&& work);

  std::unique_ptr<File> file_;
  std::string path_;
  std::string label_;
  bool finished_ = false;
};

// The whole trace at once, under a temporary name renamed into place: `path`
// is whole or absent. Throws OutputError naming `label` (default: `path`) when the file cannot be
// written (a full disk, a read-only file system, a directory in the way), and
// std::runtime_error on an HDF5 failure; no partial file is left either way.
void write_trace(const std::string& path, const TraceHeader& header, const std::vector<ProbeRecord>& probes,
                 const std::vector<TraceStepRow>& steps, const std::string& label = "");

// Reads a trace back (for `nanreplay trace` and tests). Throws InputError on
// a bad file: not a regular file (a FIFO or a device: refused without
// blocking), a missing or mismatching integrity block (truncated, corrupted),
// or contents that are not this layout.
struct TraceContents {
  TraceHeader header;
  std::vector<ProbeRecord> probes;
  std::vector<TraceStepRow> steps;
};
TraceContents read_trace(const std::string& path);
// The same for a file already in memory (the fuzz target); `label` names it.
TraceContents read_trace_image(const uint8_t* bytes, size_t size, const std::string& label);

}  // namespace nanreplay
