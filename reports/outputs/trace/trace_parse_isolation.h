// HDF5 1.10's parser is not hardened against crafted files: a trace whose
// integrity block was recomputed after an edit (a forgery the block cannot
// tell from the real thing) can make it read past its own buffers (a heap
// over-read in H5Aexists on a crafted attribute message, found by
// fuzz/fuzz_trace_reader.cpp). So a verified image is parsed in a forked
// child: the parent receives the rows through a pipe, rebuilds them with
// bounds checks, and turns a child that crashed into an InputError naming the
// file. Internal to reports/outputs/trace/trace_reader.cpp.
#pragma once

#include <functional>
#include <string>

#include "reports/outputs/trace/trace_writer.h"

namespace nanreplay {

// Runs `parse` in a child process and returns its result; an InputError the
// child throws is rethrown here unchanged (file, key and text), and a child
// that dies (a signal, an exit without a result) is InputError(label, "", ...).
TraceContents parse_trace_in_child(const std::string& label, const std::function<TraceContents()>& parse);

}  // namespace nanreplay
