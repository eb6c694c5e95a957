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

// Text from a bundle (paths, keys, tensor names) quoted in a message may hold
// control characters; escaped as \xNN (C1 controls as \u00NN), a message stays
// one printable line and cannot drive the user's terminal.
inline std::string printable(const std::string& text) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    const auto next = i + 1 < text.size() ? static_cast<unsigned char>(text[i + 1]) : 0;
    if (byte < 0x20 || byte == 0x7F) {
      out += std::string("\\x") + kHex[byte >> 4] + kHex[byte & 0xF];
    } else if (byte == 0xC2 && next >= 0x80 && next <= 0x9F) {  // U+0080..U+009F in UTF-8
      out += std::string("\\u00") + kHex[next >> 4] + kHex[next & 0xF];
      ++i;
    } else {
      out += text[i];
    }
  }
  return out;
}

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
    return printable(out + (out.empty() ? "" : ": ") + what);
  }
  std::string file_;
  std::string key_;
};

// The output location cannot take a result (a full disk, a read-only file
// system, a quota, a name taken by a directory): `file` is the output path,
// the message the reason. Exit 2 like bad input: the user must free space or
// choose another --out; nothing half-written is left.
class OutputError : public InputError {
 public:
  OutputError(std::string file, const std::string& what) : InputError(std::move(file), "", what) {}
};

// Bad command-line usage (unknown flag, missing argument).
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A stop request (SIGINT/SIGTERM) honoured at a safe point, with nothing
// half-written: what() is the one line to print after "nanreplay: "
// ("interrupted after 2 of 4 steps; nothing was written"). Thrown by the
// replay loops and the commands, caught once at the CLI boundary: exit 130.
class Interrupted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace nanreplay
