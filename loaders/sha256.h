// SHA-256 (OpenSSL) for shard checksums and the trace's integrity block.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace nanreplay {

// Lower-case hex SHA-256 of a byte buffer.
std::string sha256_hex(const uint8_t* data, size_t size);

}  // namespace nanreplay
