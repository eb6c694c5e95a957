// The one place every byte the CLI prints passes through (run_cli wraps
// CommandIo's two streams): text from a bundle — a path, a key, a tensor
// name, a symptom — can hold control characters, and printed raw an OSC or
// CSI sequence retitles, recolours or rewrites the user's terminal. Renderers
// still escape what they quote (loaders/base/error.h's printable); this guard makes
// a renderer that forgets harmless.
//
// Passed through: printable ASCII, UTF-8 other than C1 controls, '\n' and
// '\t'. Where the stream is a terminal we draw on ('allow_terminal_codes':
// colour on stdout, the progress line on stderr) also '\r' and the two CSI
// forms the tool itself writes, SGR "ESC [ digits;... m" and "ESC [ K".
// Everything else is written as \u00NN: readable, and inside the JSON that
// --json prints a valid escape of the same character (nlohmann leaves DEL
// and the C1 controls raw), so the output stays valid JSON.
#pragma once

#include <ostream>
#include <streambuf>
#include <string>

namespace nanreplay {

class TerminalSafeBuffer : public std::streambuf {
 public:
  TerminalSafeBuffer(std::streambuf* target, bool allow_terminal_codes);
  ~TerminalSafeBuffer() override;
  TerminalSafeBuffer(const TerminalSafeBuffer&) = delete;
  TerminalSafeBuffer& operator=(const TerminalSafeBuffer&) = delete;

 protected:
  int_type overflow(int_type ch) override;
  std::streamsize xsputn(const char* text, std::streamsize count) override;
  int sync() override;

 private:
  void put(unsigned char byte);
  void put_plain(unsigned char byte);
  void finish_escape(unsigned char byte);
  void write_raw(const std::string& text);
  void write_escaped(unsigned char byte);
  void abandon_pending();

  std::streambuf* target_;
  bool allow_terminal_codes_;
  std::string pending_;  // an ESC sequence or a 0xC2 lead byte not yet complete
};

// An ostream over a TerminalSafeBuffer; flushes through to `target` when destroyed.
class TerminalSafeStream : public std::ostream {
 public:
  TerminalSafeStream(std::ostream& target, bool allow_terminal_codes);
  ~TerminalSafeStream() override;

 private:
  TerminalSafeBuffer buffer_;
  std::ostream& target_;
};

// `text` with every byte the guard would not pass escaped, no terminal codes
// allowed: for a line that leaves through another way (a signal handler's write).
std::string terminal_safe(const std::string& text);

}  // namespace nanreplay
