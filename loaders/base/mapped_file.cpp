// Read-only memory maps of whole bundle files (PROT_READ, MAP_PRIVATE), so a
// bug can never write into the evidence. Key constraint: anything that is not
// a regular file (a directory, a FIFO) is refused with an InputError, not a
// hang; a file that changes while mapped is noticed, never a crash.
#include "loaders/base/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <set>
#include <utility>

#include "loaders/base/error.h"
#include "loaders/base/mapping_faults.h"
#include "loaders/base/message_text.h"

namespace nanreplay {

// What the file was when it was mapped, to tell later whether it still is.
// Checked by path (no descriptor kept open, so a bundle of many shards needs
// no more than the usual file limit): a removed, replaced, truncated or
// rewritten file all show in stat(), a rewrite whose writer restored the
// size and modification time in st_ctim. Cost: one stat per mapping per poll.
struct MappedFileWatch {
  std::string path;
  std::string label;
  struct stat opened {};
  MappingFaultSlot* faults = nullptr;  // null for an empty file (nothing mapped)
};

namespace {

std::mutex g_watches_mutex;
std::set<const MappedFileWatch*>& live_watches() {
  static std::set<const MappedFileWatch*> watches;
  return watches;
}

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


bool same_time(const timespec& a, const timespec& b) { return a.tv_sec == b.tv_sec && a.tv_nsec == b.tv_nsec; }

std::string change_of(const MappedFileWatch& watch) {
  if (mapping_faulted(watch.faults)) {
    return "a read past its end failed (the file shrank while mapped, or the disk could not return it)";
  }
  struct stat now {};
  if (::stat(watch.path.c_str(), &now) != 0) return "it was removed or renamed (" + errno_text() + ")";
  const struct stat& was = watch.opened;
  if (now.st_dev != was.st_dev || now.st_ino != was.st_ino) return "it was replaced by another file";
  if (now.st_size != was.st_size) {
    return "it is now " + std::to_string(now.st_size) + " bytes, it was " + std::to_string(was.st_size) +
           " when opened";
  }
  if (!same_time(now.st_mtim, was.st_mtim)) return "it was rewritten (its modification time changed)";
  // A writer can set the modification time back (touch -r, rsync --inplace -t,
  // os.utime); the change time follows every write and every utime, and only
  // the kernel sets it. It also moves on chmod or a new hard link: refused
  // too, since what was read can no longer be told apart from a rewrite.
  if (!same_time(now.st_ctim, was.st_ctim)) {
    return "it was rewritten or its status changed (its change time moved; its modification time, if unchanged, "
           "was set back)";
  }
  return "";
}

}  // namespace

std::string MappedFile::change() const { return watch_ ? change_of(*watch_) : ""; }

void throw_if_mapped_file_changed() {
  const std::lock_guard<std::mutex> lock(g_watches_mutex);
  for (const MappedFileWatch* watch : live_watches()) {
    const std::string why = change_of(*watch);
    if (!why.empty()) {
      throw InputError(watch->label, "",
                       "changed while being read: " + why +
                           "; copy the bundle somewhere nobody writes to and run again");
    }
  }
}

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

  auto watch = std::make_unique<MappedFileWatch>();
  watch->path = path;
  watch->label = label;
  watch->opened = info;
  size_ = static_cast<size_t>(info.st_size);
  if (size_ > 0) {  // mmap of length 0 is an error; an empty file maps to nothing
    void* mapping = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    if (mapping == MAP_FAILED) {
      size_ = 0;
      throw InputError(label, "", "cannot map into memory: " + errno_text());
    }
    data_ = static_cast<const uint8_t*>(mapping);
    watch->faults = watch_mapping_faults(data_, size_);
  }
  const std::lock_guard<std::mutex> lock(g_watches_mutex);
  live_watches().insert(watch.get());
  watch_ = std::move(watch);
}

MappedFile::MappedFile() = default;
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
      label_(std::move(other.label_)),
      watch_(std::move(other.watch_)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    label_ = std::move(other.label_);
    watch_ = std::move(other.watch_);
  }
  return *this;
}

void MappedFile::release() {
  if (watch_) {
    // Unregistered before the range is unmapped: the address may be reused.
    unwatch_mapping_faults(watch_->faults);
    const std::lock_guard<std::mutex> lock(g_watches_mutex);
    live_watches().erase(watch_.get());
    watch_.reset();
  }
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace nanreplay
