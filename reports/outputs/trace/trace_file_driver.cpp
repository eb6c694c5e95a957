// The latching file driver of trace_file_driver.h.
#include "reports/outputs/trace/trace_file_driver.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>

namespace nanreplay {

namespace {

struct DriverInfo {  // what a file access list carries to open()
  TraceFileLatch* latch;
};

struct LatchingFile {
  H5FD_t base;  // first: HDF5 owns these fields and casts between the two
  int fd = -1;
  dev_t device = 0;
  ino_t inode = 0;
  haddr_t eoa = 0;  // end of the address space HDF5 has allocated
  haddr_t eof = 0;  // end of what the file holds
  TraceFileLatch* latch = nullptr;
};

LatchingFile* as_file(H5FD_t* file) { return reinterpret_cast<LatchingFile*>(file); }
const LatchingFile* as_file(const H5FD_t* file) { return reinterpret_cast<const LatchingFile*>(file); }

void latch_error(LatchingFile& file, const char* during, int error_number) {
  if (file.latch->failed()) return;
  file.latch->error_number = error_number != 0 ? error_number : EIO;
  file.latch->during = during;
}

void* copy_info(const void* info) {
  void* copy = std::malloc(sizeof(DriverInfo));
  if (copy != nullptr) std::memcpy(copy, info, sizeof(DriverInfo));
  return copy;
}

herr_t free_info(void* info) {
  std::free(info);
  return 0;
}

H5FD_t* open_file(const char* name, unsigned flags, hid_t access, haddr_t /*maxaddr*/) {
  const auto* info = static_cast<const DriverInfo*>(H5Pget_driver_info(access));
  if (info == nullptr || info->latch == nullptr) return nullptr;
  int open_flags = (flags & H5F_ACC_RDWR) ? O_RDWR : O_RDONLY;
  if (flags & H5F_ACC_TRUNC) open_flags |= O_TRUNC;
  if (flags & H5F_ACC_CREAT) open_flags |= O_CREAT;
  if (flags & H5F_ACC_EXCL) open_flags |= O_EXCL;
  const int fd = ::open(name, open_flags | O_CLOEXEC, 0644);
  struct stat status {};
  if (fd < 0 || ::fstat(fd, &status) != 0) {
    info->latch->open_error_number = errno != 0 ? errno : EIO;
    if (fd >= 0) ::close(fd);
    return nullptr;
  }
  auto* file = new (std::nothrow) LatchingFile();
  if (file == nullptr) {
    ::close(fd);
    return nullptr;
  }
  file->fd = fd;
  file->device = status.st_dev;
  file->inode = status.st_ino;
  file->eof = static_cast<haddr_t>(status.st_size);
  file->latch = info->latch;
  return &file->base;
}

// Flushed to disk before it is closed: a full disk or a quota often shows
// only in fsync (delayed allocation, NFS).
herr_t close_file(H5FD_t* handle) {
  LatchingFile* file = as_file(handle);
  if (!file->latch->failed() && ::fsync(file->fd) != 0) latch_error(*file, "flushing to disk", errno);
  if (::close(file->fd) != 0) latch_error(*file, "closing", errno);
  delete file;
  return 0;
}

int compare_files(const H5FD_t* a, const H5FD_t* b) {
  const LatchingFile* x = as_file(a);
  const LatchingFile* y = as_file(b);
  if (x->device != y->device) return x->device < y->device ? -1 : 1;
  if (x->inode != y->inode) return x->inode < y->inode ? -1 : 1;
  return 0;
}

herr_t query_features(const H5FD_t* /*file*/, unsigned long* flags) {
  *flags = H5FD_FEAT_AGGREGATE_METADATA | H5FD_FEAT_ACCUMULATE_METADATA | H5FD_FEAT_DATA_SIEVE |
           H5FD_FEAT_AGGREGATE_SMALLDATA;
  return 0;
}

haddr_t get_eoa(const H5FD_t* file, H5FD_mem_t /*type*/) { return as_file(file)->eoa; }

herr_t set_eoa(H5FD_t* file, H5FD_mem_t /*type*/, haddr_t address) {
  as_file(file)->eoa = address;
  return 0;
}

haddr_t get_eof(const H5FD_t* file, H5FD_mem_t /*type*/) { return as_file(file)->eof; }

herr_t get_handle(H5FD_t* file, hid_t /*access*/, void** handle) {
  *handle = &as_file(file)->fd;
  return 0;
}

// Beyond the end of the file reads zeros, as sec2 does.
herr_t read_bytes(H5FD_t* handle, H5FD_mem_t /*type*/, hid_t /*transfer*/, haddr_t address, size_t size,
                  void* buffer) {
  LatchingFile* file = as_file(handle);
  auto* bytes = static_cast<unsigned char*>(buffer);
  while (size > 0) {
    const ssize_t n = ::pread(file->fd, bytes, size, static_cast<off_t>(address));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      latch_error(*file, "reading", errno);
      return -1;
    }
    if (n == 0) {
      std::memset(bytes, 0, size);
      break;
    }
    bytes += n;
    address += static_cast<haddr_t>(n);
    size -= static_cast<size_t>(n);
  }
  return 0;
}

// Never fails: the first error is latched and the rest of the file dropped.
herr_t write_bytes(H5FD_t* handle, H5FD_mem_t /*type*/, hid_t /*transfer*/, haddr_t address, size_t size,
                   const void* buffer) {
  LatchingFile* file = as_file(handle);
  if (file->latch->failed()) return 0;
  const haddr_t end = address + size;
  const auto* bytes = static_cast<const unsigned char*>(buffer);
  while (size > 0) {
    const ssize_t n = ::pwrite(file->fd, bytes, size, static_cast<off_t>(address));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      latch_error(*file, "writing", n < 0 ? errno : ENOSPC);
      return 0;
    }
    bytes += n;
    address += static_cast<haddr_t>(n);
    size -= static_cast<size_t>(n);
  }
  if (end > file->eof) file->eof = end;
  return 0;
}

