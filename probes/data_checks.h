// The data layer of triage: per-sample profiles (longest run of one token,
// token entropy) against the shard's typical sample (median and MAD over a
// deterministic spread of samples), and the streaming scan behind
// `nanreplay scan-data`. No LibTorch: plain token arrays in, plain data out.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "loaders/bundle/token_shards.h"

namespace nanreplay {

struct DataCheckOptions {
  int64_t repeat_run_min = 0;      // 0: auto, seq_len / 4 clamped to [8, 64]
  double repeat_run_z = 6.0;       // and a robust z-score above the typical sample's longest run
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

// The typical value of a quantity over many samples: median and MAD.
struct RobustBaseline {
  double median = 0.0;
  double mad = 0.0;  // median absolute deviation (unscaled)
  int64_t samples = 0;
  // Robust z-scores of how far `value` lies below / above the median
  // (kMadToSigma x MAD, probes/robust_stats.h; infinite past a zero MAD).
  double z_below(double value) const;
  double z_above(double value) const;
};

RobustBaseline robust_baseline(std::vector<double> values);

// What the stream's own samples look like, over an even, deterministic spread
// of up to `max_samples` of them: a corpus of code or tables has long runs
// and low-entropy lines everywhere, random tokens have neither.
struct DataBaseline {
  RobustBaseline entropy;      // bits
  RobustBaseline longest_run;  // tokens
};
DataBaseline data_baseline(const TokenStream& stream, int64_t seq_len, int64_t max_samples);

bool is_low_entropy(const SampleProfile& p, const RobustBaseline& base, const DataCheckOptions& o);
// A run at least the threshold long and an outlier of the stream's own runs.
bool is_repeat_run(const SampleProfile& p, const RobustBaseline& runs, int64_t seq_len, const DataCheckOptions& o);

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
  RobustBaseline baseline;                    // of the entropy, over every sample
  RobustBaseline run_baseline;                // of the longest run, over a spread of samples
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
