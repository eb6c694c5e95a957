// Runner of the CUDA kernel tests: without a CUDA device (CI machines have
// nvcc but no GPU) it reports the skip and exits 77, which CTest counts as
// skipped rather than passed; with one it runs Catch2 as usual.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <cstdio>

#include "kernels/tensor_stats_cuda.h"

int main(int argc, char** argv) {
  if (!nanreplay::cuda::device_available()) {
    std::printf("no CUDA device: the [gpu] tests are skipped\n");
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
