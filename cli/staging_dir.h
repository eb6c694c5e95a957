// A hidden directory beside an output path, for commands that build a whole
// result (a bundle) and rename it into place when it is complete: on the same
// file system, so the rename is atomic, and removed with whatever is left in
// it when the command ends, however it ends.
#pragma once

#include <filesystem>

namespace nanreplay {

class StagingDir {
 public:
  // ".<out name>.<purpose>-XXXXXX" beside `out` (its parent is created if
  // needed); throws OutputError naming `out` when it cannot be made.
  StagingDir(const std::filesystem::path& out, const char* purpose);
  ~StagingDir();
  StagingDir(const StagingDir&) = delete;
  StagingDir& operator=(const StagingDir&) = delete;
  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::filesystem::path dir_;
};

}  // namespace nanreplay
