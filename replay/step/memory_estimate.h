// How much memory a replay will need, estimated from the manifest alone, and
// how much this machine can give it. Key constraint: no LibTorch and no
// allocation sized by the bundle here: the check runs right after the manifest
// is read, before any checkpoint is opened, so a hostile or merely huge bundle
// is refused with an estimate instead of being discovered by the OOM killer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "loaders/bundle/manifest.h"

namespace nanreplay {

// Peak bytes of one replay, by what holds them. Doubles, because a hostile
// manifest may describe a model whose byte count overflows 64 bits.
struct MemoryEstimate {
  double parameters = 0;   // fp32 masters, the mapped checkpoint, rounded weight copies
  double gradients = 0;    // parameter grads, each rank's unscaled copy, the accumulated sum
  double activations = 0;  // what autograd keeps for one micro-batch, plus the backward's working set
  double probes = 0;       // probe records kept for the report and the trace
  double rolling = 0;      // rolling forward: the derived parameters, both AdamW moments, one copy for the self-checks
  double runtime = 0;      // LibTorch, its thread pools and the process itself
  double total() const { return parameters + gradients + activations + probes + rolling + runtime; }
};

// The parameter tensors and elements of the manifest's model, as
// probes/sites.h's expected_parameters lists them, counted without building
// the list: a manifest claiming a billion experts is refused by this count
// (replay/step/bundle_structure.cpp) before a list of that length exists.
struct ParameterCount {
  double tensors = 0;
  double elements = 0;
};
ParameterCount count_model_parameters(const ModelConfig& model);

// `steps_with_probes`: how many steps' probe records are held at once (a
// `run` streams them to the trace: replay/probing/probe_retention.h bounds it);
// `probes`: whether probes are on; `rolls_forward`: some step is derived.
MemoryEstimate estimate_replay_memory(const Manifest& manifest, size_t steps_with_probes, bool probes,
                                      bool rolls_forward = false);

// The same replay streamed layer by layer (replay/step/layer_stream.h): one
// block's parameters, gradients and working set at a time, the embeddings
// and head for the whole pass, and the residual stream entering every block.
MemoryEstimate estimate_streamed_memory(const Manifest& manifest, size_t steps_with_probes, bool probes,
                                        bool rolls_forward = false);

// A memory limit and where it came from, for the refusal message.
struct MemoryLimit {
  uint64_t bytes = 0;
  std::string source;  // "--max-memory" or "80% of available memory (MemAvailable)"
};

// 80% of what the machine can give a new process: the smaller of MemAvailable
// (/proc/meminfo) and the cgroup's memory limit; physical memory when neither
// can be read.
MemoryLimit default_memory_limit();

// "8G", "512M", "1.5GiB", "4096": K, M, G, T (with or without "i" and "B")
// are powers of 1024. Throws UsageError on anything else, or on 0.
uint64_t parse_memory_size(const std::string& text);

// "1.5 GiB", "512.0 MiB", "800 bytes".
std::string format_bytes(double bytes);

// Whether the replay streams layer by layer: when asked (`stream`), or when
// only the streamed replay fits the limit. Throws UsageError with both
// estimates, and which one would fit, when the mode asked for (or either,
// unasked) does not fit: the breakdown, the limit, what most of it is.
bool choose_layer_streaming(const MemoryEstimate& in_memory, const MemoryEstimate& streamed,
                            const MemoryLimit& limit, bool stream);

}  // namespace nanreplay
