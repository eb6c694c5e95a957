// SHA-256 through OpenSSL's EVP interface; see sha256.h.
#include "loaders/base/sha256.h"

#include <openssl/evp.h>

#include <stdexcept>

namespace nanreplay {

namespace {

std::string hex(const unsigned char* digest, unsigned int size) {
  static const char kHex[] = "0123456789abcdef";
  std::string text;
  text.reserve(size_t{2} * size);
  for (unsigned int i = 0; i < size; ++i) {
    text += kHex[digest[i] >> 4];
    text += kHex[digest[i] & 0xF];
  }
  return text;
}

[[noreturn]] void openssl_failed() { throw std::runtime_error("OpenSSL SHA-256 failed"); }

}  // namespace

std::string sha256_hex(const uint8_t* data, size_t size) {
  Sha256 sha;
  sha.update(data, size);
  return sha.hex_digest();
}

struct Sha256::Context {
  EVP_MD_CTX* md = EVP_MD_CTX_new();
  ~Context() { EVP_MD_CTX_free(md); }
};

Sha256::Sha256() : context_(std::make_unique<Context>()) {
  if (context_->md == nullptr || EVP_DigestInit_ex(context_->md, EVP_sha256(), nullptr) != 1) openssl_failed();
}

Sha256::~Sha256() = default;

void Sha256::update(const uint8_t* data, size_t size) {
  static const uint8_t kEmpty = 0;  // EVP wants a valid pointer even for 0 bytes
  if (EVP_DigestUpdate(context_->md, data != nullptr ? data : &kEmpty, size) != 1) openssl_failed();
}

std::string Sha256::hex_digest() {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  if (EVP_DigestFinal_ex(context_->md, digest, &size) != 1) openssl_failed();
  return hex(digest, size);
}

}  // namespace nanreplay
