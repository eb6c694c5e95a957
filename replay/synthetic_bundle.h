// Synthetic incident bundles: a small model trained for a few steps on random
// tokens (with the replay's own gradient code and PyTorch's AdamW), every
// checkpoint written as a real v1 bundle, and optionally one injected fault.
// They back `nanreplay demo`, `nanreplay synth` and the end-to-end tests.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "loaders/manifest.h"

namespace nanreplay {

enum class FaultKind {
  kNone,
  kHeadOverflow,   // one attention head's q/k weights grow until q k^T overflows
  kBitFlip,        // one weight element gets a flipped exponent bit
  kZeroEmbedding,  // one token's embedding row is zero (with norm_eps = 0)
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
  kGlitchToken,       // one sample holds a token no other sample of the step reads,
                      // whose embedding row has diverged beyond fp16's range
  kMlpOverflow,       // one mlp.up_proj row of a layer grows until its output overflows fp16
  kFp8ScaleCollapse,  // an fp8 input scale drops to 0 (amax went inf): dequantizing divides by 0
};

struct FaultSpec {
  FaultKind kind = FaultKind::kNone;
  int64_t step = -1;      // first checkpoint carrying the fault
  int layer = 0;          // head overflow
  int head = 0;           // head overflow
  std::string param;      // bit flip: parameter key
  int bit = 30;           // bit flip: bit of the fp32 encoding (30 = exponent MSB)
  int64_t position = 5;   // zero embedding, glitch token: position in the sample
  int rank = 0;           // glitch token: the rank reading the sample
  int slot = 0;           // glitch token: the sample's index in that rank's list for the step
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
  double loss_scale = 1024.0;   // fp16 only
  OptimizerConfig optimizer;
  bool record_samples = true;   // write explicit samples into each step entry too
  bool write_optimizer = true;
  bool checksums = true;
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
  int64_t fault_sample = -1;  // the sample carrying a data fault (glitch token)
  int64_t fault_token = -1;   // the glitch token
  std::vector<double> losses;
};

// Writes the bundle into `dir` (created; must not exist or be empty) via a
// temporary sibling directory renamed at the end.
SyntheticOutcome write_synthetic_bundle(const std::filesystem::path& dir, const SyntheticSpec& spec);

// Named presets: the clean ones (clean-*), one per fault kind, and demo.
std::vector<std::string> synthetic_preset_names();
SyntheticSpec synthetic_preset(const std::string& name);

}  // namespace nanreplay
