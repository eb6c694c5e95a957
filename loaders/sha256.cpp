// SHA-256 through OpenSSL's EVP interface; see sha256.h.
#include "loaders/sha256.h"

#include <openssl/evp.h>

#include <stdexcept>

namespace nanreplay {

std::string sha256_hex(const uint8_t* data, size_t size) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int digest_size = 0;
  static const uint8_t kEmpty = 0;  // EVP wants a valid pointer even for 0 bytes
  if (EVP_Digest(data != nullptr ? data : &kEmpty, size, digest, &digest_size, EVP_sha256(),
                 nullptr) != 1) {
    throw std::runtime_error("OpenSSL SHA-256 failed");
  }
  static const char kHex[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(size_t{2} * digest_size);
  for (unsigned int i = 0; i < digest_size; ++i) {
    hex += kHex[digest[i] >> 4];
    hex += kHex[digest[i] & 0xF];
  }
  return hex;
}

}  // namespace nanreplay
