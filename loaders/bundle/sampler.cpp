// Which samples each rank read at each step. Key constraint: torch_randperm
// must equal PyTorch 1.13's CPU torch.randperm bit for bit (checked against
// tests/fixtures/randperm.json, written by torch itself), and the rank/step
// slicing must equal DistributedSampler(drop_last=True) fed to a DataLoader.
#include "loaders/bundle/sampler.h"

#include <random>
#include <stdexcept>
#include <utility>

#include "loaders/base/error.h"

namespace nanreplay {
namespace {

std::string entry_key(size_t manifest_index, const std::string& field) {
  return "steps[" + std::to_string(manifest_index) + "]." + field;
}

}  // namespace

// PyTorch 1.13 (aten/src/ATen/native/TensorFactories.cpp, randperm_cpu):
// r[i] = i, then for i in [0, n-1): z = generator->random() % (n - i);
// swap(r[i], r[z + i]). random() is the next 32-bit mt19937 output, and
// manual_seed(seed) seeds mt19937 with the seed's low 32 bits, which is
// exactly std::mt19937(uint32_t).
std::vector<int64_t> torch_randperm(int64_t n, uint64_t seed) {
  if (n < 0) throw std::invalid_argument("torch_randperm: n must be non-negative");
  std::vector<int64_t> permutation(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) permutation[static_cast<size_t>(i)] = i;
  std::mt19937 generator(static_cast<uint32_t>(seed));
  for (int64_t i = 0; i + 1 < n; ++i) {
    const int64_t z = static_cast<int64_t>(generator() % static_cast<uint64_t>(n - i));
    std::swap(permutation[static_cast<size_t>(i)], permutation[static_cast<size_t>(z + i)]);
  }
  return permutation;
}

StepSampler::StepSampler(const Manifest& manifest, int64_t num_samples,
                         std::string manifest_label)
    : data_(manifest.data), num_samples_(num_samples), label_(std::move(manifest_label)) {
  if (num_samples < 0) throw std::invalid_argument("StepSampler: negative num_samples");
  for (const StepEntry& entry : manifest.steps) {
    manifest_index_of_step_[entry.step] = entry.manifest_index;
  }
  if (data_.sampler.kind == SamplerSpec::Kind::kRandperm) {
    // DistributedSampler seeds with seed + epoch (wrapping like torch's uint64).
    const uint64_t seed = data_.sampler.seed + static_cast<uint64_t>(data_.sampler.epoch);
    permutation_ = torch_randperm(num_samples_, seed);
  }
}

std::vector<std::vector<int64_t>> StepSampler::randperm_samples(int64_t step) const {
  const auto found = manifest_index_of_step_.find(step);
  const std::string key =
      found != manifest_index_of_step_.end() ? entry_key(found->second, "step") : "steps";
  return randperm_slice(step, key);
}

// DistributedSampler(drop_last=True): total = (n / world) * world and rank r
// reads perm[r], perm[r + world], ...; a step reads B consecutive positions.
std::vector<std::vector<int64_t>> StepSampler::randperm_slice(int64_t step,
                                                              const std::string& key) const {
  if (data_.sampler.kind != SamplerSpec::Kind::kRandperm) {
    throw std::logic_error("randperm_samples called for an explicit sampler");
  }
  const int64_t world = data_.world_size;
  const int64_t per_step = data_.samples_per_rank_step();
  const int64_t per_rank = num_samples_ / world;
  const int64_t epoch_start = data_.sampler.epoch_start_step;
  const int64_t steps_in_epoch = per_rank / per_step;
  int64_t epoch_end = 0;  // one past the epoch's last step
  if (__builtin_add_overflow(epoch_start, steps_in_epoch, &epoch_end)) {
    throw InputError(label_, "data.sampler.epoch_start_step",
                     "is " + std::to_string(epoch_start) + ": with " + std::to_string(steps_in_epoch) +
                         " steps per epoch, the epoch would end past the largest step number (2^63 - 1)");
  }
  if (step < epoch_start || step >= epoch_end) {
    throw InputError(
        label_, key,
        "expected a step in [" + std::to_string(epoch_start) + ", " + std::to_string(epoch_end) + ") (epoch " +
            std::to_string(data_.sampler.epoch) + " starts at data.sampler.epoch_start_step " +
            std::to_string(epoch_start) + " and gives each of " + std::to_string(world) +
            " ranks " + std::to_string(per_rank) + " of " + std::to_string(num_samples_) +
            " samples, " + std::to_string(per_step) + " per step), got " +
            std::to_string(step));
  }
  const int64_t first_position = (step - epoch_start) * per_step;
  std::vector<std::vector<int64_t>> samples(static_cast<size_t>(world));
  for (int64_t rank = 0; rank < world; ++rank) {
    auto& list = samples[static_cast<size_t>(rank)];
    list.reserve(static_cast<size_t>(per_step));
    for (int64_t k = 0; k < per_step; ++k) {
      list.push_back(permutation_[static_cast<size_t>((first_position + k) * world + rank)]);
    }
  }
  return samples;
}

std::optional<std::vector<std::vector<int64_t>>> StepSampler::explicit_samples(
    const StepEntry& entry) const {
  if (!entry.samples) return std::nullopt;
  const auto& ranks = *entry.samples;
  const std::string key = entry_key(entry.manifest_index, "samples");
  if (static_cast<int64_t>(ranks.size()) != data_.world_size) {
    throw InputError(label_, key,
                     "expected one list per rank (data.world_size = " +
                         std::to_string(data_.world_size) + "), got " +
                         std::to_string(ranks.size()));
  }
  const int64_t per_step = data_.samples_per_rank_step();
  for (size_t rank = 0; rank < ranks.size(); ++rank) {
    const std::string rank_key = key + "[" + std::to_string(rank) + "]";
    if (static_cast<int64_t>(ranks[rank].size()) != per_step) {
      throw InputError(label_, rank_key,
                       "expected " + std::to_string(per_step) +
                           " sample indices (micro_batch_size * grad_accum_steps), got " +
                           std::to_string(ranks[rank].size()));
    }
    for (size_t j = 0; j < ranks[rank].size(); ++j) {
      const int64_t index = ranks[rank][j];
      if (index < 0 || index >= num_samples_) {
        throw InputError(label_, rank_key + "[" + std::to_string(j) + "]",
                         "expected a sample index in [0, " + std::to_string(num_samples_) +
                             ") (the token stream's sample count), got " + std::to_string(index));
      }
    }
  }
  return ranks;
}

std::vector<std::vector<int64_t>> StepSampler::samples_for(const StepEntry& entry) const {
  if (auto samples = explicit_samples(entry)) return std::move(*samples);
  if (data_.sampler.kind == SamplerSpec::Kind::kExplicit) {
    throw InputError(label_, entry_key(entry.manifest_index, "samples"),
                     "required key is missing (data.sampler.kind is \"explicit\")");
  }
  return randperm_slice(entry.step, entry_key(entry.manifest_index, "step"));
}

}  // namespace nanreplay
