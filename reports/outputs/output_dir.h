// The output directory of a command, written whole or not at all. Results are
// staged in a hidden directory inside it with a unique name (mkdtemp, never a
// PID: containers share volumes), locked (flock) while its run lives; a later
// run removes staging directories nobody holds (a run killed by SIGKILL or
// the OOM killer). commit() moves the whole set in under a lock on the
// directory, so concurrent runs into one --out commit one after the other:
// the previous set is moved aside, the new one renamed in, the old one
// deleted; any failure puts the previous set back, and a commit killed
// half-way is rolled back or finished by the next run (a marker says which).
// Refuses a directory inside the bundle (device and inode of every ancestor).
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace nanreplay {

class ExitCleanup;

class OutputDir {
 public:
  // Throws UsageError when `dir` is or would lie inside `bundle_root`, is not
  // a directory, or holds one of `results` and `replace_existing` is false;
  // OutputError when a result name is taken by something that is not a file
  // or the directory cannot be created or written. Creates `dir` (and the
  // parents it lacks) when needed: abandon() removes them again.
  OutputDir(const std::filesystem::path& dir, const std::filesystem::path& bundle_root, bool replace_existing,
            std::vector<std::string> results);
  ~OutputDir();
  OutputDir(const OutputDir&) = delete;
  OutputDir& operator=(const OutputDir&) = delete;

  std::filesystem::path staging_path(const std::string& name) const;
  // The name a staged result goes by in messages: its final path.
  std::string display_path(const std::string& name) const;
  // Writes a staged result whole (flushed to disk); OutputError on failure.
  void write_text(const std::string& name, const std::string& text) const;
  // Replaces the results in the directory with the staged set, as one set
  // (a previous result this run did not stage is removed too); on failure
  // throws OutputError and leaves the previous set as it was.
  void commit();
  // Removes what was staged, and the directories this object created when
  // they are empty (never others' files).
  void abandon();

 private:
  std::filesystem::path dir_;  // as given, for messages
  std::filesystem::path root_;  // absolute, for every file operation
  std::vector<std::string> results_;
  std::vector<std::filesystem::path> created_;  // outermost first
  // For an exit without unwinding: the directories made for --out (if still empty), then the staging one.
  std::vector<std::unique_ptr<ExitCleanup>> exit_cleanups_;
  std::filesystem::path staging_;
  int staging_lock_ = -1;  // open descriptor holding the staging directory's flock
  bool done_ = false;
};

}  // namespace nanreplay
