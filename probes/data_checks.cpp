// Per-sample token profiles and the whole-stream scan. A profile costs
// O(window) whatever the vocabulary size, and the scan reads each window in
// place from its shard's mapping (no copy, no widening to int64): on a
// cached shard the scan must outrun the disk, so the per-token work is one
// compare for runs and one table increment for the entropy.
#include "probes/data_checks.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "probes/robust_stats.h"

namespace nanreplay {

namespace {

// Token counts of one window at a time, for its entropy. Ids below
// kDirectLimit count into a direct table; the same pass adds each increment's
// change of sum(c * log2 c) (a table lookup by the old count), and a second,
// store-only pass over the (L1-resident) window zeroes the table again, so
// nothing is cleared or stamped per id. Larger ids (rare: only uint32 shards
// with huge vocabularies) are sorted and counted in runs.
class TokenHistogram {
 public:
  template <typename Token>
  double entropy(const Token* tokens, int64_t count) {
    if (count <= 0) return 0.0;
    grow_tables(count);
    // uint16 ids all fit a 65536-entry table: no bounds check per token.
    constexpr bool kSmallIds = sizeof(Token) <= 2;
    if (kSmallIds && direct_.size() < 65536) direct_.resize(65536, 0);
    large_.clear();
    // Four accumulators, so no floating-point add waits on the previous one.
    double sums[4] = {0.0, 0.0, 0.0, 0.0};
    for (int64_t i = 0; i < count; ++i) {
      const uint64_t id = static_cast<uint64_t>(tokens[i]);
      if (kSmallIds || id < kDirectLimit) {
        if (!kSmallIds && id >= direct_.size()) direct_.resize(std::max<size_t>(id + 1, 65536), 0);
        sums[i & 3] += c_log_c_step_[direct_[id]++];
      } else {
        large_.push_back(id);
      }
    }
    for (int64_t i = 0; i < count; ++i) {
      const uint64_t id = static_cast<uint64_t>(tokens[i]);
      if (kSmallIds || id < kDirectLimit) direct_[id] = 0;
    }
    double sum_c_log_c = (sums[0] + sums[1]) + (sums[2] + sums[3]);
    if (!large_.empty()) {
      std::sort(large_.begin(), large_.end());
      size_t run_start = 0;
      for (size_t i = 1; i <= large_.size(); ++i) {
        if (i < large_.size() && large_[i] == large_[run_start]) continue;
        const double c = static_cast<double>(i - run_start);
        sum_c_log_c += c * std::log2(c);
        run_start = i;
      }
    }
    const double n = static_cast<double>(count);
    return std::max(0.0, std::log2(n) - sum_c_log_c / n);
  }

 private:
  static constexpr uint64_t kDirectLimit = 1u << 20;

  // c_log_c_step_[c] = (c + 1) log2(c + 1) - c log2(c): what one more
  // occurrence of an id seen c times adds, for every count a window can reach.
  void grow_tables(int64_t count) {
    if (c_log_c_step_.size() >= static_cast<size_t>(count)) return;
    c_log_c_step_.resize(static_cast<size_t>(count));
    auto c_log_c = [](double c) { return c > 0 ? c * std::log2(c) : 0.0; };
    for (size_t c = 0; c < c_log_c_step_.size(); ++c) {
      c_log_c_step_[c] = c_log_c(static_cast<double>(c + 1)) - c_log_c(static_cast<double>(c));
    }
  }

