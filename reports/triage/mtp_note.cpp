#include "reports/triage/mtp_note.h"

#include <string>

#include "loaders/base/error.h"
#include "reports/triage/provenance_note.h"

namespace nanreplay {

std::optional<MtpSummary> mtp_summary(const Manifest& manifest) {
  const ValueSource* entry = nullptr;
  for (const ValueSource& v : manifest.provenance) {
    if (v.key == "model.mtp") entry = &v;
  }
  if (!manifest.model.mtp && entry == nullptr) return std::nullopt;
  MtpSummary out;
  out.replayed = manifest.model.mtp.has_value();
  if (out.replayed) {
    out.num_layers = manifest.model.mtp->num_layers;
    out.loss_scale = manifest.model.mtp->loss_scale;
  }
  if (entry != nullptr) out.detail = printable(entry->detail);  // the manifest's words: no raw bytes on a terminal
  return out;
}

void note_multi_token_prediction(ReplayReport& report, const Manifest& manifest) {
  report.mtp = mtp_summary(manifest);
  if (!report.mtp || report.mtp->replayed) return;
  const std::string note =
      " The checkpoint's multi-token prediction (MTP) layers were left out of the replayed loss" +
      (report.mtp->detail.empty() ? std::string() : " (" + report.mtp->detail + ")") +
      ": if the run's loss included them (Megatron-LM with mtp_num_layers set), every gradient differs; re-import "
      "with --mtp-loss-scale set to the run's mtp_loss_scaling_factor.";
  note_on_reproduction_gaps(report, note);
}

}  // namespace nanreplay
