// The output directory of a command, written whole or not at all: files are
// staged in a hidden directory inside it and renamed into place on commit().
// Refuses a directory inside the bundle (the tool never writes into a bundle),
// and one that already holds results when asked not to replace them. Cleans
// up on failure; previous results survive a run that fails.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace nanreplay {

class OutputDir {
 public:
  // Throws UsageError when `dir` lies inside `bundle_root`, or already holds
  // one of `results` and `replace_existing` is false.
  OutputDir(const std::filesystem::path& dir, const std::filesystem::path& bundle_root, bool replace_existing,
            std::vector<std::string> results);
  ~OutputDir();
  OutputDir(const OutputDir&) = delete;
  OutputDir& operator=(const OutputDir&) = delete;

  std::filesystem::path staging_path(const std::string& name) const;
  void write_text(const std::string& name, const std::string& text) const;
  // Moves every staged result into place (each rename is atomic), then
  // removes a previous run's result that this run did not stage, so the
  // directory never mixes two runs.
  void commit();
  // Removes what was staged (and the directory, if this object created it).
  void abandon();

 private:
  std::filesystem::path dir_;
  std::filesystem::path staging_;
  std::vector<std::string> results_;
  bool created_dir_ = false;
  bool done_ = false;
};

}  // namespace nanreplay
