// Staged output committed as one set; see output_dir.h. Key constraint: after
// any failure, a crash included, the directory holds exactly the previous
// complete set of results (or nothing new), and nothing but the results and
// this tool's hidden directories is ever touched.
#include "reports/outputs/output_dir.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "loaders/bundle/bundle_paths.h"
#include "loaders/base/directory_lock.h"
#include "loaders/base/error.h"
#include "loaders/base/exit_cleanup.h"
#include "loaders/base/message_text.h"

namespace nanreplay {

namespace fs = std::filesystem;

namespace {

constexpr const char* kStagingPrefix = ".nanreplay-staging-";
// The previous set while a commit replaces it. Its markers say how far the
// commit got: the whole old set is in it, then the whole new set is in place.
constexpr const char* kAsidePrefix = ".nanreplay-previous-";
constexpr const char* kOldSetAside = ".old-set-aside";
constexpr const char* kNewSetIn = ".new-set-in";


bool exists_no_follow(const fs::path& path) {
  struct stat info {};
  return ::lstat(path.c_str(), &info) == 0;
}

bool starts_with(const std::string& text, const char* prefix) { return text.rfind(prefix, 0) == 0; }

// The entries of `root` whose names start with `prefix`; never throws (other
// runs add and remove theirs meanwhile).
std::vector<fs::path> entries_named(const fs::path& root, const char* prefix) {
  std::vector<fs::path> found;
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    if (starts_with(it->path().filename().string(), prefix)) found.push_back(it->path());
  }
  return found;
}

// Staging directories whose run is gone (killed, out of memory, another
// container's run that died) hold no lock: remove them. Held ones are live.
void remove_stale_staging(const fs::path& root) {
  std::error_code ec;
  for (const fs::path& staging : entries_named(root, kStagingPrefix)) {
    const DirectoryLock stale(staging, false);
    if (stale.held()) fs::remove_all(staging, ec);
  }
}

void create_marker(const fs::path& path, const std::string& display) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0 || ::close(fd) != 0) throw OutputError(display, "cannot commit the results: " + errno_text());
}

// Finishes or rolls back a commit that died half-way (the caller holds the
// directory lock, so no commit is running). Idempotent: a crash during the
// recovery leaves a state the next recovery reads the same way.
void recover_interrupted_commits(const fs::path& root, const std::vector<std::string>& results) {
  std::error_code ec;
  for (const fs::path& aside : entries_named(root, kAsidePrefix)) {
    if (fs::is_symlink(fs::symlink_status(aside, ec))) continue;
    if (!exists_no_follow(aside / kNewSetIn)) {
      if (exists_no_follow(aside / kOldSetAside)) {
        // The old set was all aside: what is in place is part of the new one.
        for (const std::string& name : results) fs::remove(root / name, ec);
        fs::remove(aside / kOldSetAside, ec);
      }
      for (const fs::path& old : entries_named(aside, "")) {
        const fs::path back = root / old.filename();
        if (!exists_no_follow(back)) fs::rename(old, back, ec);
      }
    }
    fs::remove_all(aside, ec);
  }
}

// Creates each missing directory of `dir` (resolved: no "..", no symlink
// among the missing parts); returns them outermost first.
std::vector<fs::path> create_missing_directories(const fs::path& dir, const std::string& display) {
  std::vector<fs::path> created;
  fs::path prefix;
  for (const fs::path& part : dir) {
    prefix /= part;
    if (part.empty() || exists_no_follow(prefix)) continue;
    if (::mkdir(prefix.c_str(), 0777) != 0 && errno != EEXIST) {
      const std::string reason = errno_text();
      for (auto it = created.rbegin(); it != created.rend(); ++it) ::rmdir(it->c_str());
      throw UsageError("cannot create --out " + display + ": " + reason);
    }
    created.push_back(prefix);
  }
  return created;
}

void rename_or_throw(const fs::path& from, const fs::path& to, const std::string& display) {
  if (std::rename(from.c_str(), to.c_str()) != 0) {
    throw OutputError(display, "cannot move the result into place: " + errno_text());
  }
}

}  // namespace

