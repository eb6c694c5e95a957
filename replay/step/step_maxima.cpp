// See step_maxima.h.
#include "replay/step/step_maxima.h"

#include <cmath>

#include "probes/nan_max.h"
#include "probes/record_wire.h"
#include "replay/step/ranks/distributed.h"

namespace nanreplay {

namespace {

void write_step_maxima(WireWriter& out, const StepResult& r) {
  out.pod<uint64_t>(r.attn_logit_max.size());
  for (const std::vector<double>& row : r.attn_logit_max) {
    out.pod<uint64_t>(row.size());
    for (double v : row) out.pod<double>(v);
  }
  out.pod<uint64_t>(r.expert_activation_max.size());
  for (const auto& layer : r.expert_activation_max) {
    out.pod<uint8_t>(layer ? 1 : 0);
    if (!layer) continue;
    out.pod<uint64_t>(layer->size());
    for (const ExpertActivationMax& e : *layer) {
      out.pod<double>(e.input);
      out.pod<double>(e.output);
      out.pod<int64_t>(e.rows);
    }
  }
}

// Folds another process's maxima (written by write_step_maxima) into `r`.
void fold_step_maxima(WireReader& in, StepResult& r) {
  const auto layers = in.pod<uint64_t>();
  for (uint64_t l = 0; l < layers; ++l) {
    const auto heads = in.pod<uint64_t>();
    for (uint64_t h = 0; h < heads; ++h) {
      const auto v = in.pod<double>();
      if (l < r.attn_logit_max.size() && h < r.attn_logit_max[l].size()) fold_nan_max(r.attn_logit_max[l][h], v);
    }
  }
  const auto expert_layers = in.pod<uint64_t>();
  for (uint64_t l = 0; l < expert_layers; ++l) {
    if (in.pod<uint8_t>() == 0) continue;
    const auto experts = in.pod<uint64_t>();
    std::vector<ExpertActivationMax> theirs;
    for (uint64_t e = 0; e < experts; ++e) {
      ExpertActivationMax m;
      m.input = in.pod<double>();
      m.output = in.pod<double>();
      m.rows = in.pod<int64_t>();
      theirs.push_back(m);
    }
    if (l >= r.expert_activation_max.size()) continue;
    auto& mine = r.expert_activation_max[l];
    if (!mine) {
      mine = theirs;
      continue;
    }
    for (size_t e = 0; e < mine->size() && e < theirs.size(); ++e) {
      ExpertActivationMax& m = (*mine)[e];
      const ExpertActivationMax& t = theirs[e];
      if (t.rows == 0) continue;
      if (m.rows == 0) {
        m = t;
        continue;
      }
      fold_nan_max(m.input, t.input);
      fold_nan_max(m.output, t.output);
      m.rows += t.rows;
    }
  }
}

}  // namespace

void combine_step_maxima(StepResult& result, bool attn, bool experts) {
  ProcessWorld* world = default_world();
  if (world == nullptr || world->size() < 2 || !(attn || experts)) return;
  WireWriter out;
  write_step_maxima(out, result);
  const std::vector<std::string> all = world->all_gather(out.take());
  for (size_t p = 0; p < all.size(); ++p) {
    if (static_cast<int>(p) == world->rank()) continue;
    WireReader in(all[p]);
    fold_step_maxima(in, result);
  }
}

}  // namespace nanreplay
