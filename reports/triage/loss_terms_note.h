// What the replayed loss adds to the language model's cross-entropy (the
// router's load-balancing and z losses, multi-token prediction), each with
// its coefficient and where the bundle's writer found it (report.json's
// loss_terms). The terms follow what the run did, as the bundle says it:
// Hugging Face adds the router's aux loss only with output_router_logits, so
// a coefficient of 0 is a statement ("the run added none"), not an omission.
// Beside a verdict that the replay does not reproduce the run, the terms are
// named: a run whose loss had other terms computes other gradients.
#pragma once

#include <vector>

#include "loaders/bundle/manifest.h"
#include "reports/results/report.h"

namespace nanreplay {

// The terms a mixture of experts or multi-token prediction adds; empty for a dense model without MTP.
std::vector<LossTerm> loss_terms_of(const Manifest& manifest);

// Sets report.loss_terms and, for a mixture of experts, names the router
// terms beside every reproduction gap. Call after settle_verdict.
void note_loss_terms(ReplayReport& report, const Manifest& manifest);

}  // namespace nanreplay
