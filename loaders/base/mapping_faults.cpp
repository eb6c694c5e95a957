// The SIGBUS handler and its registry; see mapping_faults.h. Key constraint:
// the handler runs in signal context, in any thread, possibly inside
// LibTorch: it only reads atomics, calls mmap and stores a flag (no locks, no
// allocation), and it never touches a range that is not registered.
#include "loaders/base/mapping_faults.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <mutex>

namespace nanreplay {

class MappingFaultSlot {
 public:
  std::atomic<bool> taken{false};
  std::atomic<uintptr_t> begin{0};  // 0 while not watching
  std::atomic<uintptr_t> end{0};
  std::atomic<bool> faulted{false};
};

namespace {

constexpr size_t kSlotsPerChunk = 256;

struct SlotChunk {
  MappingFaultSlot slots[kSlotsPerChunk];
  SlotChunk* next = nullptr;  // set before the chunk is published, never changed after
};

std::atomic<SlotChunk*> g_chunks{nullptr};
uintptr_t g_page_size = 4096;
struct sigaction g_previous_action {};

// A SIGBUS that is not ours: whoever handled it before (a sanitizer), else the
// default action, which ends the process with SIGBUS as if we were not here.
void pass_on(int signal_number, siginfo_t* info, void* context) {
  if ((g_previous_action.sa_flags & SA_SIGINFO) != 0 && g_previous_action.sa_sigaction != nullptr) {
    g_previous_action.sa_sigaction(signal_number, info, context);
    return;
  }
  if ((g_previous_action.sa_flags & SA_SIGINFO) == 0 && g_previous_action.sa_handler != SIG_DFL &&
      g_previous_action.sa_handler != SIG_IGN) {
    g_previous_action.sa_handler(signal_number);
    return;
  }
  struct sigaction default_action {};
  default_action.sa_handler = SIG_DFL;
  sigemptyset(&default_action.sa_mask);
  sigaction(SIGBUS, &default_action, nullptr);
  // Pending until the handler returns; a hardware fault would also simply recur.
  raise(SIGBUS);
}

// Replaces [faulting page, end of the mapping) with zero pages; false when
// the address lies in no registered mapping.
bool absorb_fault(uintptr_t address) {
  for (SlotChunk* chunk = g_chunks.load(std::memory_order_acquire); chunk != nullptr; chunk = chunk->next) {
    for (MappingFaultSlot& slot : chunk->slots) {
      const uintptr_t begin = slot.begin.load(std::memory_order_acquire);
      const uintptr_t end = slot.end.load(std::memory_order_acquire);
      if (begin == 0 || address < begin || address >= end) continue;
      const uintptr_t first = address & ~(g_page_size - 1);
      const uintptr_t last = (end + g_page_size - 1) & ~(g_page_size - 1);
      void* zeros = mmap(reinterpret_cast<void*>(first), last - first, PROT_READ,
                         MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (zeros == MAP_FAILED) return false;
      slot.faulted.store(true, std::memory_order_release);
      return true;
    }
  }
  return false;
}

void on_sigbus(int signal_number, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  // si_code > 0: raised by the kernel for a memory access, not sent with kill().
  const bool absorbed = info != nullptr && info->si_code > 0 &&
                        absorb_fault(reinterpret_cast<uintptr_t>(info->si_addr));
  if (!absorbed) pass_on(signal_number, info, context);
  errno = saved_errno;
}

void install_handler() {
  g_page_size = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  struct sigaction action {};
  action.sa_sigaction = on_sigbus;
  action.sa_flags = SA_SIGINFO;
  sigemptyset(&action.sa_mask);
  sigaction(SIGBUS, &action, &g_previous_action);
}

}  // namespace

MappingFaultSlot* watch_mapping_faults(const void* begin, size_t length) {
  static std::once_flag installed;
  std::call_once(installed, install_handler);
  const auto first = reinterpret_cast<uintptr_t>(begin);
  while (true) {
    for (SlotChunk* chunk = g_chunks.load(std::memory_order_acquire); chunk != nullptr; chunk = chunk->next) {
      for (MappingFaultSlot& slot : chunk->slots) {
        bool free_slot = false;
        if (!slot.taken.compare_exchange_strong(free_slot, true)) continue;
        slot.faulted.store(false);
        slot.end.store(first + length, std::memory_order_release);
        slot.begin.store(first, std::memory_order_release);
        return &slot;
      }
    }
    // Every slot taken: publish another chunk and claim from it.
    auto* chunk = new SlotChunk;
    chunk->next = g_chunks.load(std::memory_order_acquire);
    while (!g_chunks.compare_exchange_weak(chunk->next, chunk, std::memory_order_acq_rel)) {
    }
  }
}

void unwatch_mapping_faults(MappingFaultSlot* slot) {
  if (slot == nullptr) return;
  slot->begin.store(0, std::memory_order_release);
  slot->end.store(0, std::memory_order_release);
  slot->faulted.store(false);
  slot->taken.store(false, std::memory_order_release);
}

bool mapping_faulted(const MappingFaultSlot* slot) {
  return slot != nullptr && slot->faulted.load(std::memory_order_acquire);
}

}  // namespace nanreplay
