// A read-only memory map of a whole file (RAII). The tool never writes into a
// bundle: maps are PROT_READ/MAP_PRIVATE. An empty file maps to size 0.
// Every live mapping is watched: a read past the end of a file that shrank
// meanwhile reads zeros instead of killing the process with SIGBUS
// (loaders/base/mapping_faults.h), and throw_if_mapped_file_changed() turns that,
// or any change of a mapped file seen since, into an InputError naming it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace nanreplay {

struct MappedFileWatch;  // mapped_file.cpp: what the file was when mapped

class MappedFile {
 public:
  MappedFile();
  // Throws InputError(label, "", ...) when the file cannot be opened or mapped.
  MappedFile(const std::string& path, const std::string& label);
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  // Why the file is no longer what was mapped (a read faulted past its new
  // end; it was truncated, rewritten, replaced or removed), or "" when it is.
  std::string change() const;
  size_t size() const { return size_; }
  // Drops the whole pages of [offset, offset + length) from this process's
  // resident memory (madvise MADV_DONTNEED). The mapping stays valid: a later
  // read faults the unchanged bytes back in from the page cache. Lets a pass
  // over a large file keep only the tensor it is reading resident.
  void release_pages(size_t offset, size_t length) const;
  const std::string& label() const { return label_; }
  // Maps in the pages of [offset, offset + length) in one call (reading them
  // from disk if needed) instead of one page fault per page: streaming scans
  // call it per block. Only a hint: errors (an old kernel) are ignored.
  void prefault(size_t offset, size_t length) const;
  // Starts reading [offset, offset + length) into the page cache in the
  // background (MADV_WILLNEED) and returns at once: a streaming scan asks
  // for the block after next while it works on the current one.
  void read_ahead(size_t offset, size_t length) const;

 private:
  void release();
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::string label_;
  std::unique_ptr<MappedFileWatch> watch_;  // heap-held: its address stays registered across moves
};

// Throws InputError(label, "", "changed while being read: ...") for the first
// live mapping whose file changed since it was mapped. Cheap (one stat per
// mapping): the replay polls it between passes and before it writes outputs,
// so a changed bundle ends the run with exit 2 and nothing written.
void throw_if_mapped_file_changed();

}  // namespace nanreplay
