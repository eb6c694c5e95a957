// The data layer of triage: per-sample profiles (longest run of one token,
// token entropy) against the shard's typical sample (median and MAD over a
// deterministic spread of samples), and the streaming scan behind
// `nanreplay scan-data`. No LibTorch: plain token arrays in, plain data out.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "loaders/token_shards.h"

namespace nanreplay {

struct DataCheckOptions {
  int64_t repeat_run_min = 0;      // 0: auto, seq_len / 4 clamped to [8, 64]
  double low_entropy_z = 6.0;      // robust z-score below the typical sample
  double low_entropy_ratio = 0.6;  // and below this fraction of the median entropy
  int64_t baseline_samples = 4096;

  int64_t repeat_threshold(int64_t seq_len) const;
};

struct SampleProfile {
  int64_t sample = -1;
  int64_t longest_run = 0;     // tokens in the longest run of one token
  int64_t run_position = 0;    // where that run starts within the sample window
  int64_t run_token = 0;
  double entropy_bits = 0.0;   // Shannon entropy of the window's token histogram
};

// Profile of one window of `count` token ids.
SampleProfile profile_tokens(const int64_t* tokens, int64_t count);
SampleProfile profile_sample(const TokenStream& stream, int64_t sample, int64_t seq_len);

struct EntropyBaseline {
  double median = 0.0;
  double mad = 0.0;  // median absolute deviation (unscaled)
  int64_t samples = 0;
  // Robust z-score of how far `entropy` lies below the median (1.4826 * MAD scale).
  double z_below(double entropy) const;
};

EntropyBaseline entropy_baseline(const TokenStream& stream, int64_t seq_len, int64_t max_samples);
// From explicit profile entropies (the whole-stream scan).
EntropyBaseline entropy_baseline(std::vector<double> entropies);

bool is_low_entropy(const SampleProfile& p, const EntropyBaseline& base, const DataCheckOptions& o);

struct OutOfRangeToken {
  size_t shard = 0;
  int64_t offset = 0;
  int64_t token = 0;
};

struct DataScanResult {
  int64_t tokens = 0;
  int64_t bytes = 0;
  double seconds = 0.0;
  int64_t out_of_range_count = 0;
  std::vector<OutOfRangeToken> out_of_range;  // the first ones, capped
  EntropyBaseline baseline;
  std::vector<SampleProfile> repeat_runs;     // samples over the threshold
  std::vector<SampleProfile> low_entropy;     // samples flagged low-entropy
  int64_t samples = 0;
};

// Every token id >= vocab_size in the stream: how many, and the first
// `max_listed` in stream order. One pass at memory speed (a max-reduction per
// shard; only a shard that fails it is searched token by token).
struct OutOfRangeTokens {
  int64_t count = 0;
  std::vector<OutOfRangeToken> listed;
};
OutOfRangeTokens find_out_of_range_tokens(const TokenStream& stream, int64_t vocab_size, size_t max_listed);

// Streams every shard through its mapping on `threads` threads.
DataScanResult scan_token_stream(const TokenStream& stream, int64_t seq_len, int64_t vocab_size,
                                 const DataCheckOptions& options, int threads,
                                 const std::function<void(double fraction)>& on_progress = {});

}  // namespace nanreplay