herr_t truncate_file(H5FD_t* handle, hid_t /*transfer*/, hbool_t /*closing*/) {
  LatchingFile* file = as_file(handle);
  if (file->eoa == file->eof || file->latch->failed()) return 0;
  if (::ftruncate(file->fd, static_cast<off_t>(file->eoa)) != 0) {
    latch_error(*file, "truncating", errno);
    return 0;
  }
  file->eof = file->eoa;
  return 0;
}

H5FD_class_t driver_class() {
  H5FD_class_t driver{};
#if H5_VERSION_GE(1, 14, 0)
  // HDF5 1.14 checks the struct's version, and wants a driver value of its
  // own: 256 to 511 are left to drivers that are not registered with the HDF Group.
  driver.version = H5FD_CLASS_VERSION;
  driver.value = 400;
#endif
  driver.name = "nanreplay-latching";
  driver.maxaddr = (static_cast<haddr_t>(1) << (8 * sizeof(off_t) - 1)) - 1;
  driver.fc_degree = H5F_CLOSE_STRONG;
  driver.fapl_size = sizeof(DriverInfo);
  driver.fapl_copy = copy_info;
  driver.fapl_free = free_info;
  driver.open = open_file;
  driver.close = close_file;
  driver.cmp = compare_files;
  driver.query = query_features;
  driver.get_eoa = get_eoa;
  driver.set_eoa = set_eoa;
  driver.get_eof = get_eof;
  driver.get_handle = get_handle;
  driver.read = read_bytes;
  driver.write = write_bytes;
  driver.truncate = truncate_file;
  const H5FD_mem_t map[] = H5FD_FLMAP_DICHOTOMY;
  static_assert(sizeof map == sizeof driver.fl_map, "one free-list entry per memory type");
  std::memcpy(driver.fl_map, map, sizeof map);
  return driver;
}

// Registered once per process; HDF5 keeps the id until it shuts down.
hid_t driver_id() {
  static const H5FD_class_t driver = driver_class();
  static const hid_t id = H5FDregister(&driver);
  return id;
}

}  // namespace

std::string TraceFileLatch::text() const {
  return std::string(std::strerror(error_number)) + " (while " + during + ")";
}

hid_t latching_file_access(TraceFileLatch& latch) {
  const hid_t id = driver_id();
  if (id < 0) throw std::runtime_error("HDF5 refused nanreplay's trace file driver");
  const hid_t access = H5Pcreate(H5P_FILE_ACCESS);
  const DriverInfo info{&latch};
  if (access < 0 || H5Pset_driver(access, id, &info) < 0) {
    if (access >= 0) H5Pclose(access);
    throw std::runtime_error("HDF5 refused nanreplay's trace file driver");
  }
  return access;
}

}  // namespace nanreplay
