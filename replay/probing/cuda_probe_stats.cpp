#include "replay/probing/cuda_probe_stats.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#if defined(NANREPLAY_TORCH_CUDA) && defined(NANREPLAY_HAVE_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/torch.h>

#include "kernels/tensor_stats_cuda.h"
#include "replay/probing/device_stats.h"
#define NANREPLAY_CUDA_PROBES 1
#else
#define NANREPLAY_CUDA_PROBES 0
#endif

namespace nanreplay {

#if NANREPLAY_CUDA_PROBES

namespace {

// Slots per device buffer; a step that probes more chains another buffer.
constexpr int64_t kSlotsPerBuffer = 4096;

}  // namespace

struct CudaProbeStats::Impl {
  // Buffers in the order they were filled; each queues on one stream of one
  // device: the stream that was current for the tensors it probes, so a
  // probe runs after the work that wrote its tensor and before any later
  // work on that stream reuses the memory.
  struct Buffer {
    int device;
    CUstream_st* stream;
    std::unique_ptr<cuda::DeviceStatsBuffer> stats;
  };
  std::vector<Buffer> buffers;
  // (buffer, slot) of each result, in ticket order.
  std::vector<std::pair<size_t, int64_t>> results;

  size_t buffer_for(int device, CUstream_st* stream, int64_t slots) {
    for (size_t i = buffers.size(); i-- > 0;) {
      if (buffers[i].device != device || buffers[i].stream != stream) continue;
      const cuda::DeviceStatsBuffer& b = *buffers[i].stats;
      if (b.capacity() - b.size() >= slots) return i;
      break;  // the newest buffer of this stream is full: chain another
    }
    buffers.push_back({device, stream, std::make_unique<cuda::DeviceStatsBuffer>(std::max(kSlotsPerBuffer, slots), stream)});
    return buffers.size() - 1;
  }
};

bool CudaProbeStats::available() {
  static const bool available = [] {  // asked per probe: read the environment once
    const char* choice = std::getenv("NANREPLAY_GPU_STATS");
    return choice == nullptr || std::strcmp(choice, "torch") != 0;
  }();
  return available;
}

bool CudaProbeStats::accepts(const torch::Tensor& t) {
  const auto type = t.scalar_type();
  return t.is_cuda() && (type == torch::kFloat32 || type == torch::kBFloat16 || type == torch::kHalf);
}

CudaProbeStats::CudaProbeStats() : impl_(std::make_unique<Impl>()) {}
CudaProbeStats::~CudaProbeStats() = default;

CudaProbeStats::Ticket CudaProbeStats::add(const torch::Tensor& tensor, bool per_head, bool causal) {
  // A contiguous copy, when one is made, is freed after the launch: the
  // caching allocator reuses it only for work queued later on this stream.
  const torch::Tensor t = tensor.detach().contiguous();
  const int device = t.get_device();
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const int64_t slots = per_head ? t.size(1) : 1;
  CUstream_st* stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  const size_t index = impl_->buffer_for(device, stream, slots);
  cuda::DeviceStatsBuffer& buffer = *impl_->buffers[index].stats;
  const int64_t first = per_head ? buffer.add_heads(t.data_ptr(), elem_type_of(t), t.size(0), t.size(1), t.size(2),
                                                    t.size(3), causal)
                                 : buffer.add(t.data_ptr(), elem_type_of(t), t.numel());
  const Ticket ticket{static_cast<int64_t>(impl_->results.size()), slots};
  for (int64_t s = 0; s < slots; ++s) impl_->results.emplace_back(index, first + s);
  return ticket;
}

std::vector<TensorStats> CudaProbeStats::collect() {
  std::vector<std::vector<TensorStats>> per_buffer;
  per_buffer.reserve(impl_->buffers.size());
  for (Impl::Buffer& b : impl_->buffers) {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(b.device));
    per_buffer.push_back(b.stats->collect());
  }
  std::vector<TensorStats> out;
  out.reserve(impl_->results.size());
  for (const auto& [buffer, slot] : impl_->results) out.push_back(per_buffer.at(buffer).at(static_cast<size_t>(slot)));
  impl_->results.clear();
  impl_->buffers.clear();  // a session collects once; the next one makes its own
  return out;
}

#else  // no CUDA kernel in this build: never available, never called

struct CudaProbeStats::Impl {};
bool CudaProbeStats::available() { return false; }
bool CudaProbeStats::accepts(const torch::Tensor&) { return false; }
CudaProbeStats::CudaProbeStats() = default;
CudaProbeStats::~CudaProbeStats() = default;
CudaProbeStats::Ticket CudaProbeStats::add(const torch::Tensor&, bool, bool) {
  throw std::logic_error("CudaProbeStats::add: built without the CUDA statistics kernel");
}
std::vector<TensorStats> CudaProbeStats::collect() { return {}; }

#endif

}  // namespace nanreplay
