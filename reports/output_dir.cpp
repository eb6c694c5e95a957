// Staged, atomic output; see output_dir.h.
#include "reports/output_dir.h"

#include <unistd.h>

#include <fstream>

#include "loaders/error.h"

namespace nanreplay {

namespace fs = std::filesystem;

namespace {

bool is_inside(const fs::path& path, const fs::path& root) {
  const fs::path p = fs::weakly_canonical(path);
  const fs::path r = fs::weakly_canonical(root);
  auto pi = p.begin();
  for (auto ri = r.begin(); ri != r.end(); ++ri, ++pi) {
    if (ri->empty()) continue;
    if (pi == p.end() || *pi != *ri) return false;
  }
  return true;
}

}  // namespace

OutputDir::OutputDir(const fs::path& dir, const fs::path& bundle_root, bool replace_existing,
                     std::vector<std::string> results)
    : dir_(dir), results_(std::move(results)) {
  if (is_inside(dir, bundle_root)) {
    throw UsageError("--out " + dir.string() +
                     " is inside the bundle; nanreplay never writes into a bundle, choose another directory");
  }
  std::error_code ec;
  if (fs::exists(dir, ec)) {
    if (!fs::is_directory(dir, ec)) throw UsageError("--out " + dir.string() + " exists and is not a directory");
    for (const std::string& name : results_) {
      if (!replace_existing && fs::exists(dir / name, ec)) {
        throw UsageError("--out " + dir.string() + " already holds results (" + name +
                         ") and --no-clobber was given");
      }
    }
  } else {
    fs::create_directories(dir, ec);
    if (ec) throw UsageError("cannot create --out " + dir.string() + ": " + ec.message());
    created_dir_ = true;
  }
  staging_ = dir / (".nanreplay-staging-" + std::to_string(getpid()));
  fs::remove_all(staging_, ec);
  fs::create_directory(staging_, ec);
  if (ec) throw UsageError("cannot write into --out " + dir.string() + ": " + ec.message());
}

OutputDir::~OutputDir() {
  if (!done_) abandon();
}

fs::path OutputDir::staging_path(const std::string& name) const { return staging_ / name; }

void OutputDir::write_text(const std::string& name, const std::string& text) const {
  std::ofstream out(staging_path(name), std::ios::binary | std::ios::trunc);
  out << text;
  out.flush();
  if (!out) throw std::runtime_error("cannot write " + staging_path(name).string());
}

void OutputDir::commit() {
  std::vector<std::string> not_staged;
  for (const std::string& name : results_) {
    std::error_code ec;
    if (!fs::exists(staging_path(name), ec)) {
      not_staged.push_back(name);
      continue;
    }
    fs::rename(staging_path(name), dir_ / name);
  }
  for (const std::string& name : not_staged) {
    std::error_code ec;
    fs::remove(dir_ / name, ec);
  }
  std::error_code ec;
  fs::remove_all(staging_, ec);
  done_ = true;
}

void OutputDir::abandon() {
  std::error_code ec;
  fs::remove_all(staging_, ec);
  if (created_dir_) fs::remove(dir_, ec);  // only if empty: never deletes others' files
  done_ = true;
}

}  // namespace nanreplay
