// Per-sample token profiles and the whole-stream scan. The histogram is an
// open-addressing table reused across samples (generation-stamped, never
// cleared), so a profile costs O(window) whatever the vocabulary size.
#include "probes/data_checks.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

namespace nanreplay {

namespace {

// Token counts of one window at a time. Small vocabularies count into a
// direct table, large ones into an open-addressing table; both are
// generation-stamped so nothing is cleared between windows.
class TokenHistogram {
 public:
  double entropy(const int64_t* tokens, int64_t count) {
    if (count <= 0) return 0.0;
    used_.clear();
    size_t capacity = 4096;
    while (capacity < static_cast<size_t>(count) * 2) capacity <<= 1;
    if (keys_.size() < capacity) {  // sized per window: never grows mid-window
      keys_.assign(capacity, 0);
      counts_.assign(capacity, 0);
      stamps_.assign(capacity, 0);
    }
    ++generation_;
    if (generation_ == 0) reset_stamps();
    for (int64_t i = 0; i < count; ++i) ++*slot_for(static_cast<uint64_t>(tokens[i]));
    if (c_log_c_.size() <= static_cast<size_t>(count)) {
      c_log_c_.resize(static_cast<size_t>(count) + 1);
      for (size_t c = 0; c < c_log_c_.size(); ++c) c_log_c_[c] = c ? static_cast<double>(c) * std::log2(c) : 0.0;
    }
    double sum_c_log_c = 0.0;
    for (uint32_t* counter : used_) sum_c_log_c += c_log_c_[*counter];
    const double n = static_cast<double>(count);
    return std::max(0.0, std::log2(n) - sum_c_log_c / n);
  }

 private:
  static constexpr uint64_t kDirectLimit = 1u << 20;

  uint32_t* slot_for(uint64_t key) {
    if (key < kDirectLimit) {
      if (direct_counts_.size() <= key) {
        const size_t size = std::max<size_t>(static_cast<size_t>(key) + 1, 65536);
        direct_counts_.resize(size, 0);
        direct_stamps_.resize(size, 0);
      }
      if (direct_stamps_[key] != generation_) {
        direct_stamps_[key] = generation_;
        direct_counts_[key] = 0;
        used_.push_back(&direct_counts_[key]);
      }
      return &direct_counts_[key];
    }
    const size_t mask = keys_.size() - 1;
    size_t slot = static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> 17) & mask;
    while (stamps_[slot] == generation_ && keys_[slot] != key) slot = (slot + 1) & mask;
    if (stamps_[slot] != generation_) {
      stamps_[slot] = generation_;
      keys_[slot] = key;
      counts_[slot] = 0;
      used_.push_back(&counts_[slot]);
    }
    return &counts_[slot];
  }

  void reset_stamps() {
    std::fill(direct_stamps_.begin(), direct_stamps_.end(), 0);
    std::fill(stamps_.begin(), stamps_.end(), 0);
    generation_ = 1;
  }

  std::vector<uint32_t> direct_counts_, direct_stamps_;
  std::vector<uint64_t> keys_;
  std::vector<uint32_t> counts_, stamps_;
  std::vector<uint32_t*> used_;
  std::vector<double> c_log_c_;
  uint32_t generation_ = 0;
};

SampleProfile profile_with(TokenHistogram& histogram, const int64_t* tokens, int64_t count) {
  SampleProfile p;
  int64_t run_start = 0;
  for (int64_t i = 1; i <= count; ++i) {
    if (i == count || tokens[i] != tokens[run_start]) {
      if (i - run_start > p.longest_run) {
        p.longest_run = i - run_start;
        p.run_position = run_start;
        p.run_token = tokens[run_start];
      }
      run_start = i;
    }
  }
  p.entropy_bits = histogram.entropy(tokens, count);
  return p;
}

double median_of(std::vector<double>& values) {
  if (values.empty()) return 0.0;
  const size_t mid = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + static_cast<long>(mid), values.end());
  double m = values[mid];
  if (values.size() % 2 == 0) {
    m = (m + *std::max_element(values.begin(), values.begin() + static_cast<long>(mid))) / 2;
  }
  return m;
}

}  // namespace

int64_t DataCheckOptions::repeat_threshold(int64_t seq_len) const {
  if (repeat_run_min > 0) return repeat_run_min;
  return std::clamp<int64_t>(seq_len / 4, 8, 64);
}

SampleProfile profile_tokens(const int64_t* tokens, int64_t count) {
  TokenHistogram histogram;
  return profile_with(histogram, tokens, count);
}

SampleProfile profile_sample(const TokenStream& stream, int64_t sample, int64_t seq_len) {
  std::vector<int64_t> window(static_cast<size_t>(seq_len + 1));
  stream.read(sample * seq_len, seq_len + 1, window.data());
  SampleProfile p = profile_tokens(window.data(), seq_len + 1);
  p.sample = sample;
  return p;
}

double EntropyBaseline::z_below(double entropy) const {
  const double scale = 1.4826 * mad;
  const double gap = median - entropy;
  if (gap <= 0) return 0.0;
  return scale > 0 ? gap / scale : std::numeric_limits<double>::infinity();
}

