// Runner of the CUDA kernel tests: without a CUDA device (CI machines have
// nvcc but no GPU) it reports the skip and exits 77, which CTest counts as
// skipped rather than passed; with one it runs Catch2 as usual.
#include <cstdio>

#include "kernels/tensor_stats_cuda.h"
#include "tests/catch/catch_session.h"

int main(int argc, char** argv) {
  if (!nanreplay::cuda::device_available()) {
    std::printf("no CUDA device: the [gpu] tests are skipped\n");
    return 77;
  }
  return nanreplay_test::run_catch_session(argc, argv);
}
