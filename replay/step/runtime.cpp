// See runtime.h.
#include "replay/step/runtime.h"

#include <algorithm>
#include <thread>

#include <dlfcn.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <torch/torch.h>
#include <torch/cuda.h>

#include "loaders/base/error.h"
#include "replay/step/checkpoint.h"

namespace nanreplay {

void validate_devices(const std::vector<std::string>& names, bool cross_check) {
  if (names.empty() || names.size() > 2) {
    throw UsageError("--device takes one device or two separated by a comma (cpu, cuda:0, cuda:0,cuda:1)");
  }
  const std::vector<torch::Device> devices = placement_for(names, false, Compute::kFp32).devices;
  if (cross_check && (devices.size() != 2 || devices[0].type() != devices[1].type())) {
    throw UsageError("--cross-check needs two devices of the same kind (--device cuda:0,cuda:1): "
                     "different kinds of device compute with different kernels by design");
  }
  for (size_t i = 0; i < devices.size(); ++i) {
    if (!devices[i].is_cuda()) continue;
    if (!torch::cuda::is_available()) {
#ifdef NANREPLAY_TORCH_CUDA
      throw UsageError("--device " + names[i] + ": no CUDA device is available on this machine");
#else
      throw UsageError("--device " + names[i] + ": this nanreplay was built against a LibTorch without "
                       "CUDA; rebuild against a CUDA LibTorch (docs/gpu.md) or use --device cpu");
#endif
    }
    if (devices[i].index() >= static_cast<int>(torch::cuda::device_count())) {
      throw UsageError("--device " + names[i] + ": only " + std::to_string(torch::cuda::device_count()) +
                       " CUDA device(s) visible");
    }
  }
}

void tune_heap_for_replay() {
#if defined(__GLIBC__)
  // glibc's own ceiling for its adaptive mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX
  // on 64-bit), and the trim threshold it pairs with it (twice as much).
  constexpr int kMmapThreshold = 32 << 20;
  mallopt(M_MMAP_THRESHOLD, kMmapThreshold);
  mallopt(M_TRIM_THRESHOLD, 2 * kMmapThreshold);
#endif
}

void set_compute_threads(int threads) {
  const int count = threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  torch::set_num_threads(count);
  // LibTorch's count does not reach a BLAS with its own thread pool, which
  // would still use every core: cap it as well.
  using SetBlasThreads = void (*)(int);
  if (const auto set_blas_threads =
          reinterpret_cast<SetBlasThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    set_blas_threads(count);
  }
}

BlasInUse blas_in_use() {
  // Looked up at run time, so a LibTorch on another BLAS links as before.
  // OpenBLAS reports its threading model: 0 sequential, 1 pthreads, 2 OpenMP.
  BlasInUse blas;
  using GetParallel = int (*)();
  using GetConfig = char* (*)();
  void* const parallel_symbol = dlsym(RTLD_DEFAULT, "openblas_get_parallel");
  if (parallel_symbol == nullptr) return blas;
  const int model = reinterpret_cast<GetParallel>(parallel_symbol)();
  blas.threading = model == 2 ? "OpenMP" : model == 1 ? "pthreads" : "sequential";
  if (const auto get_config = reinterpret_cast<GetConfig>(dlsym(RTLD_DEFAULT, "openblas_get_config"))) {
    blas.description = get_config();
  } else {
    blas.description = "OpenBLAS";
  }
  Dl_info where{};
  if (dladdr(parallel_symbol, &where) != 0 && where.dli_fname != nullptr) blas.path = where.dli_fname;
  return blas;
}

void return_freed_memory() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

}  // namespace nanreplay
