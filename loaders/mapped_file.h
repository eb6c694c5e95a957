// A read-only memory map of a whole file (RAII). The tool never writes into a
// bundle: maps are PROT_READ/MAP_PRIVATE. An empty file maps to size 0.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace nanreplay {

class MappedFile {
 public:
  MappedFile() = default;
  // Throws InputError(label, "", ...) when the file cannot be opened or mapped.
  MappedFile(const std::string& path, const std::string& label);
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
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
};

}  // namespace nanreplay
