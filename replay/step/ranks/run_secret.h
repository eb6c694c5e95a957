// The secret that makes a replay across processes closed to strangers
// (docs/distributed.md, "Who may join"): a launcher makes a fresh one for
// its local processes; processes on several hosts read the same file. Every
// process proves it holds it before any tensor is exchanged, and the values
// that steer the run carry a tag made with it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace nanreplay {

// Where a worker finds the secret its launcher made (hex), and where a
// process started by another launcher (torchrun, srun, by hand) finds the
// path of the file shared by every host.
constexpr const char* kSecretVariable = "NANREPLAY_DIST_SECRET";
constexpr const char* kSecretFileVariable = "NANREPLAY_DIST_SECRET_FILE";

// 32 random bytes from the kernel.
std::string new_run_secret();

// The bytes of a secret file, trailing whitespace removed. UsageError (exit
// 2) naming `path` when it cannot be read, is shorter than 16 bytes, longer
// than 4 KiB, or can be read by other users (the file must be 0600 or 0400).
std::string read_secret_file(const std::string& path);

// HMAC-SHA256 of `message` under `key`: 32 raw bytes.
std::string hmac_sha256(const std::string& key, const std::string& message);
constexpr size_t kHmacTagBytes = 32;  // what hmac_sha256 returns: one SHA-256 digest

// The c10d store holds bytes; the admission and the messages read them as text.
inline std::string as_string(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }
inline std::vector<uint8_t> as_bytes(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }
// SHA-256 of `size` bytes at `data`: 32 raw bytes.
std::string sha256(const void* data, size_t size);
// In constant time: `a` and `b` are the same bytes.
bool same_tag(const std::string& a, const std::string& b);

std::string to_hex(const std::string& bytes);
// The bytes `hex` spells, or empty when it is not hex.
std::string from_hex(const std::string& hex);

}  // namespace nanreplay
