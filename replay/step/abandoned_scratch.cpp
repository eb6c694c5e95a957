// See abandoned_scratch.h.
#include "replay/step/abandoned_scratch.h"

#include <string>

#include "loaders/base/directory_lock.h"

namespace nanreplay {

namespace fs = std::filesystem;

namespace {

bool is_scratch_name(const fs::path& path) { return path.filename().string().rfind(kScratchPrefix, 0) == 0; }

}  // namespace

void remove_abandoned_scratch(const fs::path& parent) {
  std::vector<fs::path> found;
  std::error_code ec;
  for (fs::directory_iterator it(parent, ec), end; !ec && it != end; it.increment(ec)) {
    if (!is_scratch_name(it->path())) continue;
    if (it->is_directory(ec) && !it->is_symlink(ec)) found.push_back(it->path());
  }
  remove_if_abandoned(found);
}

std::vector<fs::path> scratch_dirs_held_by(int pid) {
  std::vector<fs::path> held;
  std::error_code ec;
  for (fs::directory_iterator it("/proc/" + std::to_string(pid) + "/fd", ec), end; !ec && it != end;
       it.increment(ec)) {
    std::error_code unreadable;
    const fs::path target = fs::read_symlink(it->path(), unreadable);
    if (!unreadable && target.is_absolute() && is_scratch_name(target)) held.push_back(target);
  }
  return held;
}

void remove_if_abandoned(const std::vector<fs::path>& dirs) {
  std::error_code ec;
  for (const fs::path& scratch : dirs) {
    const DirectoryLock abandoned(scratch, false);
    if (abandoned.held()) fs::remove_all(scratch, ec);
  }
}

}  // namespace nanreplay
