// Token shards: flat little-endian uint16/uint32 arrays concatenated, in the
// manifest's order, into one token stream. Read through mmap; each file's size
// must equal tokens * width. Sample i is tokens [i*seq_len, i*seq_len+seq_len+1).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "loaders/bundle/manifest.h"
#include "loaders/base/mapped_file.h"
#include "loaders/base/sha256.h"  // sha256_hex, for the callers of verify_checksums

namespace nanreplay {

struct ShardLocation {
  size_t shard = 0;    // index into the manifest's shard list
  int64_t offset = 0;  // token index within that shard
};

struct ChecksumMismatch {
  std::string shard;  // path as the manifest lists it
  std::string expected;
  std::string actual;
};

class TokenStream {
 public:
  // Maps every shard (paths resolved inside the bundle). Throws InputError
  // naming the shard file when it is missing or its size disagrees with
  // `tokens` ("data/shard_000.bin: data.shards[0].tokens: manifest.json says
  // 100 tokens (200 bytes of uint16) but the file holds 198 bytes"), and
  // InputError(manifest_label, "data.shards[i].path") when the path escapes.
  TokenStream(const std::filesystem::path& bundle_root, const std::vector<ShardSpec>& shards,
              const std::string& manifest_label);

  int64_t total_tokens() const { return total_tokens_; }
  int64_t num_samples(int64_t seq_len) const;  // (total - 1) / seq_len, >= 0
  uint32_t token(int64_t global_index) const;
  ShardLocation locate(int64_t global_index) const;
  int64_t global_index(const ShardLocation& where) const { return starts_[where.shard] + where.offset; }
  // Copies `count` tokens starting at `begin` into `out` (bounds checked).
  void read(int64_t begin, int64_t count, int64_t* out) const;
  // The seq_len + 1 tokens of sample `index` (inputs = first seq_len, targets = last seq_len).
  std::vector<int64_t> sample_tokens(int64_t index, int64_t seq_len) const;

  // Recomputes sha256 of every shard that declares one; returns the mismatches.
  std::vector<ChecksumMismatch> verify_checksums() const;

  size_t num_shards() const { return shards_.size(); }
  const ShardSpec& spec(size_t i) const { return shards_[i]; }
  const MappedFile& mapping(size_t i) const { return maps_[i]; }

 private:
  std::vector<ShardSpec> shards_;
  std::vector<MappedFile> maps_;
  std::vector<int64_t> starts_;  // first global token index of each shard
  int64_t total_tokens_ = 0;
};

}  // namespace nanreplay
