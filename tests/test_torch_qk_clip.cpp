// The qk-clip=TAU what-if's clipping (replay/workflows/qk_clip_what_if.h) on
// a step of a synthetic bundle, through the library: after MuonClip's rule at
// tau, the largest logit of the step's largest head is tau and no head of its
// layer exceeds it, for MHA, grouped-query and latent attention; a tau above
// every head changes nothing. The CLI side: tests/test_cli_frontier_probes.cpp.
#include <algorithm>
#include <cmath>
#include <optional>

#include "loaders/bundle/bundle.h"
#include "replay/workflows/qk_clip_what_if.h"

#include "tests/catch/catch_after_glog.h"

#include "tests/cli_harness.h"

using nanreplay_test::run_cli;
using nanreplay_test::ScratchDir;

TEST_CASE("qk-clip: the step's own largest logit of a clipped head is tau after clipping (MHA, GQA, latent attention)",
          "[frontier][what-if]") {
  for (const char* preset : {"clean-fp32", "clean-gqa", "clean-deepseek-mla"}) {
    INFO(preset);
    ScratchDir dir(std::string("frontier-clip-") + preset);
    REQUIRE(run_cli({"synth", preset, (dir / "bundle").string()}).status == 0);
    const nanreplay::Bundle bundle(dir / "bundle");
    const int64_t step = bundle.manifest().steps.back().step;
    nanreplay::LoadedStep loaded(bundle, step);
    auto maxima = [](nanreplay::LoadedStep& s) {
      nanreplay::StepRequest request;
      request.probes = nanreplay::ProbeLevel::kOff;
      request.attn_logit_max = true;
      return nanreplay::replay_loaded_step(s, request).attn_logit_max;
    };
    const std::vector<std::vector<double>> before = maxima(loaded);
    REQUIRE(!before.empty());
    // tau between layer 0's largest and smallest head: only layer 0's weights decide layer 0's logits.
    const std::vector<double>& layer0 = before[0];
    const double top = *std::max_element(layer0.begin(), layer0.end());
    const double low = *std::min_element(layer0.begin(), layer0.end());
    REQUIRE(top > low);
    const double tau = top - 0.25 * (top - low);
    std::optional<nanreplay::LoadedStep> clipped;
    int64_t passes = 0;
    const std::string change = nanreplay::qk_clip_step(loaded, tau, {}, {}, clipped, passes);
    INFO(change);
    REQUIRE(clipped.has_value());
    CHECK(passes > 0);
    const std::vector<std::vector<double>> after = maxima(*clipped);
    const size_t top_head = static_cast<size_t>(std::max_element(layer0.begin(), layer0.end()) - layer0.begin());
    // The largest head lands on tau (fp32 rounding only); every head of layer 0 is at most tau.
    CHECK(after[0][top_head] == Approx(tau).epsilon(1e-5));
    for (size_t h = 0; h < layer0.size(); ++h) {
      CHECK(after[0][h] <= tau * (1 + 1e-5));
      if (layer0[h] <= tau && std::string(preset) != "clean-gqa") CHECK(after[0][h] == layer0[h]);  // untouched
    }
    // A tau above every head changes nothing.
    std::optional<nanreplay::LoadedStep> unchanged;
    const double all_max = [&] {
      double m = -INFINITY;
      for (const auto& row : before) m = std::max(m, *std::max_element(row.begin(), row.end()));
      return m;
    }();
    CHECK(nanreplay::qk_clip_step(loaded, all_max * 2, {}, {}, unchanged, passes).rfind("no change", 0) == 0);
    CHECK_FALSE(unchanged.has_value());
  }
}
