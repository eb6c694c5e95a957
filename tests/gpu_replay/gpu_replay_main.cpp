// Main of the GPU tests: without a CUDA device (a CPU LibTorch, or no GPU on
// the machine) it exits 77, which CTest reports as skipped, not passed.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>

#include <torch/cuda.h>

int main(int argc, char** argv) {
  if (!torch::cuda::is_available()) {
    std::puts("no CUDA device visible to this build: GPU tests skipped");
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