  std::vector<uint32_t> direct_;
  std::vector<double> c_log_c_step_;
  std::vector<uint64_t> large_;
};

// Whether the window may hold a run of `min_run` (>= 4) equal tokens: such a
// run starting at i makes tokens[i] equal tokens[i + k] for every k below
// min_run, so a window where no i passes four of those equalities (spread
// over the run) has none. Vectorizes (compares and ors, no branch); on text
// almost no window passes, which leaves the exact run count to the rare one
// that does. (Eight equalities filter more but cost more than they save.)
template <typename Token>
bool may_hold_run(const Token* tokens, int64_t count, int64_t min_run) {
  const int64_t last = min_run - 1;
  if (count < min_run) return false;
  const int64_t a = last / 4, b = last / 2, c = last - last / 4;
  unsigned hit = 0;
  for (int64_t i = 0; i + last < count; ++i) {
    const Token t = tokens[i];
    hit |= static_cast<unsigned>((t == tokens[i + a]) & (t == tokens[i + b]) & (t == tokens[i + c]) &
                                 (t == tokens[i + last]));
  }
  return hit != 0;
}

// Longest run and entropy of one window. With `report_runs_from` > 0 the run
// is only counted when the window may hold one at least that long; otherwise
// longest_run is left 0 ("shorter than that"), which is all a scan needs.
template <typename Token>
SampleProfile profile_with(TokenHistogram& histogram, const Token* tokens, int64_t count,
                           int64_t report_runs_from = 0) {
  SampleProfile p;
  if (count <= 0) return p;
  p.entropy_bits = histogram.entropy(tokens, count);
  if (report_runs_from >= 4 && !may_hold_run(tokens, count, report_runs_from)) return p;
  // Branch-free: on real text a run ends at almost every token, but not
  // predictably enough for a branch per token.
  int64_t run = 1, longest = 1, longest_end = 0;
  for (int64_t i = 1; i < count; ++i) {
    run = tokens[i] == tokens[i - 1] ? run + 1 : 1;
    const bool longer = run > longest;
    longest = longer ? run : longest;
    longest_end = longer ? i : longest_end;
  }
  p.longest_run = longest;
  p.run_position = longest_end - longest + 1;
  p.run_token = static_cast<int64_t>(tokens[longest_end]);
  return p;
}

// Calls fn(mapping, first byte, byte count) for each shard's part of the
// global token range [begin, end).
template <typename Fn>
void for_each_piece(const TokenStream& stream, int64_t begin, int64_t end, Fn&& fn) {
  while (begin < end) {
    const ShardLocation where = stream.locate(begin);
    const ShardSpec& spec = stream.spec(where.shard);
    const int64_t count = std::min(end - begin, spec.tokens - where.offset);
    const size_t width = spec.dtype == TokenDtype::kUint16 ? 2 : 4;
    fn(stream.mapping(where.shard), static_cast<size_t>(where.offset) * width,
       static_cast<size_t>(count) * width);
    begin += count;
  }
}

template <typename Token>
Token largest_token(const Token* tokens, int64_t count) {
  Token largest = 0;  // a max-reduction vectorizes; counting is only done when it fails
  for (int64_t i = 0; i < count; ++i) largest = std::max(largest, tokens[i]);
  return largest;
}

template <typename Token>
void count_out_of_range(const Token* tokens, size_t shard, int64_t offset, int64_t count,
                        int64_t vocab_size, size_t max_listed, int64_t& total,
                        std::vector<OutOfRangeToken>& listed) {
  if (static_cast<int64_t>(largest_token(tokens + offset, count)) < vocab_size) return;
  for (int64_t i = offset; i < offset + count; ++i) {
    if (static_cast<int64_t>(tokens[i]) < vocab_size) continue;
    ++total;
    if (listed.size() < max_listed) listed.push_back({shard, i, static_cast<int64_t>(tokens[i])});
  }
}

// Out-of-range ids in the global token range [begin, end), straight from the mappings.
void count_out_of_range(const TokenStream& stream, int64_t begin, int64_t end, int64_t vocab_size,
                        size_t max_listed, int64_t& total, std::vector<OutOfRangeToken>& listed) {
  while (begin < end) {
    const ShardLocation where = stream.locate(begin);
    const ShardSpec& spec = stream.spec(where.shard);
    const int64_t count = std::min(end - begin, spec.tokens - where.offset);
    const uint8_t* raw = stream.mapping(where.shard).data();
    if (spec.dtype == TokenDtype::kUint16) {
      count_out_of_range(reinterpret_cast<const uint16_t*>(raw), where.shard, where.offset, count,
                         vocab_size, max_listed, total, listed);
    } else {
      count_out_of_range(reinterpret_cast<const uint32_t*>(raw), where.shard, where.offset, count,
                         vocab_size, max_listed, total, listed);
    }
    begin += count;
  }
}

// The sample's profile read straight from its shard's mapping when the
// window lies inside one shard (the common case); through `window` when it
// straddles two shards.
SampleProfile profile_in_place(const TokenStream& stream, int64_t sample, int64_t seq_len,
                               TokenHistogram& histogram, std::vector<int64_t>& window,
                               int64_t report_runs_from) {
  const int64_t count = seq_len + 1;
  const ShardLocation where = stream.locate(sample * seq_len);
  const ShardSpec& spec = stream.spec(where.shard);
  if (where.offset + count <= spec.tokens) {
    // mmap returns page-aligned memory, so every token is naturally aligned.
    const uint8_t* base = stream.mapping(where.shard).data();
    if (spec.dtype == TokenDtype::kUint16) {
      return profile_with(histogram, reinterpret_cast<const uint16_t*>(base) + where.offset, count,
                          report_runs_from);
    }
    return profile_with(histogram, reinterpret_cast<const uint32_t*>(base) + where.offset, count,
                        report_runs_from);
  }
  stream.read(sample * seq_len, count, window.data());
  return profile_with(histogram, window.data(), count, report_runs_from);
}

// A block of the scan: its samples, the tokens whose ids it checks (every
// token in exactly one block; the last also takes the tail no sample covers)
// and the end of the tokens its samples read (one more, into the next range).
struct BlockSpan {
  int64_t first_sample, end_sample;
  int64_t begin, ids_end;
  int64_t read_end;
};

struct BlockLayout {
  int64_t samples, samples_per_block, blocks, tokens, seq_len;

