// trace.h5's integrity block: the first 512 bytes of the file, an HDF5
// userblock (which every HDF5 reader skips, h5py and h5dump included), hold
// the length and SHA-256 of everything after them. A reader checks it before
// any byte reaches HDF5's parser, so a truncated, corrupted or half-copied
// trace ends in one InputError, never in HDF5 (which crashes on some damaged
// files). It detects damage, not forgery: whoever edits a trace can reseal it.
//
//   offset 0    "nanreplay.trace integrity 1\n"
//               "length " + 20 decimal digits (bytes after the block) + "\n"
//               "sha256 " + 64 lower-case hex digits (of those bytes) + "\n"
//   then NUL bytes up to offset 512, where HDF5's superblock begins.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace nanreplay {

constexpr size_t kTraceIntegrityBlockBytes = 512;

// The 512 bytes of the block for `length` bytes whose SHA-256 is `sha256_hex`.
std::string trace_integrity_block(uint64_t length, const std::string& sha256_hex);

// Writes the block for file[512, end) into file[0, 512); file.size() >= 512.
void seal_trace_image(std::vector<uint8_t>& file);

// Throws InputError(label, "", ...) unless `bytes` starts with a well-formed
// block whose length and SHA-256 match the bytes after it.
void verify_trace_image(const uint8_t* bytes, size_t size, const std::string& label);

}  // namespace nanreplay
