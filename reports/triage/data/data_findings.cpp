// See data_findings.h.
#include "reports/triage/data/data_findings.h"

#include <algorithm>
#include <cctype>
#include <string>

#include "replay/step/step_scan.h"

namespace nanreplay {

using K = EvidenceKey;

namespace {

constexpr size_t kMaxTokenFindings = 20;  // per step, and outside the batches

}  // namespace

std::vector<Finding> batch_token_findings(const Bundle& bundle, int64_t step, const StepBatch& batch) {
  const Manifest& m = bundle.manifest();
  std::vector<Finding> findings;
  for (const BatchToken& t : out_of_range_in_batch(bundle, batch, kMaxTokenFindings)) {
    const ShardLocation where = bundle.tokens().locate(t.sample * m.data.seq_len + t.position);
    const std::string& shard = bundle.tokens().spec(where.shard).path;
    findings.push_back(make_finding(
        FindingCode::kDataTokenOutOfRange,
        "token id " + std::to_string(t.token) + " >= vocab_size " + std::to_string(m.model.vocab_size) + " in " +
            shard + " at offset " + std::to_string(where.offset) + " (sample " + std::to_string(t.sample) +
            ", position " + std::to_string(t.position) + "); step " + std::to_string(step) + " cannot be replayed",
        {{K::kShard, shard}, {K::kOffset, where.offset}, {K::kStep, step}, {K::kRank, t.rank},
         {K::kSample, t.sample}, {K::kPosition, t.position}, {K::kToken, t.token},
         {K::kExpected, m.model.vocab_size}}));
  }
  return findings;
}

std::vector<Finding> stray_token_findings(const Bundle& bundle, const std::set<int64_t>& batch_samples) {
  const Manifest& m = bundle.manifest();
  const int64_t seq = m.data.seq_len;
  // Listed beyond the cap, so that ids inside batches (already reported) do
  // not crowd out the stray ones.
  const OutOfRangeTokens found = find_out_of_range_tokens(bundle.tokens(), m.model.vocab_size, 4 * kMaxTokenFindings);
  std::vector<Finding> findings;
  for (const OutOfRangeToken& t : found.listed) {
    if (findings.size() == kMaxTokenFindings) break;
    const int64_t global = bundle.tokens().global_index({t.shard, t.offset});
    // Sample i holds tokens [i*seq, i*seq + seq]: the one starting at or
    // before the token, and the previous one when the token is its last target.
    const int64_t sample = global / seq;
    const bool read = batch_samples.count(sample) || (global % seq == 0 && batch_samples.count(sample - 1));
    if (read) continue;
    const std::string& shard = bundle.tokens().spec(t.shard).path;
    Evidence evidence = {{K::kShard, shard}, {K::kOffset, t.offset}, {K::kToken, t.token},
                         {K::kExpected, m.model.vocab_size}};
    const bool in_sample = sample < bundle.num_samples();
    if (in_sample) evidence.set(K::kSample, sample).set(K::kPosition, global % seq);
    findings.push_back(make_finding(
        FindingCode::kDataTokenOutOfRange,
        "token id " + std::to_string(t.token) + " >= vocab_size " + std::to_string(m.model.vocab_size) + " in " +
            shard + " at offset " + std::to_string(t.offset) +
            (in_sample ? " (sample " + std::to_string(sample) + ")" : std::string()) + ", which no replayed step reads (" +
            std::to_string(found.count) + " out-of-range ids in the shards in all)",
        std::move(evidence)));
  }
  return findings;
}

std::vector<Finding> sampler_findings(const Bundle& bundle, const StepEntry& entry) {
  const Manifest& m = bundle.manifest();
  if (m.data.sampler.kind != SamplerSpec::Kind::kRandperm || !entry.samples) return {};
  const auto computed = bundle.sampler().randperm_samples(entry.step);
  const auto recorded = bundle.sampler().explicit_samples(entry);
  if (!recorded || *recorded == computed) return {};
  for (size_t rank = 0; rank < computed.size(); ++rank) {
    const auto& a = computed[rank];
    const auto& b = (*recorded)[rank];
    const auto diff = std::mismatch(a.begin(), a.end(), b.begin(), b.end());
    if (diff.first == a.end()) continue;
    const auto at = static_cast<int64_t>(diff.first - a.begin());
    return {make_finding(
        FindingCode::kDataSamplerMismatch,
        "step " + std::to_string(entry.step) + " rank " + std::to_string(rank) +
            ": the recorded samples disagree with randperm at batch position " + std::to_string(at) + " (recorded " +
            std::to_string(*diff.second) + ", randperm " + std::to_string(*diff.first) +
            "); replaying the recorded samples",
        {{K::kStep, entry.step}, {K::kRank, rank}, {K::kIndex, std::vector<int64_t>{at}},
         {K::kExpected, *diff.first}, {K::kSample, *diff.second}})};
  }
  return {};
}

std::vector<Finding> batch_profile_findings(const Bundle& bundle, int64_t step, const StepBatch& batch,
                                            const DataBaseline& baseline, const DataCheckOptions& options) {
  const int64_t seq = bundle.manifest().data.seq_len;
  std::vector<SampleProfile> profiles;
  for (const auto& rank_samples : batch.samples) {
    for (int64_t sample : rank_samples) profiles.push_back(profile_sample(bundle.tokens(), sample, seq));
  }
  return sample_profile_findings(profiles, baseline, step, seq, options);
}

namespace {

// "the run's sample 7" or "the run's token offset 4096": how the run numbered a bundle sample.
std::string run_numbering_text(const OriginalSample& o) {
  return std::string(o.is_offset ? "the run's token offset " : "the run's sample ") + std::to_string(o.value);
}

// Adds the run's numbering after the first "sample N" of a text for people,
// so a compact bundle's index is never read as the run's.
void name_run_numbering(std::string& text, int64_t sample, const OriginalSample& o) {
  const std::string named = "sample " + std::to_string(sample);
  for (size_t at = text.find(named); at != std::string::npos; at = text.find(named, at + 1)) {
    const size_t end = at + named.size();
    if (end < text.size() && std::isdigit(static_cast<unsigned char>(text[end]))) continue;  // "sample 46" in "sample 461"
    text.insert(end, " (" + run_numbering_text(o) + ")");
    return;
  }
}

}  // namespace

void annotate_original_samples(ReplayReport& report, const Manifest& m) {
  auto original = [&](int64_t sample) { return sample >= 0 ? original_of_sample(m, sample) : std::nullopt; };
  if (report.first_nonfinite) {
    const int64_t sample = report.first_nonfinite->sample;
    if (const auto o = original(sample)) {
      (o->is_offset ? report.first_nonfinite->original_offset : report.first_nonfinite->original_sample) = o->value;
      if (report.root_cause) name_run_numbering(report.root_cause->summary, sample, *o);
    }
  }
  for (Finding& f : report.findings) {
    const std::optional<int64_t> sample = f.evidence.integer(K::kSample);
    if (!sample) continue;
    if (const auto o = original(*sample)) {
      f.evidence.set(o->is_offset ? K::kOriginalOffset : K::kOriginalSample, o->value);
      name_run_numbering(f.message, *sample, *o);
    }
  }
}

}  // namespace nanreplay