  BlockSpan span(int64_t block) const {
    BlockSpan s;
    s.first_sample = block * samples_per_block;
    s.end_sample = std::min(samples, s.first_sample + samples_per_block);
    s.begin = std::min(tokens, s.first_sample * seq_len);
    s.ids_end = block + 1 == blocks ? tokens : s.end_sample * seq_len;
    s.read_end = std::max(s.ids_end, std::min(tokens, s.end_sample * seq_len + 1));
    return s;
  }
};

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

double RobustBaseline::z_below(double value) const {
  const double scale = kMadToSigma * mad;
  const double gap = median - value;
  if (gap <= 0) return 0.0;
  return scale > 0 ? gap / scale : std::numeric_limits<double>::infinity();
}

double RobustBaseline::z_above(double value) const { return RobustBaseline{-median, mad, samples}.z_below(-value); }

RobustBaseline robust_baseline(std::vector<double> values) {
  RobustBaseline base;
  base.samples = static_cast<int64_t>(values.size());
  if (values.empty()) return base;
  base.median = median_of(values);
  for (double& e : values) e = std::fabs(e - base.median);
  base.mad = median_of(values);
  return base;
}

DataBaseline data_baseline(const TokenStream& stream, int64_t seq_len, int64_t max_samples) {
  const int64_t total = stream.num_samples(seq_len);
  const int64_t count = std::min(total, std::max<int64_t>(1, max_samples));
  std::vector<double> entropies, runs;
  entropies.reserve(static_cast<size_t>(count));
  runs.reserve(static_cast<size_t>(count));
  TokenHistogram histogram;
  std::vector<int64_t> window(static_cast<size_t>(seq_len + 1));
  for (int64_t i = 0; i < count; ++i) {
    const int64_t sample = total * i / count;  // an even, deterministic spread
    stream.read(sample * seq_len, seq_len + 1, window.data());
    const SampleProfile p = profile_with(histogram, window.data(), seq_len + 1);
    entropies.push_back(p.entropy_bits);
    runs.push_back(static_cast<double>(p.longest_run));
  }
  return {robust_baseline(std::move(entropies)), robust_baseline(std::move(runs))};
}

bool is_low_entropy(const SampleProfile& p, const RobustBaseline& base, const DataCheckOptions& o) {
  return base.samples >= 8 && p.entropy_bits < o.low_entropy_ratio * base.median &&
         base.z_below(p.entropy_bits) > o.low_entropy_z;
}

bool is_repeat_run(const SampleProfile& p, const RobustBaseline& runs, int64_t seq_len, const DataCheckOptions& o) {
  return p.longest_run >= o.repeat_threshold(seq_len) &&
         (runs.samples < 8 || runs.z_above(static_cast<double>(p.longest_run)) > o.repeat_run_z);
}

namespace {

// Out-of-range ids listed (all are counted).
constexpr size_t kMaxListed = 100;

// Maps the block in, and has the disk read the block `threads` ahead (the
// next one this thread is likely to take) while this one is profiled.
void map_block_in(const TokenStream& stream, const BlockLayout& layout, int64_t block, int threads) {
  if (block + threads < layout.blocks) {
    const BlockSpan ahead = layout.span(block + threads);
    for_each_piece(stream, ahead.begin, ahead.read_end, [](const MappedFile& map, size_t begin, size_t count) {
      map.read_ahead(begin, count);
    });
  }
  const BlockSpan span = layout.span(block);
  for_each_piece(stream, span.begin, span.read_end, [](const MappedFile& map, size_t begin, size_t count) {
    map.prefault(begin, count);
  });
}

// What the threads collected, ranked: the repeated runs that stand out from the
// stream's own, the stream's first out-of-range ids, the low-entropy samples.
void rank_findings(const TokenStream& stream, int64_t seq_len, const DataCheckOptions& options,
                   std::vector<SampleProfile> runs, const std::vector<float>& entropies, DataScanResult& result) {
  const int64_t samples = static_cast<int64_t>(entropies.size());
  // Runs the stream's own samples commonly hold (indentation, rules in text) are not outliers.
  result.run_baseline = data_baseline(stream, seq_len, options.baseline_samples).longest_run;
  const auto common = [&](const SampleProfile& p) { return !is_repeat_run(p, result.run_baseline, seq_len, options); };
  runs.erase(std::remove_if(runs.begin(), runs.end(), common), runs.end());
  std::sort(runs.begin(), runs.end(), [](const SampleProfile& a, const SampleProfile& b) {
    return a.longest_run != b.longest_run ? a.longest_run > b.longest_run : a.sample < b.sample;
  });
  result.repeat_runs = std::move(runs);
  // Each thread kept its first kMaxListed; the stream's first ones are among them.
  std::sort(result.out_of_range.begin(), result.out_of_range.end(),
            [](const OutOfRangeToken& a, const OutOfRangeToken& b) {
              return a.shard != b.shard ? a.shard < b.shard : a.offset < b.offset;
            });
  if (result.out_of_range.size() > kMaxListed) result.out_of_range.resize(kMaxListed);

  result.baseline = robust_baseline(std::vector<double>(entropies.begin(), entropies.end()));
  for (int64_t sample = 0; sample < samples; ++sample) {
    SampleProfile p;
    p.sample = sample;
    p.entropy_bits = entropies[static_cast<size_t>(sample)];
    if (is_low_entropy(p, result.baseline, options)) {
      result.low_entropy.push_back(profile_sample(stream, sample, seq_len));
    }
  }
}

}  // namespace

DataScanResult scan_token_stream(const TokenStream& stream, int64_t seq_len, int64_t vocab_size,
                                 const DataCheckOptions& options, int threads,
                                 const std::function<void(double)>& on_progress) {
  // Samples per unit of work: a few MB of tokens, large enough for the kernel's
  // batched prefault and readahead, small enough to balance the threads.
  constexpr int64_t kTokensPerBlock = int64_t{1} << 21;
  const auto started = std::chrono::steady_clock::now();
  DataScanResult result;
  result.tokens = stream.total_tokens();
  for (size_t s = 0; s < stream.num_shards(); ++s) {
    result.bytes += static_cast<int64_t>(stream.mapping(s).size());
  }
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  const int64_t samples = stream.num_samples(seq_len);
  result.samples = samples;
  const int64_t samples_per_block = std::max<int64_t>(1, kTokensPerBlock / seq_len);
  const int64_t blocks = std::max<int64_t>(1, (samples + samples_per_block - 1) / samples_per_block);
  const BlockLayout layout{samples, samples_per_block, blocks, result.tokens, seq_len};
  std::vector<float> entropies(static_cast<size_t>(std::max<int64_t>(samples, 0)));
  std::vector<SampleProfile> runs;
  const int64_t threshold = options.repeat_threshold(seq_len);
  std::atomic<int64_t> done{0};
#pragma omp parallel num_threads(threads)
  {
    TokenHistogram histogram;
    std::vector<int64_t> window(static_cast<size_t>(seq_len + 1));
    std::vector<SampleProfile> local_runs;
    std::vector<OutOfRangeToken> local_out_of_range;
    int64_t local_out_of_range_count = 0;
#pragma omp for schedule(dynamic, 1)
    for (int64_t block = 0; block < blocks; ++block) {
      const BlockSpan span = layout.span(block);
      map_block_in(stream, layout, block, threads);
      count_out_of_range(stream, span.begin, span.ids_end, vocab_size, kMaxListed,
                         local_out_of_range_count, local_out_of_range);
      for (int64_t sample = span.first_sample; sample < span.end_sample; ++sample) {
        SampleProfile p = profile_in_place(stream, sample, seq_len, histogram, window, threshold);
        p.sample = sample;
        entropies[static_cast<size_t>(sample)] = static_cast<float>(p.entropy_bits);
        if (p.longest_run >= threshold) local_runs.push_back(p);
      }
      const int64_t finished = done += span.end_sample - span.first_sample;
      if (on_progress && omp_get_thread_num() == 0 && samples > 0) {
        on_progress(static_cast<double>(finished) / static_cast<double>(samples));
      }
    }
#pragma omp critical
    {
      runs.insert(runs.end(), local_runs.begin(), local_runs.end());
      result.out_of_range.insert(result.out_of_range.end(), local_out_of_range.begin(),
                                 local_out_of_range.end());
      result.out_of_range_count += local_out_of_range_count;
    }
  }
  rank_findings(stream, seq_len, options, std::move(runs), entropies, result);
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return result;
}

OutOfRangeTokens find_out_of_range_tokens(const TokenStream& stream, int64_t vocab_size, size_t max_listed) {
  OutOfRangeTokens found;
  count_out_of_range(stream, 0, stream.total_tokens(), vocab_size, max_listed, found.count, found.listed);
  return found;
}

}  // namespace nanreplay
