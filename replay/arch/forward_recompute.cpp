// See forward_recompute.h.
#include "replay/arch/forward_recompute.h"

namespace nanreplay {

namespace {
thread_local bool recomputing_forward = false;
}  // namespace

ForwardRecompute::ForwardRecompute() : outer_(recomputing_forward) { recomputing_forward = true; }

ForwardRecompute::~ForwardRecompute() { recomputing_forward = outer_; }

bool ForwardRecompute::active() { return recomputing_forward; }

}  // namespace nanreplay
