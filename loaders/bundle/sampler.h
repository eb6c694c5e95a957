// Which dataset samples each rank reads at each step: PyTorch's
// DistributedSampler (drop_last) over torch.randperm with a seeded CPU
// generator (mt19937, bit for bit as PyTorch 1.13), or explicit lists.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "loaders/bundle/manifest.h"

namespace nanreplay {

// torch.randperm(n, generator=torch.Generator().manual_seed(seed)) on CPU.
std::vector<int64_t> torch_randperm(int64_t n, uint64_t seed);

// Per-rank sample indices of one step: result[rank] has
// micro_batch_size * grad_accum_steps entries; micro-batch m is the m-th run
// of micro_batch_size. Throws InputError(manifest_label, key, ...) when the
// step lies outside the epoch or explicit lists have the wrong shape or
// indices outside [0, num_samples). Keeps its own copy of the data config.
class StepSampler {
 public:
  StepSampler(const Manifest& manifest, int64_t num_samples, std::string manifest_label);

  // What the run actually read: the entry's explicit samples when it carries
  // them (whatever the sampler kind), otherwise the randperm sampler's.
  std::vector<std::vector<int64_t>> samples_for(const StepEntry& entry) const;
  // randperm only: what the randperm sampler says for `step` (for agreement
  // checks). Throws std::logic_error for an explicit sampler.
  std::vector<std::vector<int64_t>> randperm_samples(int64_t step) const;
  // Explicit lists of the entry, validated; empty optional when absent.
  std::optional<std::vector<std::vector<int64_t>>> explicit_samples(const StepEntry& entry) const;

 private:
  // `key` names the manifest entry in errors ("steps[3].step").
  std::vector<std::vector<int64_t>> randperm_slice(int64_t step, const std::string& key) const;

  DataConfig data_;
  int64_t num_samples_;
  std::string label_;
  std::map<int64_t, size_t> manifest_index_of_step_;  // to name "steps[i]" in errors
  std::vector<int64_t> permutation_;  // randperm only, computed once
};

}  // namespace nanreplay
