// Findings as typed data: the one table of finding codes (name, triage layer,
// default severity, meaning) and the one table of evidence keys, with
// evidence values that keep their type until a renderer writes them. Compute
// code builds and reads findings through these types only; JSON exists at
// the edge (evidence_json).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

namespace nanreplay {

enum class TriageLayer { kData, kNumeric, kSystem };
enum class Severity { kError, kWarning, kInfo };
const char* triage_layer_name(TriageLayer layer);
const char* severity_name(Severity severity);

enum class FindingCode : uint8_t {
  kDataTokenOutOfRange,
  kDataRepeatRun,
  kDataLowEntropy,
  kDataLossOutlier,
  kDataSamplerMismatch,
  kDataTokenEmbeddingOutlier,
  kNumericOverflow,
  kNumericHeadroomLow,
  kNumericZeroNorm,
  kNumericFp8ScaleJump,
  kNumericLossScaleOverflow,
  kCheckpointNonfinite,
  kSystemBitFlip,
  kSystemUpdateMismatch,
  kSystemNotReproducible,
  kSystemRankMismatch,
  kSystemNondeterministic,
  kSystemDeviceMismatch,
  kBundleChecksumMismatch,
  kBundleDoesNotReproduce,
  kSystemTrajectoryDiverged,
  kSystemLogConvention,
  kNumericRouterCollapse,
  kSystemSiteMismatch,
  kNumericUpdateSpike,
  kNumericExpertOutlierActivation,
};

struct FindingCodeDef {
  FindingCode code;
  const char* name;  // the stable upper-case identifier of report.json
  TriageLayer layer;
  Severity severity;  // the usual one; the verdict may lower or raise it (docs/triage.md)
  const char* meaning;
};

const std::vector<FindingCodeDef>& finding_code_table();
const FindingCodeDef& finding_code(FindingCode code);
const char* code_name(FindingCode code);

// Evidence keys: report v1's, then this project's (docs/report-format.md).
enum class EvidenceKey : uint8_t {
  kStep, kRank, kMicroBatch, kSample, kPosition, kSite, kHead, kParam, kIndex, kBit, kBefore, kAfter,
  kExpected, kShard, kOffset, kTensor, kLength, kToken, kExpert,
  kPhase, kSamples, kZ, kHeadroomBits, kSteps, kLastStep, kConsequence, kLastCleanStep, kParams,
  kImplicated, kTypical, kSiteLength, kNorm, kTypicalNorm, kGaps, kCauses, kCheckedSteps, kTolerance,
  kMaxRelativeGap, kRelative, kOriginalSample, kOriginalOffset, kLayer, kShare, kTokens,
  kStatistic, kReplayedFrom,
  kMaxAbsDiff, kNormRatio, kRewritten,  // SYSTEM_UPDATE_MISMATCH's magnitudes
  kIncidentStep, kUpdateRms, kUpdateRatio, kG2OverV, kG2OverVMax, kG2OverVRms,  // NUMERIC_UPDATE_SPIKE's
  kValue,  // NUMERIC_EXPERT_OUTLIER_ACTIVATION's
};

struct EvidenceKeyDef {
  EvidenceKey key;
  const char* name;
  bool report_v1;  // a key report v1 names; the rest are this project's
};
const std::vector<EvidenceKeyDef>& evidence_key_table();
const char* evidence_key_name(EvidenceKey key);

class Evidence;

// One evidence value: null, a flag, an integer, a number (non-finite ones
// render as "nan"/"inf"), text, lists of integers or texts, or nested
// evidence (the gaps of a bundle that does not reproduce).
class EvidenceValue {
 public:
  using Storage = std::variant<std::nullptr_t, bool, int64_t, double, std::string, std::vector<int64_t>,
                               std::vector<std::string>, std::vector<Evidence>>;
  EvidenceValue(std::nullptr_t = nullptr) : value_(nullptr) {}
  EvidenceValue(bool v) : value_(v) {}
  EvidenceValue(int v) : value_(int64_t{v}) {}
  EvidenceValue(long v) : value_(int64_t{v}) {}
  EvidenceValue(long long v) : value_(static_cast<int64_t>(v)) {}
  EvidenceValue(unsigned long v) : value_(static_cast<int64_t>(v)) {}
  EvidenceValue(double v) : value_(v) {}
  EvidenceValue(const char* v) : value_(std::string(v)) {}
  EvidenceValue(std::string v) : value_(std::move(v)) {}
  EvidenceValue(std::vector<int64_t> v) : value_(std::move(v)) {}
  EvidenceValue(std::vector<std::string> v) : value_(std::move(v)) {}
  EvidenceValue(std::vector<Evidence> v);

  const Storage& storage() const { return value_; }

 private:
  Storage value_;
};

class Evidence {
 public:
  Evidence() = default;
  Evidence(std::initializer_list<std::pair<EvidenceKey, EvidenceValue>> values);

  Evidence& set(EvidenceKey key, EvidenceValue value);
  bool has(EvidenceKey key) const;
  // Typed reads; nullopt / null when the key is absent, null or of another type.
  std::optional<int64_t> integer(EvidenceKey key) const;
  std::optional<double> number(EvidenceKey key) const;  // integers too
  std::optional<std::string> text(EvidenceKey key) const;
  std::optional<bool> flag(EvidenceKey key) const;
  const std::vector<int64_t>* integers(EvidenceKey key) const;
  const std::vector<Evidence>* list(EvidenceKey key) const;
  const std::map<EvidenceKey, EvidenceValue>& values() const { return values_; }

 private:
  std::map<EvidenceKey, EvidenceValue> values_;
};

// An index that may not apply (layer, head, rank, sample...): null for -1.
EvidenceValue optional_index_value(int64_t value);

struct Finding {
  FindingCode code = FindingCode::kNumericOverflow;
  Severity severity = Severity::kInfo;
  std::string message;
  Evidence evidence;

  TriageLayer layer() const { return finding_code(code).layer; }
  const char* name() const { return code_name(code); }
};

// A finding at its code's default severity, or at `severity`.
Finding make_finding(FindingCode code, std::string message, Evidence evidence);
Finding make_finding(FindingCode code, Severity severity, std::string message, Evidence evidence);

nlohmann::json evidence_json(const Evidence& evidence);

// An info entry standing for the origin's consequences (evidence
// "consequence": true): it names no cause, so reports list it last or fold it.
inline bool is_consequence(const Finding& f) { return f.evidence.flag(EvidenceKey::kConsequence).value_or(false); }

}  // namespace nanreplay
