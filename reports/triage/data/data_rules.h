// The data layer of triage over plain data: per-sample losses far above the
// step's median (or non-finite), samples whose token profile is unlike the
// stream's (a long run of one token, low entropy), and whether a token's
// embedding row is an outlier. Thresholds: reports/results/triage_thresholds.h.
#pragma once

#include <cstdint>
#include <vector>

#include "probes/data_checks.h"
#include "probes/probe_record.h"
#include "reports/results/report.h"
#include "reports/results/triage_thresholds.h"

namespace nanreplay {

std::vector<Finding> sample_loss_findings(const std::vector<SampleLoss>& losses, int64_t step,
                                          const TriageThresholds& t);
// DATA_REPEAT_RUN and DATA_LOW_ENTROPY, judged against the stream's own
// samples; severity info until settle_verdict knows whether they are implicated.
std::vector<Finding> sample_profile_findings(const std::vector<SampleProfile>& profiles,
                                             const DataBaseline& baseline, int64_t step,
                                             int64_t seq_len, const DataCheckOptions& options);
// Whether a token's embedding row norm is an outlier of the matrix's rows.
bool is_embedding_outlier(double norm, double typical, double spread, const TriageThresholds& thresholds);

}  // namespace nanreplay
