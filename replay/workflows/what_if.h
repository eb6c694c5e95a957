// What-if replays: the step where the unmodified replay first went
// non-finite, replayed again with one modification, to say whether the first
// non-finite value disappears. The syntax (`--what-if KIND[=VALUE]`) and the
// exact semantics of each kind are in docs/bisect-and-what-if.md. No LibTorch
// types here: the CLI parses and checks specs before anything is replayed.
#pragma once

#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "loaders/bundle/bundle.h"
#include "reports/results/report.h"

namespace nanreplay {

struct WhatIf {
  // Each kind is one row of what_if.cpp's what_if_rows(): its name, value,
  // check against the bundle and the StepOverrides it makes.
  enum class Kind {
    kDropSamples,    // drop-samples=12,40: remove these samples from the step's batch
    kFp32Layers,     // fp32-layers=2,3 | all: compute these layers entirely in fp32
    kNormEps,        // norm-eps=1e-5: the norms' eps
    kDampFp8Scale,   // damp-fp8-scale[=3]: clamp each fp8 scale to within 3x of the previous step's
    kStableSoftmax,  // stable-softmax: q k^T, scaling and softmax in fp32, as a fused kernel does
    kQkNorm,         // qk-norm: q and k RMS-normalised per head with unit weights (Qwen3's QK-norm)
    kSoftcap,        // softcap=50: the attention scores soft-capped, c * tanh(s / c) (Gemma 2)
    kRouterFp32,     // router-fp32: a mixture of experts' router matmul and softmax in fp32
    kZLoss,          // z-loss=1e-3: the router z-loss coefficient (ST-MoE)
    kSinksOff,       // sinks=off: the softmax without GPT-OSS's sink column
    kWindow,         // window=4: the sliding layers' window (Mistral, Gemma 2/3, GPT-OSS, OLMo 3)
    kSwigluClamp,    // swiglu-clamp=7: the experts' gate clamped to <= 7 and up to [-7, 7] (GPT-OSS)
    kQkClip,         // qk-clip=100: MuonClip at tau on the step's own per-head max logits (Kimi K2)
    kRouterBiasFrozen,  // router-bias=frozen: the previous step's correction bias (DeepSeek-V3's router)
  };
  Kind kind = Kind::kStableSoftmax;
  std::string text;               // as written
  std::vector<int64_t> samples;   // drop-samples
  std::vector<int> layers;        // fp32-layers
  bool all_layers = false;        // fp32-layers=all
  double value = 0.0;             // norm-eps, the damping factor, the soft cap, the z-loss coefficient, the window
                                  // or the SwiGLU limit; qk-clip's tau
};

// Parses one --what-if; throws UsageError naming the spec and what is wrong.
WhatIf parse_what_if(const std::string& text);
// Checks a spec against the bundle before any replay (layer range, fp8 for
// damping); throws UsageError.
void check_what_if(const WhatIf& what_if, const Manifest& manifest);
// The kinds with one example each, for --help.
std::string what_if_help();

// Replays `origin.step` once per what-if. Throws UsageError before replaying
// anything when a what-if cannot apply to that step (a sample it does not
// read, no earlier step to damp fp8 scales against). With no origin, nothing
// is replayed and each outcome says there was nothing to resolve.
// `before_pass` runs before every pass and may throw to stop.
std::vector<WhatIfOutcome> evaluate_what_ifs(const Bundle& bundle, const std::optional<FirstNonfinite>& origin,
                                             const std::vector<WhatIf>& what_ifs,
                                             const std::function<void()>& before_pass,
                                             const std::vector<std::string>& devices = {"cpu"},
                                             bool native_low_precision = true,
                                             const std::optional<std::filesystem::path>& stream_scratch = {});

}  // namespace nanreplay
