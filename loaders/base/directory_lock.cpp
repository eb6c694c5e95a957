// The directory lock; see directory_lock.h.
#include "loaders/base/directory_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>

namespace nanreplay {

DirectoryLock::DirectoryLock(const std::filesystem::path& dir, bool wait) {
  fd_ = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd_ < 0) return;
  int status;
  do {
    status = ::flock(fd_, LOCK_EX | (wait ? 0 : LOCK_NB));
  } while (status != 0 && errno == EINTR);  // a stop signal only sets a flag: keep waiting
  held_ = status == 0;
}

DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace nanreplay
