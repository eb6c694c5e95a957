// What to remove when a process must end at once, without unwinding: a
// replay split across processes (replay/step/ranks/distributed.h) whose peer failed or
// was interrupted while this process waits inside a collective it cannot
// leave. Scratch directories and staged output register here while they
// exist, so such an exit still leaves nothing half-written.
#pragma once

#include <filesystem>

namespace nanreplay {

class ExitCleanup {
 public:
  // Removed (recursively) by remove_for_exit(); `only_if_empty`: a directory
  // the command made, removed only if nothing else was put in it.
  explicit ExitCleanup(std::filesystem::path path, bool only_if_empty = false);
  ~ExitCleanup();                                     // no longer: its owner removes or keeps it
  ExitCleanup(const ExitCleanup&) = delete;
  ExitCleanup& operator=(const ExitCleanup&) = delete;
  void dismiss();  // keep the path (a committed result) from here on

 private:
  long id_;
};

// Removes every registered path, the last registered first. Any thread.
void remove_for_exit();

}  // namespace nanreplay
