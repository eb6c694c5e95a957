// An advisory lock on a directory that says "a live process owns this": an
// open descriptor holding flock(LOCK_EX) until it is closed, which the kernel
// does for a process killed by any means (SIGKILL, the OOM killer). So a
// directory of this tool's whose lock can be taken belongs to a run that is
// gone, and may be removed. On a file system without flock (some network
// mounts) held() stays false: the caller carries on unlocked and never takes
// another run's directory for an abandoned one.
#pragma once

#include <filesystem>
#include <utility>

namespace nanreplay {

class DirectoryLock {
 public:
  // wait: block until the lock is free; otherwise give up at once when taken.
  DirectoryLock(const std::filesystem::path& dir, bool wait);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;
  bool opened() const { return fd_ >= 0; }
  bool held() const { return held_; }
  int release() { return std::exchange(fd_, -1); }  // the lock stays with the returned descriptor

 private:
  int fd_ = -1;
  bool held_ = false;
};

}  // namespace nanreplay
