// See step_maxima.h.
#include "replay/step/step_maxima.h"

#include <cmath>

#include "probes/nan_max.h"
#include "probes/record_wire.h"
#include "replay/step/ranks/distributed.h"

namespace nanreplay {

namespace {

template <typename T>
void write_rows(WireWriter& out, const std::vector<std::vector<T>>& rows) {
  out.pod<uint64_t>(rows.size());
  for (const std::vector<T>& row : rows) {
    out.pod<uint64_t>(row.size());
    for (T v : row) out.pod<T>(v);
  }
}

// Another process's rows folded into `mine` by `fold` (where both have the element).
template <typename T, typename Fold>
void fold_rows(WireReader& in, std::vector<std::vector<T>>& mine, Fold fold) {
  const auto rows = in.pod<uint64_t>();
  for (uint64_t l = 0; l < rows; ++l) {
    const auto columns = in.pod<uint64_t>();
    for (uint64_t c = 0; c < columns; ++c) {
      const auto v = in.pod<T>();
      if (l < mine.size() && c < mine[l].size()) fold(mine[l][c], v);
    }
  }
}

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
  write_rows(out, r.router_logit_max);
  write_rows(out, r.router_tokens);
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
  fold_rows<double>(in, r.router_logit_max, [](double& mine, double theirs) { fold_nan_max(mine, theirs); });
  fold_rows<int64_t>(in, r.router_tokens, [](int64_t& mine, int64_t theirs) { mine += theirs; });
}

}  // namespace

void combine_step_maxima(StepResult& result, bool attn, bool experts, bool routers) {
  ProcessWorld* world = default_world();
  if (world == nullptr || world->size() < 2 || !(attn || experts || routers)) return;
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
