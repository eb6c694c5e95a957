// The rule that reads a spike's counterfactual replays
// (reports/triage/spike_counterfactual.h): data, model state, both,
// interaction, undecided; the site decides when the loss does not jump; the
// update check's findings say whether the update was corrupted.
#include <catch2/catch.hpp>

#include "reports/triage/spike_counterfactual.h"

using nanreplay::Counterfactuals;
using nanreplay::CounterfactualValues;

namespace {

Counterfactuals with_loss(double a, double b) {
  Counterfactuals c;
  c.step = 103;
  c.previous_step = 102;
  c.loss = CounterfactualValues{5.0, 20.0, a, b};
  return c;
}

std::string conclude(Counterfactuals c, const std::vector<nanreplay::Finding>& findings = {}, bool checked = false) {
  nanreplay::conclude_counterfactuals(c, findings, checked);
  return c.conclusion;
}

}  // namespace

TEST_CASE("counterfactuals: the batch, the weights, both, or only together", "[counterfactual][unit]") {
  CHECK(conclude(with_loss(19.0, 5.1)) == "data");
  CHECK(conclude(with_loss(5.2, 18.0)) == "model_state");
  CHECK(conclude(with_loss(15.0, 12.0)) == "both");
  CHECK(conclude(with_loss(5.5, 6.0)) == "interaction");
  CHECK(conclude(with_loss(INFINITY, 5.0)) == "data");  // a non-finite loss spikes
  Counterfactuals flat = with_loss(5.0, 5.0);
  flat.loss.spike = 5.1;  // no jump in the loss, no site: undecided
  CHECK(conclude(flat) == "undecided");
}

TEST_CASE("counterfactuals: the site decides when the loss does not jump; the update check's outcome",
          "[counterfactual][unit]") {
  Counterfactuals c = with_loss(5.0, 5.0);
  c.loss.spike = 5.0001;
  c.site = "layers.1.attn.q";
  c.statistic = "max_abs";
  c.site_values = CounterfactualValues{1.0, 9.0, 1.1, 8.5};
  nanreplay::Finding flip;
  flip.code = nanreplay::FindingCode::kSystemBitFlip;
  flip.evidence.set(nanreplay::EvidenceKey::kStep, int64_t{103});
  nanreplay::conclude_counterfactuals(c, {flip}, true);
  CHECK(c.conclusion == "model_state");
  CHECK(c.decided_by == "site");
  CHECK(c.update == "corrupted");
  CHECK(c.update_code == "SYSTEM_BIT_FLIP");
  CHECK(c.sentence.find("model state") == 0);
  Counterfactuals clean = with_loss(19.0, 5.0);
  flip.evidence.set(nanreplay::EvidenceKey::kStep, int64_t{102});
  nanreplay::conclude_counterfactuals(clean, {flip}, true);  // a flip into another step is not this update's
  CHECK(clean.update == "computed");
  nanreplay::conclude_counterfactuals(clean, {}, false);
  CHECK(clean.update == "not_checked");
}