OutputDir::OutputDir(const fs::path& dir, const fs::path& bundle_root, bool replace_existing,
                     std::vector<std::string> results)
    : dir_(dir), results_(std::move(results)) {
  if (lies_inside_directory(dir, bundle_root)) {
    throw UsageError("--out " + dir.string() + " is inside the bundle " + bundle_root.string() +
                     "; nanreplay never writes into a bundle, choose another directory");
  }
  // What was checked is what is created: the resolved path, component by component.
  root_ = resolve_for_creation(dir);
  struct stat info {};
  if (::stat(root_.c_str(), &info) == 0) {
    if (!S_ISDIR(info.st_mode)) throw UsageError("--out " + dir.string() + " exists and is not a directory");
  } else if (exists_no_follow(root_)) {
    throw UsageError("--out " + dir.string() + " is a symlink to nothing");
  } else {
    created_ = create_missing_directories(root_, dir.string());
    for (const fs::path& made : created_) exit_cleanups_.push_back(std::make_unique<ExitCleanup>(made, true));
  }
  // Staging under the directory lock: a run cleaning up stale staging must
  // not take ours for one between its creation and its lock.
  const DirectoryLock lock(root_, true);
  if (!lock.opened()) {
    const std::string reason = errno_text();
    abandon();
    throw OutputError(dir.string(), "cannot open the output directory: " + reason);
  }
  recover_interrupted_commits(root_, results_);
  remove_stale_staging(root_);
  for (const std::string& name : results_) {
    struct stat result {};
    if (::lstat((root_ / name).c_str(), &result) != 0) continue;
    if (!S_ISREG(result.st_mode)) {
      abandon();
      throw OutputError(display_path(name),
                        "is not a file an earlier run wrote (a directory, link or device); move it away "
                        "or choose another --out");
    }
    if (!replace_existing) {
      abandon();
      throw UsageError("--out " + dir.string() + " already holds results (" + name + ") and --no-clobber was given");
    }
  }
  std::string pattern = (root_ / (std::string(kStagingPrefix) + "XXXXXX")).string();
  if (::mkdtemp(pattern.data()) == nullptr) {
    const std::string reason = errno_text();
    abandon();
    throw OutputError(dir.string(), "cannot write into the output directory: " + reason);
  }
  staging_ = pattern;
  exit_cleanups_.push_back(std::make_unique<ExitCleanup>(staging_));
  DirectoryLock mine(staging_, false);
  staging_lock_ = mine.release();
}

OutputDir::~OutputDir() {
  if (!done_) abandon();
}

fs::path OutputDir::staging_path(const std::string& name) const { return staging_ / name; }

std::string OutputDir::display_path(const std::string& name) const { return (dir_ / name).string(); }

void OutputDir::write_text(const std::string& name, const std::string& text) const {
  const std::string display = display_path(name);
  const int fd = ::open(staging_path(name).c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw OutputError(display, "cannot write: " + errno_text());
  size_t written = 0;
  while (written < text.size()) {
    const ssize_t n = ::write(fd, text.data() + written, text.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string reason = n < 0 ? errno_text() : "nothing written";
      ::close(fd);
      throw OutputError(display, "cannot write: " + reason);
    }
    written += static_cast<size_t>(n);
  }
  // A full disk or a quota often shows only here (delayed allocation, NFS).
  if (::fsync(fd) != 0) {
    const std::string reason = errno_text();
    ::close(fd);
    throw OutputError(display, "cannot write: " + reason);
  }
  if (::close(fd) != 0) throw OutputError(display, "cannot write: " + errno_text());
}

void OutputDir::commit() {
  const DirectoryLock lock(root_, true);  // one commit at a time per directory
  recover_interrupted_commits(root_, results_);
  for (const std::string& name : results_) {
    struct stat result {};
    if (::lstat((root_ / name).c_str(), &result) == 0 && !S_ISREG(result.st_mode)) {
      throw OutputError(display_path(name),
                        "is not a file an earlier run wrote (a directory, link or device); nothing was "
                        "replaced: move it away or choose another --out");
    }
  }
  std::string pattern = (root_ / (std::string(kAsidePrefix) + "XXXXXX")).string();
  if (::mkdtemp(pattern.data()) == nullptr) {
    throw OutputError(dir_.string(), "cannot commit the results: " + errno_text());
  }
  const fs::path aside = pattern;
  std::error_code ec;
  std::vector<std::string> moved_aside;
  std::vector<std::string> moved_in;
  try {
    for (const std::string& name : results_) {
      if (!exists_no_follow(root_ / name)) continue;
      rename_or_throw(root_ / name, aside / name, display_path(name));
      moved_aside.push_back(name);
    }
    create_marker(aside / kOldSetAside, dir_.string());
    for (const std::string& name : results_) {
      if (!exists_no_follow(staging_path(name))) continue;
      rename_or_throw(staging_path(name), root_ / name, display_path(name));
      moved_in.push_back(name);
    }
    create_marker(aside / kNewSetIn, dir_.string());
  } catch (...) {
    for (auto it = moved_in.rbegin(); it != moved_in.rend(); ++it) fs::rename(root_ / *it, staging_path(*it), ec);
    fs::remove(aside / kOldSetAside, ec);
    for (const std::string& name : moved_aside) fs::rename(aside / name, root_ / name, ec);
    fs::remove_all(aside, ec);
    throw;
  }
  fs::remove_all(aside, ec);
  fs::remove_all(staging_, ec);
  if (staging_lock_ >= 0) ::close(staging_lock_);
  staging_lock_ = -1;
  exit_cleanups_.clear();
  done_ = true;
}

void OutputDir::abandon() {
  std::error_code ec;
  if (!staging_.empty()) fs::remove_all(staging_, ec);
  if (staging_lock_ >= 0) ::close(staging_lock_);
  staging_lock_ = -1;
  // rmdir only removes empty directories: another run's files stay.
  for (auto it = created_.rbegin(); it != created_.rend(); ++it) ::rmdir(it->c_str());
  exit_cleanups_.clear();
  done_ = true;
}

}  // namespace nanreplay
