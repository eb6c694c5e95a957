// Which earlier keys a query of one attention layer sees: the shape of its
// causal mask. Every probe of a causal site (attn.scores, attn.probs) counts
// these keys only, and the forward masks the others. No LibTorch here.
#pragma once

#include <algorithm>
#include <cstdint>

namespace nanreplay {

struct AttentionSpan {
  // Sliding attention: query i sees keys j with i - window < j <= i (0: no window).
  int64_t window = 0;
  // Chunked attention (Llama 4): query i sees keys j <= i with j / chunk == i / chunk (0: no chunks).
  int64_t chunk = 0;

  AttentionSpan() = default;
  // A sliding window alone: the span most callers name by its width.
  AttentionSpan(int64_t sliding_window) : window(sliding_window) {}  // NOLINT(google-explicit-constructor)
  static AttentionSpan chunked(int64_t chunk_size) {
    AttentionSpan span;
    span.chunk = chunk_size;
    return span;
  }

  // Every earlier key: plain causal attention.
  bool full() const { return window == 0 && chunk == 0; }
  bool valid() const { return window >= 0 && chunk >= 0; }
  // The first key query `query` sees; it sees every key from there to itself.
  int64_t first_key(int64_t query) const {
    int64_t first = 0;
    if (window > 0) first = std::max<int64_t>(first, query - window + 1);
    if (chunk > 0) first = std::max<int64_t>(first, query / chunk * chunk);
    return first;
  }
};

}  // namespace nanreplay
