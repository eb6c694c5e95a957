// See loss_terms_note.h.
#include "reports/triage/loss_terms_note.h"

#include <string>

#include "loaders/base/error.h"
#include "reports/results/number_text.h"
#include "reports/triage/provenance_note.h"

namespace nanreplay {

namespace {

// "checkpoint: config.json: router_aux_loss_coef, ..." for the manifest key's provenance entry; the
// manifest itself when the writer recorded none (a bundle written by hand).
std::string loss_term_source(const Manifest& manifest, const std::string& key) {
  for (const ValueSource& v : manifest.provenance) {
    if (v.key == key) return printable(v.from + (v.detail.empty() ? "" : ": " + v.detail));
  }
  return "manifest.json " + key;
}

std::string loss_term_text(const LossTerm& t) {
  if (t.coefficient == 0) return "no " + t.term + " (" + t.source + ")";
  return format_number(t.coefficient) + " x " + t.term + " (" + t.source + ")";
}

}  // namespace

std::vector<LossTerm> loss_terms_of(const Manifest& manifest) {
  std::vector<LossTerm> terms;
  const ModelConfig& model = manifest.model;
  if (model.moe) {
    terms.push_back({"router_aux_loss", model.moe->router_aux_loss_coef, true,
                     loss_term_source(manifest, "model.moe.router_aux_loss_coef")});
    terms.push_back({"router_z_loss", model.moe->router_z_loss_coef, true,
                     loss_term_source(manifest, "model.moe.router_z_loss_coef")});
  }
  // Megatron-LM's MTPLossAutoScaler puts the MTP term in the gradients, not in the logged loss.
  if (model.mtp) terms.push_back({"mtp_loss", model.mtp->loss_scale, false, loss_term_source(manifest, "model.mtp")});
  return terms;
}

void note_loss_terms(ReplayReport& report, const Manifest& manifest) {
  report.loss_terms = loss_terms_of(manifest);
  if (!manifest.model.moe) return;
  std::string terms;
  for (const LossTerm& t : report.loss_terms) {
    if (t.term == "mtp_loss") continue;  // mtp_note.h says it
    terms += (terms.empty() ? "" : "; ") + loss_term_text(t);
  }
  note_on_reproduction_gaps(report, " The router terms replayed beside the cross-entropy: " + terms +
                                        ": a run whose loss had other router terms (output_router_logits set in "
                                        "its forward, another coefficient) computes other gradients.");
}

}  // namespace nanreplay
