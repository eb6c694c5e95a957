// An HDF5 file driver for trace.h5 written on disk as a replay goes. HDF5
// handles a failing write badly: it leaves a half-flushed file open and
// crashes in its own shutdown (SIGSEGV on a full disk). So this driver never
// lets a write fail inside HDF5: the first error (ENOSPC, EIO, EDQUOT, a
// failed fsync) is latched, every later write is dropped, and HDF5 carries on
// unaware until the writer reads the latch, abandons the file and reports the
// error itself. Plain POSIX pread/pwrite otherwise, like HDF5's sec2 driver.
#pragma once

#include <hdf5.h>

#include <string>

namespace nanreplay {

// The first failure on a file opened through the driver.
struct TraceFileLatch {
  int error_number = 0;  // errno of the first failure; 0 while none
  std::string during;    // "writing", "reading", "flushing to disk", ...
  // errno of the last failed open, kept apart: HDF5 probes for an existing
  // file before it creates one, and that probe failing is normal.
  int open_error_number = 0;
  bool failed() const { return error_number != 0; }
  std::string text() const;  // "No space left on device (while writing)"
};

// A file access property list that opens files through the driver, with
// failures latched in `latch` (which must outlive every file opened with it).
// std::runtime_error if HDF5 refuses the driver.
hid_t latching_file_access(TraceFileLatch& latch);

}  // namespace nanreplay
