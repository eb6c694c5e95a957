// Synthetic incident bundles: a small model trained for a few steps on random
// tokens (or the bytes of a text corpus) with the replay's own gradient code
// and PyTorch's AdamW, every checkpoint written as a real v1 bundle, and
// optionally one planted fault. They back `nanreplay demo`, `nanreplay synth`
// and the end-to-end tests.
//
// Each bundle is a consistent training trajectory: every checkpoint is AdamW
// applied to the one before, unless the fault *is* a change between two
// checkpoints (a flipped bit, a runaway row). Faults of the model are planted
// in memory before the first captured step and triggered by data: a token
// that no earlier step reads.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "loaders/bundle/manifest.h"

namespace nanreplay {

enum class FaultKind {
  kNone,
  kHeadOverflow,   // one attention head's q/k amplify a rare token's direction until q k^T overflows fp16
  kBitFlip,        // one weight element gets a flipped exponent bit (an edit between two checkpoints)
  kZeroEmbedding,  // one rare token's embedding row is zero (with norm_eps = 0)
  kTokenOutOfRange,   // a token id >= vocab_size in the step's first sample
  kRepeatRun,         // the step's first sample repeats one token for half its length
  kLowEntropy,        // the step's first sample alternates between two tokens
  kSamplerMismatch,   // the recorded samples of the step differ from randperm
  kFp8ScaleJump,      // an fp8 input scale jumps 1000x at the step
  kLossScaleOverflow, // fp16 loss scale so large the backward overflows (handled)
  kRankMismatch,      // rank 1's logged loss disagrees with its replay
  kNotReproducible,   // the job logged loss nan at a step that replays finite
  kChecksumMismatch,  // a shard byte changed after its sha256 was recorded
  // Built for what-ifs (docs/bisect-and-what-if.md says which one each answers):
  kGlitchToken,       // a rare token whose embedding row has diverged (fp16: beyond its range)
  kMlpOverflow,       // one mlp.up_proj row of a layer grows until its output overflows fp16 (an edit)
  kFp8ScaleCollapse,  // an fp8 input scale drops to 0 (amax went inf): dequantizing divides by 0
  // A mixture of experts (model.moe):
  kRouterOverflow,    // a layer's router amplifies a rare token until its logits overflow fp16
  kExpertOverflow,    // a layer's router sends a rare token to one expert, whose projections overflow fp16 on it
  kRouterCollapse,    // a layer's router weights are zero: every token ties and goes to the lowest experts
  // Spikes that never go non-finite (docs/spikes.md):
  kSpikeToken,        // a rare token whose (tied) embedding row is large but finite, at every other position of one sample
  kSiteStatsMismatch, // the logged site statistics of one site differ from what the step computes
  // Weights rewritten outside the optimizer (an edit between two checkpoints):
  kRewrittenWeights,  // layer `layer`'s q_proj and k_proj multiplied by `weight_scale` before the step
  kBadUpdate,         // the update of `param` into the step's checkpoint applied `weight_scale` times over
  kLogitGrowth,       // head `head` of `layer`: its q and k rows grow in every checkpoint of the window, faster at `step`
  kNormGainOverflow,  // the first gain of norm weight `param` rewritten to `weight_scale` (an edit)
};

struct FaultSpec {
  FaultKind kind = FaultKind::kNone;
  int64_t step = -1;      // the step whose data (or checkpoint) carries the fault
  int layer = 0;          // head overflow, mlp overflow
  int head = 0;           // head overflow
  int expert = 0;         // expert overflow (router overflow and collapse: the layer only)
  std::string param;      // bit flip: parameter key
  int bit = 30;           // bit flip: bit of the fp32 encoding (30 = exponent MSB)
  int flip_exponent = 127;  // bit flip: the exponent field of the element flipped (127: |x| in [1, 2))
  std::string site;       // site stats mismatch: the site whose logged statistics differ
  int64_t position = 5;   // planted token: position in the sample
  int rank = 0;           // planted token: the rank reading the sample
  int slot = 0;           // planted token: the sample's index in that rank's list for the step
  int occurrences = 1;    // glitch token: samples holding it (slots slot, slot + 1, ...)
  double embedding_value = 1e5;  // glitch token: every element of its embedding row
  double weight_scale = 1e20;    // rewritten weights, bad update: the factor; norm gain overflow: the gain
  // Repeat run: one head of `layer` also amplifies the repeated token, so
  // the poisoned sample holds the first non-finite value.
  bool trigger_head = false;
};

struct SyntheticSpec {
  ModelConfig model;
  Compute compute = Compute::kFp32;
  int64_t seq_len = 32;
  int64_t micro_batch_size = 2;
  int64_t grad_accum_steps = 2;
  int64_t world_size = 1;
  int64_t num_tokens = 8192;
  TokenDtype token_dtype = TokenDtype::kUint16;
  int shards = 2;
  uint64_t data_seed = 7;
  uint64_t sampler_seed = 1234;
  uint64_t init_seed = 42;
  int64_t first_step = 100;
  int64_t num_steps = 4;
  double lr = 3e-3;
  // Per optimizer group ("default": the top level): written as state.json's
  // lr object and used by each group's update; empty: `lr` for every group.
  std::map<std::string, double> lr_by_group;
  double loss_scale = 1024.0;   // fp16 only
  OptimizerConfig optimizer;
  bool record_samples = true;   // write explicit samples into each step entry too
  bool write_optimizer = true;
  // Rolling forward: a full checkpoint (model and optimizer) only every N
  // steps from the first, and at a step whose checkpoint a fault edits; the
  // steps between hold only state.json. 1: every step has one.
  int64_t checkpoint_every = 1;
  bool checksums = true;
  // Bytes of a text corpus as the token stream (byte-level tokens: the
  // model's vocab_size must be 256); empty: random tokens.
  std::vector<uint8_t> corpus;
  // Bundles that do not describe the run they claim to (for the faithfulness
  // check): q/k weights stored in Meta's interleaved-rotary layout while the
  // manifest says rotate-half, or a manifest naming another sampler seed.
  bool mislabel_rope = false;
  double attention_init_std = 0.02;  // q/k weights at initialisation (others: init_std)
  double init_std = 0.02;            // every other weight matrix and the embeddings at initialisation
  std::optional<uint64_t> manifest_sampler_seed;
  // Each state.json also logs every forward site's max |x| and rms (logged.site_stats).
  bool log_site_stats = false;
  std::optional<IncidentKind> incident_kind;  // the manifest's incident.kind
  FaultSpec fault;
};

// What was injected, for tests and the demo's narration.
struct SyntheticOutcome {
  int64_t fault_step = -1;
  std::string fault_param;
  int64_t fault_element = -1;
  int64_t zero_token = -1;
  int64_t zero_position = -1;
  int64_t first_sample = -1;  // dataset index of rank 0's first sample at the fault step
  int64_t fault_sample = -1;  // the (first) sample carrying a planted token
  int64_t fault_token = -1;   // the planted token
  int64_t fault_position = -1;
  std::vector<double> losses;
};

// Writes the bundle into `dir` (created; must not exist or be empty) via a
// temporary sibling directory renamed at the end.
SyntheticOutcome write_synthetic_bundle(const std::filesystem::path& dir, const SyntheticSpec& spec);

// Named presets: the clean ones (clean-*), one per fault kind, and demo.
struct SyntheticPreset {
  const char* name;
  const char* plants;  // what the bundle holds, for `synth --help`
};
const std::vector<SyntheticPreset>& synthetic_presets();
std::vector<std::string> synthetic_preset_names();
SyntheticSpec synthetic_preset(const std::string& name);

}  // namespace nanreplay
