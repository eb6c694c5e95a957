// See origin_tokens.h.
#include "reports/triage/data/origin_tokens.h"

#include <cmath>

#include <torch/torch.h>

#include "loaders/formats/safetensors.h"
#include "probes/sites.h"
#include "replay/step/checkpoint.h"
#include "reports/triage/data/data_rules.h"

namespace nanreplay {

std::vector<OriginToken> origin_tokens(const Bundle& bundle, FirstNonfinite& origin, const torch::Tensor& embedding,
                                       const TriageThresholds& t) {
  const Manifest& m = bundle.manifest();
  if (origin.sample < 0 || origin.sample >= bundle.num_samples() || origin.position < 0 ||
      origin.position >= m.data.seq_len) {
    return {};
  }
  // model.mtp: depth k's sites hold the row rolled k positions left, so their position p reads
  // input token p + k; past the row's end the roll's filler (token id 0), none of the sample's.
  const bool in_mtp_block = origin.phase != Phase::kGrad && is_mtp_layer(m.model, origin.site.layer);
  const int64_t input_position = origin.position + (in_mtp_block ? origin.site.layer - m.model.num_layers + 1 : 0);
  if (input_position >= m.data.seq_len) return {};
  const std::vector<int64_t> ids = bundle.tokens().sample_tokens(origin.sample, m.data.seq_len);
  origin.token = ids[static_cast<size_t>(input_position)];
  torch::NoGradGuard no_grad;
  const torch::Tensor norms = embedding.detach().to(torch::kCPU, torch::kFloat64).norm(2, 1).contiguous();
  const double* row_norm = norms.data_ptr<double>();
  std::vector<double> finite;
  for (int64_t i = 0; i < norms.numel(); ++i) {
    if (std::isfinite(row_norm[i])) finite.push_back(row_norm[i]);
  }
  const RobustBaseline base = robust_baseline(finite);
  auto describe = [&](int64_t token, int64_t position) {
    const double norm = token < norms.numel() ? row_norm[token] : std::nan("");
    return OriginToken{token, position, norm, base.median, base.mad,
                       is_embedding_outlier(norm, base.median, base.mad, t)};
  };
  std::vector<OriginToken> tokens = {describe(origin.token, input_position)};
  for (int64_t p = 0; p < input_position; ++p) {
    const OriginToken candidate = describe(ids[static_cast<size_t>(p)], p);
    if (!candidate.outlier) continue;
    bool seen = false;
    for (const OriginToken& known : tokens) seen = seen || known.token == candidate.token;
    if (!seen) tokens.push_back(candidate);
  }
  return tokens;
}

}  // namespace nanreplay
