// Main of the GPU tests: without a CUDA device (a CPU LibTorch, or no GPU on
// the machine) it exits 77, which CTest reports as skipped, not passed.
// Catch2's implementation comes compiled once from tests/catch/.
#include <cstdio>

#include <torch/cuda.h>

#include "tests/catch/catch_session.h"

int main(int argc, char** argv) {
  if (!torch::cuda::is_available()) {
    std::puts("no CUDA device visible to this build: GPU tests skipped");
    return 77;
  }
  return nanreplay_test::run_catch_session(argc, argv);
}
