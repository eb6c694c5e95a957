// LibTorch runs element-wise ops on libgomp's OpenMP pool while Debian's
// OpenBLAS runs matmuls on a pthread pool of its own. By default libgomp's
// idle threads spin for about 300000 iterations after each parallel region,
// holding the cores OpenBLAS's threads need next: a replay step of a
// hidden-512, 8-layer llama took 2.1 s on 2 cores instead of 0.8 s with a short
// spin (docs/performance.md). libgomp reads GOMP_SPINCOUNT only in its
// initializer, which has run before main() (and before .preinit_array
// functions could make a setenv stick, since libc resets environ after them),
// so the only way to choose is to exec the program again with the variable
// set. That costs one more start of the executable (about 0.5 s of dynamic
// loading), so only the commands that replay call it, and only when both
// pools exist. OMP_WAIT_POLICY or GOMP_SPINCOUNT set by the user win.
#include "cli/openmp_wait.h"

#include <unistd.h>

#include <csignal>
#include <cstdlib>

#include "replay/runtime.h"

namespace nanreplay {

void reexec_with_short_openmp_spin(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr || std::getenv("GOMP_SPINCOUNT") != nullptr) return;
  if (std::getenv("NANREPLAY_KEEP_OPENMP_SPIN") != nullptr) return;  // to measure the default
  if (!blas_has_own_thread_pool()) return;
  if (setenv("GOMP_SPINCOUNT", kShortSpinCount, 1) != 0 || setenv(kSpinSetByNanreplay, "1", 1) != 0) return;
  // A stop signal while the new image loads stays pending (the mask survives
  // exec) until its handlers are installed and unblock it (cli_support.h),
  // instead of killing it with 143.
  sigset_t stop_signals;
  sigset_t previous;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, &previous);
  execv("/proc/self/exe", argv);
  // exec failed (no /proc?): carry on with libgomp's default spin.
  pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  unsetenv("GOMP_SPINCOUNT");
  unsetenv(kSpinSetByNanreplay);
}

}  // namespace nanreplay
