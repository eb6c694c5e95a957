// The integrity block of trace.h5; layout in trace_integrity.h.
#include "reports/outputs/trace/trace_integrity.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "loaders/base/error.h"
#include "loaders/base/sha256.h"

namespace nanreplay {

namespace {

constexpr char kMagic[] = "nanreplay.trace integrity 1\n";
constexpr char kLengthKey[] = "length ";
constexpr char kShaKey[] = "sha256 ";
constexpr size_t kLengthDigits = 20;
constexpr size_t kShaDigits = 64;
constexpr size_t kMagicBytes = sizeof kMagic - 1;
constexpr size_t kLengthAt = kMagicBytes + sizeof kLengthKey - 1;
constexpr size_t kShaLineAt = kLengthAt + kLengthDigits + 1;
constexpr size_t kShaAt = kShaLineAt + sizeof kShaKey - 1;
constexpr size_t kBlockTextBytes = kShaAt + kShaDigits + 1;
static_assert(kBlockTextBytes <= kTraceIntegrityBlockBytes, "the block text must fit the userblock");

// HDF5's file signature; a trace without the block starts with it.
constexpr unsigned char kHdf5Signature[8] = {0x89, 'H', 'D', 'F', '\r', '\n', 0x1a, '\n'};

const char* const kRegenerate = "regenerate it with `nanreplay run`";

}  // namespace

std::string trace_integrity_block(uint64_t length, const std::string& sha256_hex) {
  char digits[kLengthDigits + 1];
  std::snprintf(digits, sizeof digits, "%020llu", static_cast<unsigned long long>(length));
  std::string block = std::string(kMagic) + kLengthKey + digits + "\n" + kShaKey + sha256_hex + "\n";
  block.resize(kTraceIntegrityBlockBytes, '\0');
  return block;
}

void seal_trace_image(std::vector<uint8_t>& file) {
  if (file.size() < kTraceIntegrityBlockBytes) throw std::logic_error("seal_trace_image: no room for the block");
  const size_t length = file.size() - kTraceIntegrityBlockBytes;
  const std::string block =
      trace_integrity_block(length, sha256_hex(file.data() + kTraceIntegrityBlockBytes, length));
  std::memcpy(file.data(), block.data(), block.size());
}

void verify_trace_image(const uint8_t* bytes, size_t size, const std::string& label) {
  const auto refuse = [&](const std::string& what) { throw InputError(label, "", what); };
  if (size >= sizeof kHdf5Signature && std::memcmp(bytes, kHdf5Signature, sizeof kHdf5Signature) == 0) {
    refuse("an HDF5 file without nanreplay's integrity block (written by an older nanreplay, or rewritten "
           "by another tool); " + std::string(kRegenerate));
  }
  if (size < kTraceIntegrityBlockBytes || std::memcmp(bytes, kMagic, kMagicBytes) != 0) {
    refuse("not an HDF5 file nanreplay wrote (it lacks the integrity block a trace starts with); expected a "
           "trace.h5 written by `nanreplay run`");
  }
  const auto text = reinterpret_cast<const char*>(bytes);
  const auto all_of = [&](size_t at, size_t count, const char* allowed) {
    for (size_t i = at; i < at + count; ++i) {
      if (text[i] == '\0' || std::strchr(allowed, text[i]) == nullptr) return false;
    }
    return true;
  };
  const bool well_formed =
      std::memcmp(text + kMagicBytes, kLengthKey, sizeof kLengthKey - 1) == 0 &&
      all_of(kLengthAt, kLengthDigits, "0123456789") && text[kLengthAt + kLengthDigits] == '\n' &&
      std::memcmp(text + kShaLineAt, kShaKey, sizeof kShaKey - 1) == 0 &&
      all_of(kShaAt, kShaDigits, "0123456789abcdef") && text[kShaAt + kShaDigits] == '\n' &&
      std::all_of(bytes + kBlockTextBytes, bytes + kTraceIntegrityBlockBytes, [](uint8_t b) { return b == 0; });
  if (!well_formed) refuse("damaged: its integrity block (the first 512 bytes) is malformed; " + std::string(kRegenerate));
  unsigned long long length = 0;
  for (size_t i = kLengthAt; i < kLengthAt + kLengthDigits; ++i) {
    const unsigned long long digit = static_cast<unsigned long long>(text[i] - '0');
    if (length > (~0ULL - digit) / 10) refuse("damaged: its integrity block gives an impossible length");
    length = length * 10 + digit;
  }
  const size_t actual = size - kTraceIntegrityBlockBytes;
  if (length != actual) {
    refuse(std::string(actual < length ? "truncated" : "damaged") + ": its integrity block says " +
           std::to_string(length) + " bytes follow it, the file has " + std::to_string(actual) +
           (actual < length ? " (an incomplete copy?); " : "; ") + kRegenerate);
  }
  const std::string digest = sha256_hex(bytes + kTraceIntegrityBlockBytes, actual);
  // Compared without a comparison per byte: a coverage-guided fuzzer reads the
  // expected digest out of memcmp and forges a valid block within seconds,
  // which no corruption in the field can do.
  unsigned difference = 0;
  for (size_t i = 0; i < kShaDigits; ++i) difference |= static_cast<unsigned>(digest[i] ^ text[kShaAt + i]);
  if (difference != 0) {
    refuse("damaged: its SHA-256 differs from the one in its integrity block (corrupted in transit, or edited "
           "after nanreplay wrote it); " + std::string(kRegenerate));
  }
}

}  // namespace nanreplay
