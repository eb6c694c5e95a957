// Surviving a bundle file that shrinks while it is mapped. Reading a mapped
// page past a file's new end raises SIGBUS, in whichever thread touched it
// (LibTorch's and OpenMP's included). A process-wide SIGBUS handler looks the
// faulting address up in a lock-free registry of live mappings; inside one, it
// maps anonymous zero pages over the rest of that mapping, so the faulting
// instruction continues (no longjmp, any thread), and marks the mapping as
// faulted. The replay reads zeros from then on, and polls (MappedFile's
// throw_if_mapped_file_changed) at safe points to end with an InputError naming
// the file. A fault outside every registered mapping goes to the handler that
// was there before (the default one: the process dies with SIGBUS as before).
#pragma once

#include <cstddef>

namespace nanreplay {

class MappingFaultSlot;

// Registers [begin, begin + length) (installs the handler on first use).
// Never fails: the registry grows in chunks that live as long as the process.
MappingFaultSlot* watch_mapping_faults(const void* begin, size_t length);
// Unregisters before the range is unmapped.
void unwatch_mapping_faults(MappingFaultSlot* slot);
// Whether a read inside the range faulted since it was registered.
bool mapping_faulted(const MappingFaultSlot* slot);

}  // namespace nanreplay
