// Multi-token prediction in the report: whether the replay computed the MTP
// layers' loss (manifest model.mtp) or the bundle's writer left the
// checkpoint's MTP layers out (provenance "model.mtp", as `nanreplay import
// --mtp-loss-scale 0` records it). Left out, they are named beside every
// verdict that the replay does not reproduce the run: a run whose loss had
// the MTP term moves every gradient the replay leaves it out of.
#pragma once

#include <optional>

#include "loaders/bundle/manifest.h"
#include "reports/results/report.h"

namespace nanreplay {

// What the manifest says about multi-token prediction; none when nothing.
std::optional<MtpSummary> mtp_summary(const Manifest& manifest);

// Sets report.mtp and, when the MTP layers were left out, appends a sentence
// to BUNDLE_DOES_NOT_REPRODUCE, SYSTEM_NOT_REPRODUCIBLE and the root cause
// resting on either. Call after settle_verdict.
void note_multi_token_prediction(ReplayReport& report, const Manifest& manifest);

}  // namespace nanreplay
