// The layer-streamed backward (replay/step/layer_stream.h) computes each piece
// of the forward a second time to build its graph. What a step counts once per
// pass (routed tokens, multi-token prediction's losses) must not count the
// second computation: the recorders skip a record made inside a
// ForwardRecompute, on the thread that opened it (a step's ranks may run on
// threads of their own). Maxima would not change; they are skipped alike.
#pragma once

namespace nanreplay {

class ForwardRecompute {
 public:
  ForwardRecompute();
  ~ForwardRecompute();
  ForwardRecompute(const ForwardRecompute&) = delete;
  ForwardRecompute& operator=(const ForwardRecompute&) = delete;

  // A ForwardRecompute is open on this thread.
  static bool active();

 private:
  bool outer_;  // the one open before (nested scopes restore it)
};

}  // namespace nanreplay
