// One project error type and the exit statuses, named once.
// Every bad input is thrown as InputError carrying the file and the key (or byte
// offset) at fault; the CLI catches it once and prints a single line.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

namespace nanreplay {

enum class ExitStatus : int {
  kClean = 0,        // replay finished, nothing non-finite, no error finding
  kFound = 1,        // a non-finite origin or an error finding was named
  kBadInput = 2,     // bad usage or bad input; nothing half-written
  kInternal = 3,     // a bug or an environment failure
  kInterrupted = 130 // SIGINT/SIGTERM: stopped cleanly, nothing half-written
};

// Bad input: a corrupt bundle, a wrong shape, a missing key, a path escaping
// the bundle. `file` is the path as the user would recognise it, `key` a JSON
// key path ("model.hidden_size"), a tensor name or "byte 1234".
class InputError : public std::runtime_error {
 public:
  InputError(std::string file, std::string key, const std::string& what)
      : std::runtime_error(compose(file, key, what)),
        file_(std::move(file)),
        key_(std::move(key)) {}

  const std::string& file() const { return file_; }
  const std::string& key() const { return key_; }

 private:
  static std::string compose(const std::string& file, const std::string& key,
                             const std::string& what) {
    std::string out = file;
    if (!key.empty()) out += (out.empty() ? "" : ": ") + key;
    return out + (out.empty() ? "" : ": ") + what;
  }
  std::string file_;
  std::string key_;
};

// Bad command-line usage (unknown flag, missing argument).
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace nanreplay
