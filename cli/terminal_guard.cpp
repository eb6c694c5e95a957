// The CLI's output guard; see terminal_guard.h.
#include "cli/terminal_guard.h"

#include <sstream>

namespace nanreplay {

namespace {

constexpr unsigned char kEscape = 0x1B;
constexpr unsigned char kC1Lead = 0xC2;  // U+0080..U+009F are 0xC2 0x80..0x9F in UTF-8
constexpr size_t kLongestCode = 16;      // "ESC[1;31m" and kin; longer is not ours
constexpr char kHex[] = "0123456789abcdef";

bool is_code_parameter(unsigned char byte) { return (byte >= '0' && byte <= '9') || byte == ';'; }

}  // namespace

TerminalSafeBuffer::TerminalSafeBuffer(std::streambuf* target, bool allow_terminal_codes)
    : target_(target), allow_terminal_codes_(allow_terminal_codes) {}

// Each round is shorter than the one before: what the replay leaves pending came after the lead.
TerminalSafeBuffer::~TerminalSafeBuffer() {
  while (!pending_.empty()) abandon_pending();
}

TerminalSafeBuffer::int_type TerminalSafeBuffer::overflow(int_type ch) {
  if (traits_type::eq_int_type(ch, traits_type::eof())) return traits_type::not_eof(ch);
  put(static_cast<unsigned char>(traits_type::to_char_type(ch)));
  return ch;
}

std::streamsize TerminalSafeBuffer::xsputn(const char* text, std::streamsize count) {
  for (std::streamsize i = 0; i < count; ++i) put(static_cast<unsigned char>(text[i]));
  return count;
}

// A sequence cut by a flush stays pending: the rest of it comes with the next write.
int TerminalSafeBuffer::sync() { return target_->pubsync(); }

void TerminalSafeBuffer::put(unsigned char byte) {
  if (pending_.empty()) return put_plain(byte);
  if (static_cast<unsigned char>(pending_[0]) == kC1Lead) {
    pending_.clear();
    if (byte >= 0x80 && byte <= 0x9F) {
      write_raw(std::string("\\u00") + kHex[byte >> 4] + kHex[byte & 0xF]);
      return;
    }
    target_->sputc(static_cast<char>(kC1Lead));
    return put(byte);
  }
  finish_escape(byte);
}

void TerminalSafeBuffer::put_plain(unsigned char byte) {
  if (byte == '\n' || byte == '\t' || (byte == '\r' && allow_terminal_codes_)) {
    target_->sputc(static_cast<char>(byte));
  } else if (byte == kEscape && allow_terminal_codes_) {
    pending_.assign(1, static_cast<char>(byte));
  } else if (byte < 0x20 || byte == 0x7F) {
    write_escaped(byte);
  } else if (byte == kC1Lead) {
    pending_.assign(1, static_cast<char>(byte));
  } else {
    target_->sputc(static_cast<char>(byte));
  }
}

// Inside "ESC ...": SGR (ESC [ params m) and erase-line (ESC [ K) pass whole;
// anything else gives up, escaping the ESC and replaying the bytes after it.
void TerminalSafeBuffer::finish_escape(unsigned char byte) {
  pending_ += static_cast<char>(byte);
  const size_t size = pending_.size();
  if (size == 2 && byte == '[') return;
  if (size > 2 && size < kLongestCode && is_code_parameter(byte)) return;
  if (size > 2 && (byte == 'm' || (byte == 'K' && size == 3))) {
    write_raw(pending_);
    pending_.clear();
    return;
  }
  abandon_pending();
}

void TerminalSafeBuffer::abandon_pending() {
  if (pending_.empty()) return;
  const std::string rest = pending_.substr(1);
  const auto lead = static_cast<unsigned char>(pending_[0]);
  pending_.clear();
  if (lead == kEscape) {
    write_escaped(lead);
  } else {
    target_->sputc(static_cast<char>(lead));
  }
  for (const char c : rest) put(static_cast<unsigned char>(c));
}

void TerminalSafeBuffer::write_raw(const std::string& text) {
  target_->sputn(text.data(), static_cast<std::streamsize>(text.size()));
}

// \u00NN, not printable()'s \xNN: inside a JSON string (--json output) it is
// a valid escape of the same character, so JSON stays JSON.
void TerminalSafeBuffer::write_escaped(unsigned char byte) {
  write_raw(std::string("\\u00") + kHex[byte >> 4] + kHex[byte & 0xF]);
}

TerminalSafeStream::TerminalSafeStream(std::ostream& target, bool allow_terminal_codes)
    : std::ostream(nullptr), buffer_(target.rdbuf(), allow_terminal_codes), target_(target) {
  rdbuf(&buffer_);
}

TerminalSafeStream::~TerminalSafeStream() { flush(); }

std::string terminal_safe(const std::string& text) {
  std::ostringstream out;
  {
    TerminalSafeStream safe(out, false);
    safe << text;
  }
  return out.str();
}

}  // namespace nanreplay