EntropyBaseline entropy_baseline(std::vector<double> entropies) {
  EntropyBaseline base;
  base.samples = static_cast<int64_t>(entropies.size());
  if (entropies.empty()) return base;
  base.median = median_of(entropies);
  for (double& e : entropies) e = std::fabs(e - base.median);
  base.mad = median_of(entropies);
  return base;
}

EntropyBaseline entropy_baseline(const TokenStream& stream, int64_t seq_len, int64_t max_samples) {
  const int64_t total = stream.num_samples(seq_len);
  const int64_t count = std::min(total, std::max<int64_t>(1, max_samples));
  std::vector<double> entropies;
  entropies.reserve(static_cast<size_t>(count));
  TokenHistogram histogram;
  std::vector<int64_t> window(static_cast<size_t>(seq_len + 1));
  for (int64_t i = 0; i < count; ++i) {
    const int64_t sample = total * i / count;  // an even, deterministic spread
    stream.read(sample * seq_len, seq_len + 1, window.data());
    entropies.push_back(profile_with(histogram, window.data(), seq_len + 1).entropy_bits);
  }
  return entropy_baseline(std::move(entropies));
}

bool is_low_entropy(const SampleProfile& p, const EntropyBaseline& base, const DataCheckOptions& o) {
  return base.samples >= 8 && p.entropy_bits < o.low_entropy_ratio * base.median &&
         base.z_below(p.entropy_bits) > o.low_entropy_z;
}

DataScanResult scan_token_stream(const TokenStream& stream, int64_t seq_len, int64_t vocab_size,
                                 const DataCheckOptions& options, int threads,
                                 const std::function<void(double)>& on_progress) {
  constexpr size_t kMaxListed = 100;
  const auto started = std::chrono::steady_clock::now();
  DataScanResult result;
  result.tokens = stream.total_tokens();
  for (size_t s = 0; s < stream.num_shards(); ++s) {
    result.bytes += static_cast<int64_t>(stream.mapping(s).size());
  }
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  // Out-of-range ids straight from each mapping (vectorizable compares).
  for (size_t s = 0; s < stream.num_shards(); ++s) {
    const ShardSpec& spec = stream.spec(s);
    const uint8_t* raw = stream.mapping(s).data();
    const int64_t n = spec.tokens;
    int64_t count = 0;
    if (spec.dtype == TokenDtype::kUint16 && vocab_size > 65535) continue;
#pragma omp parallel for num_threads(threads) reduction(+ : count) schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      uint32_t token;
      if (spec.dtype == TokenDtype::kUint16) {
        uint16_t t16;
        std::memcpy(&t16, raw + i * 2, 2);
        token = t16;
      } else {
        std::memcpy(&token, raw + i * 4, 4);
      }
      count += static_cast<int64_t>(token) >= vocab_size;
    }
    result.out_of_range_count += count;
    for (int64_t i = 0; count > 0 && i < n && result.out_of_range.size() < kMaxListed; ++i) {
      uint32_t value;
      if (spec.dtype == TokenDtype::kUint16) {
        uint16_t t16;
        std::memcpy(&t16, raw + i * 2, 2);
        value = t16;
      } else {
        std::memcpy(&value, raw + i * 4, 4);
      }
      if (static_cast<int64_t>(value) >= vocab_size) result.out_of_range.push_back({s, i, value});
    }
  }

  // Per-sample profiles, in parallel over contiguous ranges of samples.
  const int64_t samples = stream.num_samples(seq_len);
  result.samples = samples;
  std::vector<float> entropies(static_cast<size_t>(std::max<int64_t>(samples, 0)));
  std::vector<SampleProfile> runs;
  const int64_t threshold = options.repeat_threshold(seq_len);
  std::atomic<int64_t> done{0};
#pragma omp parallel num_threads(threads)
  {
    TokenHistogram histogram;
    std::vector<int64_t> window(static_cast<size_t>(seq_len + 1));
    std::vector<SampleProfile> local_runs;
#pragma omp for schedule(dynamic, 1024)
    for (int64_t sample = 0; sample < samples; ++sample) {
      stream.read(sample * seq_len, seq_len + 1, window.data());
      SampleProfile p = profile_with(histogram, window.data(), seq_len + 1);
      p.sample = sample;
      entropies[static_cast<size_t>(sample)] = static_cast<float>(p.entropy_bits);
      if (p.longest_run >= threshold) local_runs.push_back(p);
      const int64_t finished = ++done;
      if (on_progress && omp_get_thread_num() == 0 && finished % 4096 == 0) {
        on_progress(static_cast<double>(finished) / static_cast<double>(samples));
      }
    }
#pragma omp critical
    runs.insert(runs.end(), local_runs.begin(), local_runs.end());
  }
  std::sort(runs.begin(), runs.end(), [](const SampleProfile& a, const SampleProfile& b) {
    return a.longest_run != b.longest_run ? a.longest_run > b.longest_run : a.sample < b.sample;
  });
  result.repeat_runs = std::move(runs);

  result.baseline = entropy_baseline(std::vector<double>(entropies.begin(), entropies.end()));
  for (int64_t sample = 0; sample < samples; ++sample) {
    SampleProfile p;
    p.sample = sample;
    p.entropy_bits = entropies[static_cast<size_t>(sample)];
    if (is_low_entropy(p, result.baseline, options)) {
      result.low_entropy.push_back(profile_sample(stream, sample, seq_len));
    }
  }
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return result;
}

}  // namespace nanreplay
