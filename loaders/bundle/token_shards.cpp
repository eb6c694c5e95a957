// The token stream: every shard the manifest lists, mapped read-only and
// concatenated in order. Key constraint: a shard whose byte size disagrees
// with its declared token count is refused up front (it would silently shift
// every later sample); token reads are bounds checked and little-endian.
#include "loaders/bundle/token_shards.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "loaders/bundle/bundle_paths.h"
#include "loaders/base/error.h"
#include "loaders/base/sha256.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "token shards are little-endian and read with memcpy: a little-endian host is required"
#endif

namespace nanreplay {
namespace {

size_t token_width(TokenDtype dtype) { return dtype == TokenDtype::kUint16 ? 2 : 4; }

const char* token_dtype_name(TokenDtype dtype) {
  return dtype == TokenDtype::kUint16 ? "uint16" : "uint32";
}

std::string shard_key(size_t index) { return "data.shards[" + std::to_string(index) + "]"; }

void check_shard_size(const MappedFile& map, const ShardSpec& spec, size_t index,
                      const std::string& manifest_label) {
  uint64_t expected = 0;
  const bool overflow = __builtin_mul_overflow(static_cast<uint64_t>(spec.tokens),
                                               static_cast<uint64_t>(token_width(spec.dtype)),
                                               &expected);
  if (overflow || expected != map.size()) {
    throw InputError(spec.path, shard_key(index) + ".tokens",
                     manifest_label + " says " + std::to_string(spec.tokens) + " tokens (" +
                         (overflow ? std::string("more than 2^64") : std::to_string(expected)) +
                         " bytes of " + token_dtype_name(spec.dtype) +
                         ") but the file holds " + std::to_string(map.size()) + " bytes");
  }
}

uint32_t read_token(const MappedFile& map, TokenDtype dtype, int64_t offset) {
  if (dtype == TokenDtype::kUint16) {
    uint16_t value = 0;
    std::memcpy(&value, map.data() + offset * 2, sizeof value);
    return value;
  }
  uint32_t value = 0;
  std::memcpy(&value, map.data() + offset * 4, sizeof value);
  return value;
}

}  // namespace

TokenStream::TokenStream(const std::filesystem::path& bundle_root,
                         const std::vector<ShardSpec>& shards, const std::string& manifest_label)
    : shards_(shards) {
  for (size_t i = 0; i < shards_.size(); ++i) {
    const ShardSpec& spec = shards_[i];
    const std::filesystem::path path =
        resolve_in_bundle(bundle_root, spec.path, manifest_label, shard_key(i) + ".path");
    // Errors opening the file name it as the manifest lists it.
    maps_.emplace_back(path.string(), spec.path);
    check_shard_size(maps_.back(), spec, i, manifest_label);
    starts_.push_back(total_tokens_);
    if (__builtin_add_overflow(total_tokens_, spec.tokens, &total_tokens_)) {
      throw InputError(manifest_label, shard_key(i) + ".tokens",
                       "expected a total token count that fits a 64-bit integer");
    }
  }
}

int64_t TokenStream::num_samples(int64_t seq_len) const {
  if (seq_len <= 0) throw std::invalid_argument("num_samples: seq_len must be positive");
  return total_tokens_ > 0 ? (total_tokens_ - 1) / seq_len : 0;
}

ShardLocation TokenStream::locate(int64_t global_index) const {
  if (global_index < 0 || global_index >= total_tokens_) {
    throw std::out_of_range("token index " + std::to_string(global_index) +
                            " outside the stream of " + std::to_string(total_tokens_));
  }
  const auto after = std::upper_bound(starts_.begin(), starts_.end(), global_index);
  const size_t shard = static_cast<size_t>(after - starts_.begin()) - 1;
  return ShardLocation{shard, global_index - starts_[shard]};
}

uint32_t TokenStream::token(int64_t global_index) const {
  const ShardLocation where = locate(global_index);
  return read_token(maps_[where.shard], shards_[where.shard].dtype, where.offset);
}

void TokenStream::read(int64_t begin, int64_t count, int64_t* out) const {
  if (begin < 0 || count < 0 || begin > total_tokens_ || count > total_tokens_ - begin) {
    throw std::out_of_range("token range [" + std::to_string(begin) + ", +" +
                            std::to_string(count) + ") outside the stream of " +
                            std::to_string(total_tokens_));
  }
  if (count == 0) return;
  ShardLocation where = locate(begin);
  while (count > 0) {
    const ShardSpec& spec = shards_[where.shard];
    const int64_t run = std::min(count, spec.tokens - where.offset);
    // One tight loop per width: this is the hot path of scan-data.
    const uint8_t* base = maps_[where.shard].data();
    if (spec.dtype == TokenDtype::kUint16) {
      for (int64_t k = 0; k < run; ++k) {
        uint16_t value;
        std::memcpy(&value, base + (where.offset + k) * 2, sizeof value);
        out[k] = value;
      }
    } else {
      for (int64_t k = 0; k < run; ++k) {
        uint32_t value;
        std::memcpy(&value, base + (where.offset + k) * 4, sizeof value);
        out[k] = value;
      }
    }
    out += run;
    count -= run;
    where = ShardLocation{where.shard + 1, 0};  // samples may straddle shards
  }
}

std::vector<int64_t> TokenStream::sample_tokens(int64_t index, int64_t seq_len) const {
  if (index < 0 || index >= num_samples(seq_len)) {
    throw std::out_of_range("sample " + std::to_string(index) + " outside [0, " +
                            std::to_string(num_samples(seq_len)) + ")");
  }
  std::vector<int64_t> tokens(static_cast<size_t>(seq_len + 1));
  read(index * seq_len, seq_len + 1, tokens.data());
  return tokens;
}

std::vector<ChecksumMismatch> TokenStream::verify_checksums() const {
  std::vector<ChecksumMismatch> mismatches;
  for (size_t i = 0; i < shards_.size(); ++i) {
    if (!shards_[i].sha256) continue;
    std::string actual = sha256_hex(maps_[i].data(), maps_[i].size());
    if (actual != *shards_[i].sha256) {
      mismatches.push_back(ChecksumMismatch{shards_[i].path, *shards_[i].sha256, std::move(actual)});
    }
  }
  return mismatches;
}

}  // namespace nanreplay
