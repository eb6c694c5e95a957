// The finding-code and evidence-key tables; see finding.h. docs/triage.md
// says when each code is raised, docs/report-format.md what each key means.
#include "reports/results/finding.h"

#include <cmath>
#include <stdexcept>

namespace nanreplay {

const char* triage_layer_name(TriageLayer layer) {
  switch (layer) {
    case TriageLayer::kData: return "data";
    case TriageLayer::kNumeric: return "numeric";
    case TriageLayer::kSystem: return "system";
  }
  return "numeric";
}

const char* severity_name(Severity severity) {
  switch (severity) {
    case Severity::kError: return "error";
    case Severity::kWarning: return "warning";
    case Severity::kInfo: return "info";
  }
  return "info";
}

const std::vector<FindingCodeDef>& finding_code_table() {
  using C = FindingCode;
  using L = TriageLayer;
  using S = Severity;
  static const std::vector<FindingCodeDef> table = {
      {C::kDataTokenOutOfRange, "DATA_TOKEN_OUT_OF_RANGE", L::kData, S::kError,
       "a token id >= vocab_size in the shards"},
      {C::kDataRepeatRun, "DATA_REPEAT_RUN", L::kData, S::kInfo,
       "a sample repeats one token far longer than the stream's samples do (an error when implicated)"},
      {C::kDataLowEntropy, "DATA_LOW_ENTROPY", L::kData, S::kInfo,
       "a sample's token entropy is far below the stream's (an error when implicated)"},
      {C::kDataLossOutlier, "DATA_LOSS_OUTLIER", L::kData, S::kWarning,
       "a sample's loss is far above its step's median"},
      {C::kDataSamplerMismatch, "DATA_SAMPLER_MISMATCH", L::kData, S::kError,
       "the recorded samples disagree with the randperm sampler"},
      {C::kDataTokenEmbeddingOutlier, "DATA_TOKEN_EMBEDDING_OUTLIER", L::kData, S::kError,
       "a token at the origin whose embedding row is an outlier of the matrix"},
      {C::kNumericOverflow, "NUMERIC_OVERFLOW", L::kNumeric, S::kError,
       "a site reached its compute dtype's limit"},
      {C::kNumericHeadroomLow, "NUMERIC_HEADROOM_LOW", L::kNumeric, S::kWarning,
       "a finite forward site came within a bit of its dtype's maximum"},
      {C::kNumericZeroNorm, "NUMERIC_ZERO_NORM", L::kNumeric, S::kWarning,
       "a norm's denominator fell below eps (an error at 0/0)"},
      {C::kNumericFp8ScaleJump, "NUMERIC_FP8_SCALE_JUMP", L::kNumeric, S::kWarning,
       "an fp8 scale changed more than 3x between adjacent steps (an error on the failing step)"},
      {C::kNumericLossScaleOverflow, "NUMERIC_LOSS_SCALE_OVERFLOW", L::kNumeric, S::kInfo,
       "fp16 overflow confined to a backward the loss scaler skips: handled"},
      {C::kCheckpointNonfinite, "CHECKPOINT_NONFINITE", L::kSystem, S::kError,
       "a checkpoint already holds non-finite parameters or moments (info when the origin's consequence)"},
      {C::kSystemBitFlip, "SYSTEM_BIT_FLIP", L::kSystem, S::kError,
       "a checkpoint element differs from AdamW's update by one flipped bit"},
      {C::kSystemUpdateMismatch, "SYSTEM_UPDATE_MISMATCH", L::kSystem, S::kWarning,
       "checkpoint elements differ from AdamW's update and no flipped bit explains them"},
      {C::kSystemNotReproducible, "SYSTEM_NOT_REPRODUCIBLE", L::kSystem, S::kWarning,
       "one step's replay disagrees with what the job logged (an error for a logged NaN that replays finite)"},
      {C::kSystemRankMismatch, "SYSTEM_RANK_MISMATCH", L::kSystem, S::kError,
       "a rank's logged values disagree with the replay of its share"},
      {C::kSystemNondeterministic, "SYSTEM_NONDETERMINISTIC", L::kSystem, S::kWarning,
       "one step replayed twice on this machine gave different values"},
      {C::kSystemDeviceMismatch, "SYSTEM_DEVICE_MISMATCH", L::kSystem, S::kError,
       "one step replayed on two devices from the same inputs gave different values"},
      {C::kBundleChecksumMismatch, "BUNDLE_CHECKSUM_MISMATCH", L::kSystem, S::kError,
       "a shard's sha256 differs from the manifest"},
      {C::kBundleDoesNotReproduce, "BUNDLE_DOES_NOT_REPRODUCE", L::kSystem, S::kError,
       "the healthy steps do not replay to what the job logged: the bundle describes another run"},
      {C::kSystemTrajectoryDiverged, "SYSTEM_TRAJECTORY_DIVERGED", L::kSystem, S::kWarning,
       "a step rolled forward from an earlier checkpoint no longer replays to the logged loss"},
      {C::kSystemLogConvention, "SYSTEM_LOG_CONVENTION", L::kSystem, S::kInfo,
       "the job logged a per-rank number by another convention than the bundle's; compared by the job's"},
      {C::kNumericRouterCollapse, "NUMERIC_ROUTER_COLLAPSE", L::kNumeric, S::kWarning,
       "a mixture of experts' layer sent far more than its share of tokens to one expert, or none to one"},
      {C::kSystemSiteMismatch, "SYSTEM_SITE_MISMATCH", L::kSystem, S::kError,
       "a forward site's replayed max |x| or rms differs from what the run logged for it beyond rounding"},
      {C::kNumericUpdateSpike, "NUMERIC_UPDATE_SPIKE", L::kNumeric, S::kInfo,
       "up to the incident, the first optimizer update that left its tensor's recent steps (RMS, or g^2 far above Adam's v)"},
      {C::kNumericExpertOutlierActivation, "NUMERIC_EXPERT_OUTLIER_ACTIVATION", L::kNumeric, S::kWarning,
       "one expert's output far above its layer's other experts' (an error where an expert holds the first non-finite value)"},
  };
  return table;
}

const FindingCodeDef& finding_code(FindingCode code) {
  const FindingCodeDef& def = finding_code_table().at(static_cast<size_t>(code));
  if (def.code != code) throw std::logic_error("finding_code_table is out of enum order");
  return def;
}

const char* code_name(FindingCode code) { return finding_code(code).name; }

const std::vector<EvidenceKeyDef>& evidence_key_table() {
  using K = EvidenceKey;
  static const std::vector<EvidenceKeyDef> table = {
      {K::kStep, "step", true},         {K::kRank, "rank", true},
      {K::kMicroBatch, "micro_batch", true}, {K::kSample, "sample", true},
      {K::kPosition, "position", true}, {K::kSite, "site", true},
      {K::kHead, "head", true},         {K::kParam, "param", true},
      {K::kIndex, "index", true},       {K::kBit, "bit", true},
      {K::kBefore, "before", true},     {K::kAfter, "after", true},
      {K::kExpected, "expected", true}, {K::kShard, "shard", true},
      {K::kOffset, "offset", true},     {K::kTensor, "tensor", true},
      {K::kLength, "length", true},     {K::kToken, "token", true},
      {K::kExpert, "expert", true},     {K::kPhase, "phase", false},
      {K::kSamples, "samples", false},  {K::kZ, "z", false},
      {K::kHeadroomBits, "headroom_bits", false}, {K::kSteps, "steps", false},
      {K::kLastStep, "last_step", false}, {K::kConsequence, "consequence", false},
      {K::kLastCleanStep, "last_clean_step", false}, {K::kParams, "params", false},
      {K::kImplicated, "implicated", false}, {K::kTypical, "typical", false},
      {K::kSiteLength, "site_length", false}, {K::kNorm, "norm", false},
      {K::kTypicalNorm, "typical_norm", false}, {K::kGaps, "gaps", false},
      {K::kCauses, "causes", false},    {K::kCheckedSteps, "checked_steps", false},
      {K::kTolerance, "tolerance", false}, {K::kMaxRelativeGap, "max_relative_gap", false},
      {K::kRelative, "relative", false}, {K::kOriginalSample, "original_sample", false},
      {K::kOriginalOffset, "original_offset", false},
      {K::kLayer, "layer", false},      {K::kShare, "share", false},
      {K::kTokens, "tokens", false},
      {K::kStatistic, "statistic", false}, {K::kReplayedFrom, "replayed_from", false},
      {K::kMaxAbsDiff, "max_abs_diff", false}, {K::kNormRatio, "norm_ratio", false},
      {K::kRewritten, "rewritten", false},
      {K::kIncidentStep, "incident_step", false}, {K::kUpdateRms, "update_rms", false},
      {K::kUpdateRatio, "update_ratio", false}, {K::kG2OverV, "g2_over_v", false},
      {K::kG2OverVMax, "g2_over_v_max", false}, {K::kG2OverVRms, "g2_over_v_rms", false},
      {K::kValue, "value", false},
  };
  return table;
}

const char* evidence_key_name(EvidenceKey key) {
  const EvidenceKeyDef& def = evidence_key_table().at(static_cast<size_t>(key));
  if (def.key != key) throw std::logic_error("evidence_key_table is out of enum order");
  return def.name;
}

EvidenceValue::EvidenceValue(std::vector<Evidence> v) : value_(std::move(v)) {}

Evidence::Evidence(std::initializer_list<std::pair<EvidenceKey, EvidenceValue>> values) {
  for (const auto& [key, value] : values) values_.insert_or_assign(key, value);
}

Evidence& Evidence::set(EvidenceKey key, EvidenceValue value) {
  values_.insert_or_assign(key, std::move(value));
  return *this;
}

bool Evidence::has(EvidenceKey key) const { return values_.count(key) > 0; }

namespace {

template <typename T>
const T* get(const std::map<EvidenceKey, EvidenceValue>& values, EvidenceKey key) {
  const auto it = values.find(key);
  return it == values.end() ? nullptr : std::get_if<T>(&it->second.storage());
}

}  // namespace

std::optional<int64_t> Evidence::integer(EvidenceKey key) const {
  const int64_t* v = get<int64_t>(values_, key);
  return v ? std::optional<int64_t>(*v) : std::nullopt;
}

std::optional<double> Evidence::number(EvidenceKey key) const {
  if (const double* v = get<double>(values_, key)) return *v;
  if (const int64_t* v = get<int64_t>(values_, key)) return static_cast<double>(*v);
  return std::nullopt;
}

std::optional<std::string> Evidence::text(EvidenceKey key) const {
  const std::string* v = get<std::string>(values_, key);
  return v ? std::optional<std::string>(*v) : std::nullopt;
}

std::optional<bool> Evidence::flag(EvidenceKey key) const {
  const bool* v = get<bool>(values_, key);
  return v ? std::optional<bool>(*v) : std::nullopt;
}

const std::vector<int64_t>* Evidence::integers(EvidenceKey key) const {
  return get<std::vector<int64_t>>(values_, key);
}

const std::vector<Evidence>* Evidence::list(EvidenceKey key) const { return get<std::vector<Evidence>>(values_, key); }

EvidenceValue optional_index_value(int64_t value) {
  return value >= 0 ? EvidenceValue(value) : EvidenceValue(nullptr);
}

Finding make_finding(FindingCode code, std::string message, Evidence evidence) {
  return make_finding(code, finding_code(code).severity, std::move(message), std::move(evidence));
}

Finding make_finding(FindingCode code, Severity severity, std::string message, Evidence evidence) {
  Finding f;
  f.code = code;
  f.severity = severity;
  f.message = std::move(message);
  f.evidence = std::move(evidence);
  return f;
}

namespace {

nlohmann::json value_json(const EvidenceValue& value) {
  return std::visit(
      [](const auto& v) -> nlohmann::json {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, double>) {
          if (std::isnan(v)) return "nan";
          if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
          return v;
        } else if constexpr (std::is_same_v<T, std::vector<Evidence>>) {
          nlohmann::json out = nlohmann::json::array();
          for (const Evidence& e : v) out.push_back(evidence_json(e));
          return out;
        } else {
          return nlohmann::json(v);
        }
      },
      value.storage());
}

}  // namespace

nlohmann::json evidence_json(const Evidence& evidence) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [key, value] : evidence.values()) out[evidence_key_name(key)] = value_json(value);
  return out;
}

}  // namespace nanreplay
