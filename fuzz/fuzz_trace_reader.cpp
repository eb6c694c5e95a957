// libFuzzer target for the trace reader (read_trace_image in
// reports/outputs/trace/trace_writer.cpp, the integrity block in reports/outputs/trace/trace_integrity.cpp),
// seeded with real traces. Each input is read as it is: the integrity block
// must turn any damaged file away before HDF5 parses a byte of it (what CI
// runs). With NANREPLAY_FUZZ_TRACE_RESEAL=1 each input is also read resealed
// (its block recomputed for the mutated bytes, as a deliberate edit would), so
// HDF5's parser and the checks behind a valid block (attributes by name,
// scalar spaces, column types, filters, chunks, sizes, values) are fuzzed too;
// that mode finds bugs inside HDF5 1.10 itself within a minute (a heap
// over-read in H5Aexists on a crafted attribute name). The reader parses in a
// child process (reports/outputs/trace/trace_parse_isolation.h), so such a bug ends in an
// InputError here too; each resealed input then costs a fork (and the child's
// coverage is not fed back), so CI leaves the mode off.
// Key constraint: every read ends in contents or an InputError; anything else
// (a crash, another exception, a leak, a sanitizer report) is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "loaders/base/error.h"
#include "reports/outputs/trace/trace_integrity.h"
#include "reports/outputs/trace/trace_writer.h"

namespace {

void read_once(const uint8_t* data, size_t size) {
  try {
    const nanreplay::TraceContents contents = nanreplay::read_trace_image(data, size, "triage/trace.h5");
    volatile size_t rows = contents.probes.size() + contents.steps.size();
    (void)rows;
  } catch (const nanreplay::InputError&) {
    // The documented outcome for a bad trace.
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool reseal = std::getenv("NANREPLAY_FUZZ_TRACE_RESEAL") != nullptr;
  read_once(data, size);
  if (reseal && size >= nanreplay::kTraceIntegrityBlockBytes) {
    std::vector<uint8_t> resealed(data, data + size);
    nanreplay::seal_trace_image(resealed);
    read_once(resealed.data(), resealed.size());
  }
  return 0;
}
