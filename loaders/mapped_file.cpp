// Read-only memory maps of whole bundle files (PROT_READ, MAP_PRIVATE), so a
// bug can never write into the evidence. Key constraint: anything that is not
// a regular file (a directory, a FIFO) is refused with an InputError, not a hang.
#include "loaders/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <utility>

#include "loaders/error.h"

namespace nanreplay {
namespace {

// Closes the descriptor on every exit path; the mapping outlives it.
class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

std::string errno_text() { return std::strerror(errno); }

}  // namespace

MappedFile::MappedFile(const std::string& path, const std::string& label) : label_(label) {
  // O_NONBLOCK keeps open() of a FIFO from waiting for a writer.
  const FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (fd.get() < 0) throw InputError(label, "", "cannot open: " + errno_text());

  struct stat info {};
  if (::fstat(fd.get(), &info) != 0) throw InputError(label, "", "cannot open: " + errno_text());
  if (S_ISDIR(info.st_mode)) {
    throw InputError(label, "", "cannot open: expected a file, found a directory");
  }
  if (!S_ISREG(info.st_mode)) {
    throw InputError(label, "", "cannot open: expected a regular file, found a special file");
  }

  size_ = static_cast<size_t>(info.st_size);
  if (size_ == 0) return;  // mmap of length 0 is an error; an empty file maps to nothing
  void* mapping = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (mapping == MAP_FAILED) {
    size_ = 0;
    throw InputError(label, "", "cannot map into memory: " + errno_text());
  }
  data_ = static_cast<const uint8_t*>(mapping);
}

MappedFile::~MappedFile() { release(); }

void MappedFile::prefault(size_t offset, size_t length) const {
#ifdef MADV_POPULATE_READ
  if (offset >= size_) return;
  length = std::min(length, size_ - offset);
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t first = offset / page * page;
  (void)::madvise(const_cast<uint8_t*>(data_) + first, length + (offset - first), MADV_POPULATE_READ);
#else
  (void)offset;
  (void)length;
#endif
}

void MappedFile::read_ahead(size_t offset, size_t length) const {
  if (data_ == nullptr || offset >= size_) return;
  length = std::min(length, size_ - offset);
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t first = offset / page * page;
  (void)::madvise(const_cast<uint8_t*>(data_) + first, length + (offset - first), MADV_WILLNEED);
}

void MappedFile::release_pages(size_t offset, size_t length) const {
  if (data_ == nullptr || offset >= size_) return;
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(data_) + offset;
  const uintptr_t end = begin + std::min(length, size_ - offset);
  // Only pages wholly inside the range: the edges may hold a neighbour's bytes.
  const uintptr_t first = (begin + page - 1) / page * page;
  const uintptr_t last = end / page * page;
  // Advice only: a failure leaves the pages resident, which is merely slower to free.
  if (last > first) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      label_(std::move(other.label_)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    label_ = std::move(other.label_);
  }
  return *this;
}

void MappedFile::release() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace nanreplay
