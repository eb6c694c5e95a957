// The per-run secret; see run_secret.h.
#include "replay/step/ranks/run_secret.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include "loaders/base/error.h"

namespace nanreplay {

namespace {
constexpr size_t kSecretBytes = 32;
constexpr size_t kShortestSecret = 16;
constexpr size_t kLongestSecret = 4096;

std::string secret_file_error(const std::string& path, const std::string& what) {
  return printable("--secret-file " + path + ": " + what);
}
}  // namespace

std::string new_run_secret() {
  std::string secret(kSecretBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(secret.data()), static_cast<int>(secret.size())) != 1) {
    throw std::runtime_error("cannot draw a random secret for the processes of this replay");
  }
  return secret;
}

std::string read_secret_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw UsageError(secret_file_error(path, std::strerror(errno)));
  struct stat info {};
  std::string secret;
  std::string problem;
  if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    problem = "not a regular file";
  } else if ((info.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    // As ssh with a private key: a secret others can read proves nothing.
    problem = "other users can read or write it (chmod 600 it)";
  } else if (static_cast<size_t>(info.st_size) > kLongestSecret) {
    problem = "longer than 4096 bytes";
  } else {
    secret.resize(static_cast<size_t>(info.st_size));
    const ssize_t got = ::read(fd, secret.data(), secret.size());
    if (got != static_cast<ssize_t>(secret.size())) problem = "cannot read it";
  }
  ::close(fd);
  if (!problem.empty()) throw UsageError(secret_file_error(path, problem));
  while (!secret.empty() && (secret.back() == '\n' || secret.back() == '\r' || secret.back() == ' ')) secret.pop_back();
  if (secret.size() < kShortestSecret) {
    throw UsageError(secret_file_error(path, "shorter than 16 bytes (head -c 32 /dev/urandom | base64 makes one)"));
  }
  return secret;
}

std::string hmac_sha256(const std::string& key, const std::string& message) {
  unsigned char tag[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
           reinterpret_cast<const unsigned char*>(message.data()), message.size(), tag, &length) == nullptr) {
    throw std::runtime_error("HMAC-SHA256 failed");
  }
  return std::string(reinterpret_cast<const char*>(tag), length);
}

std::string sha256(const void* data, size_t size) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (EVP_Digest(data, size, digest, &length, EVP_sha256(), nullptr) != 1) throw std::runtime_error("SHA-256 failed");
  return std::string(reinterpret_cast<const char*>(digest), length);
}

bool same_tag(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string to_hex(const std::string& bytes) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) out += std::string{kHex[c >> 4], kHex[c & 0xF]};
  return out;
}

std::string from_hex(const std::string& hex) {
  auto digit = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1; };
  if (hex.size() % 2 != 0) return {};
  std::string out;
  for (size_t i = 0; i < hex.size(); i += 2) {
    const int high = digit(hex[i]), low = digit(hex[i + 1]);
    if (high < 0 || low < 0) return {};
    out += static_cast<char>(high * 16 + low);
  }
  return out;
}

}  // namespace nanreplay
