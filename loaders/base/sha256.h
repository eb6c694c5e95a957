// SHA-256 (OpenSSL) for shard checksums and the trace's integrity block.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace nanreplay {

// Lower-case hex SHA-256 of a byte buffer.
std::string sha256_hex(const uint8_t* data, size_t size);

// The same over bytes that arrive in pieces (a file read back in blocks).
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(const uint8_t* data, size_t size);
  std::string hex_digest();  // once, after the last update

 private:
  struct Context;
  std::unique_ptr<Context> context_;
};

}  // namespace nanreplay
