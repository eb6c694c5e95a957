// Resolving paths named inside a bundle. The tool only reads what the bundle
// holds: a path is first checked as text (relative, no "..") and then, after
// following symlinks, must still lie under the canonical bundle root.
#include "loaders/bundle/bundle_paths.h"

#include <sys/stat.h>

#include <system_error>
#include <vector>

#include "loaders/base/error.h"

namespace nanreplay {
namespace fs = std::filesystem;
namespace {

std::string single_quoted(const std::string& text) { return "'" + text + "'"; }

// Component-wise prefix test; both paths are canonical (no "." or "..").
bool lies_within(const fs::path& root, const fs::path& candidate) {
  auto candidate_it = candidate.begin();
  for (const fs::path& part : root) {
    if (candidate_it == candidate.end() || *candidate_it != part) return false;
    ++candidate_it;
  }
  return true;
}

}  // namespace

void check_bundle_relative_path(const std::string& relative, const std::string& file_label,
                                const std::string& key) {
  if (relative.empty()) {
    throw InputError(file_label, key, "expected a path relative to the bundle, got \"\"");
  }
  // A NUL would silently truncate the path at the system call.
  if (relative.find('\0') != std::string::npos) {
    throw InputError(file_label, key, "expected a path without NUL characters");
  }
  // Control characters name no sane file and would reach terminals in messages.
  for (const char c : relative) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7F) {
      throw InputError(file_label, key,
                       "expected a path without control characters, got " + single_quoted(relative));
    }
  }
  const fs::path path(relative);
  if (path.is_absolute() || path.has_root_path()) {
    throw InputError(file_label, key,
                     "expected a path relative to the bundle, got the absolute path " +
                         single_quoted(relative));
  }
  for (const fs::path& part : path) {
    if (part == "..") {
      throw InputError(file_label, key,
                       "expected a path inside the bundle, got " + single_quoted(relative) +
                           " with a '..' component");
    }
  }
}

fs::path resolve_in_bundle(const fs::path& bundle_root, const std::string& relative,
                           const std::string& file_label, const std::string& key) {
  check_bundle_relative_path(relative, file_label, key);
  std::error_code error;
  const fs::path root = fs::canonical(bundle_root, error);
  if (error) {
    throw InputError(bundle_root.string(), "",
                     "cannot open the bundle directory: " + error.message());
  }
  fs::path resolved = fs::weakly_canonical(root / relative, error);
  if (error) {
    throw InputError(file_label, key,
                     "cannot resolve " + single_quoted(relative) + ": " + error.message());
  }
  if (!lies_within(root, resolved)) {
    throw InputError(file_label, key,
                     "path " + single_quoted(relative) + " escapes the bundle (it resolves to " +
                         single_quoted(resolved.string()) + ", outside " + single_quoted(root.string()) + ")");
  }
  return resolved;
}

fs::path resolve_for_creation(const fs::path& path) {
  std::error_code error;
  fs::path current = fs::absolute(path, error);
  if (error) return path;
  for (int round = 0; round < 40; ++round) {  // each round follows one more link; 40 as the kernel
    fs::path existing = current;
    std::vector<fs::path> missing;  // innermost first
    struct stat info {};
    while (::stat(existing.c_str(), &info) != 0 && existing.has_relative_path()) {
      missing.push_back(existing.filename());
      existing = existing.parent_path();
    }
    fs::path resolved = fs::canonical(existing, error);
    if (error) return current;
    for (auto it = missing.rbegin(); it != missing.rend(); ++it) resolved /= *it;
    resolved = resolved.lexically_normal();
    if (resolved == current) break;
    current = resolved;
  }
  return current;
}

bool lies_inside_directory(const fs::path& path, const fs::path& directory) {
  struct stat target {};
  if (::stat(directory.c_str(), &target) != 0) return false;
  fs::path ancestor = resolve_for_creation(path);
  struct stat info {};
  while (true) {
    if (::stat(ancestor.c_str(), &info) == 0 && info.st_dev == target.st_dev && info.st_ino == target.st_ino) {
      return true;
    }
    if (!ancestor.has_relative_path()) return false;
    ancestor = ancestor.parent_path();
  }
}

}  // namespace nanreplay
