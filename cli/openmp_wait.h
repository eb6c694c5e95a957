// The OpenMP spin a replay runs with; see openmp_wait.cpp for why.
#pragma once

namespace nanreplay {

// Set (to "1") in the environment of a process this module re-executed, so
// a child that must see the user's own environment (the benchmark's eager
// PyTorch baseline) can drop the spin setting again.
constexpr const char* kSpinSetByNanreplay = "NANREPLAY_SET_GOMP_SPINCOUNT";
constexpr const char* kShortSpinCount = "10000";

// Where LibTorch's OpenMP pool (libgomp) and OpenBLAS's pthread pool share the
// cores and the user chose no OpenMP wait policy, re-executes this program
// with a short libgomp spin (GOMP_SPINCOUNT); otherwise, or if exec fails,
// returns and the process goes on as it is.
void reexec_with_short_openmp_spin(char** argv);

}  // namespace nanreplay
