// A replay split across processes; see distributed.h. The only file that
// includes c10d: the rest of the replay sees tensors and bytes.
#include "replay/distributed.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <mutex>
#include <optional>
#include <utility>
#include <thread>

// Debian's LibTorch is built with Gloo; its header declares the group only
// when told so (TorchConfig's flags usually do).
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include "loaders/error.h"
#include "loaders/exit_cleanup.h"

namespace nanreplay {

namespace {

using Milliseconds = std::chrono::milliseconds;
constexpr const char* kEndClaims = "nanreplay/end-claims";  // the first process to end claims the end
constexpr const char* kEnd = "nanreplay/end";               // "<exit status>\t<line>"
constexpr const char* kEndAcks = "nanreplay/end-acks";      // the others that read it
constexpr const char* kLeft = "nanreplay/left";             // the others that finished, after the last barrier
constexpr int kHeaderSize = 8;  // defined, scalar type, dimensions, up to five sizes
enum Tag : int { kTensorHeader = 1, kTensorData = 2 };

std::string this_host() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "unknown host";
  return name;
}

// The first line of a c10 error, without its C++ backtrace.
std::string first_line(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  std::string text = c10_error ? c10_error->what_without_backtrace() : e.what();
  return text.substr(0, text.find('\n'));
}

std::string key(const char* what, int rank) { return std::string("nanreplay/") + what + "/" + std::to_string(rank); }

std::string as_string(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }
std::vector<uint8_t> as_bytes(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }

std::shared_ptr<::gloo::transport::Device> gloo_device(const std::string& master_addr) {
  if (master_addr == "127.0.0.1" || master_addr == "localhost") {
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  // As PyTorch: GLOO_SOCKET_IFNAME names the interface, else the host name's address.
  if (const char* interface = std::getenv("GLOO_SOCKET_IFNAME")) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(interface);
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

// What a process says when another ended first (`line` names that one).
std::string stopping_line(int exit_status, const std::string& line) {
  if (exit_status == static_cast<int>(ExitStatus::kInterrupted)) {
    return "interrupted on " + line + "; nothing was written";
  }
  return "stopping: " + line;
}

// LibTorch 2.4 and later default the TCPStore to libuv, which Debian's build
// lacks ("use_libuv was requested but PyTorch was build without libuv
// support"); the plain-socket store is in every build, 1.13's included, and
// ample for a few dozen processes. Set where the option exists.
template <typename Options>
auto without_libuv(Options& options, int) -> decltype(options.useLibUV = false, void()) {
  options.useLibUV = false;
}
template <typename Options>
void without_libuv(Options&, long) {}

Milliseconds timeout_of(const WorldSpec& spec) {
  return Milliseconds(static_cast<int64_t>(spec.timeout_seconds * 1000));
}

c10d::TCPStoreOptions store_options(const WorldSpec& spec, bool server) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(spec.master_port);
  options.isServer = server;
  options.timeout = timeout_of(spec);
  without_libuv(options, 0);
  return options;
}

[[noreturn]] void end_now(int exit_status, const std::string& line) {
  std::cerr << "nanreplay: " << line << std::endl;
  remove_for_exit();
  ::_exit(exit_status);
}

}  // namespace

std::vector<IndexRange> split_layers(int layers, const std::vector<double>& memory) {
  const size_t n = memory.size();
  double total = 0;
  for (double m : memory) total += std::max(m, 0.0);
  std::vector<int> count(n, 0);
  int given = 0;
  for (size_t p = 0; p < n; ++p) {  // each its whole share, then the rest by the largest remainders
    const double share = total > 0 ? layers * std::max(memory[p], 0.0) / total : double(layers) / double(n);
    count[p] = static_cast<int>(std::floor(share));
    given += count[p];
  }
  while (given < layers) {
    size_t best = 0;
    double best_rest = -1;
    for (size_t p = 0; p < n; ++p) {
      const double share = total > 0 ? layers * std::max(memory[p], 0.0) / total : double(layers) / double(n);
      const double rest = share - count[p];
      if (rest > best_rest + 1e-12) best = p, best_rest = rest;
    }
    ++count[best];
    ++given;
  }
  if (layers > 0 && count[0] == 0) {  // rank 0 runs the embeddings, so it starts the layers
    for (size_t p = n; p-- > 1;) {
      if (count[p] > 0) {
        --count[p];
        break;
      }
    }
    count[0] = 1;
  }
  std::vector<IndexRange> ranges;
  int first = 0;
  for (int c : count) {
    ranges.push_back({first, first + c});
    first += c;
  }
  return ranges;
}

IndexRange rank_block(int data_ranks, int processes, int process) {
  auto first = [&](int p) { return (p * data_ranks + processes - 1) / processes; };
  return {first(process), first(process + 1)};
}

struct ProcessWorld::Impl {
  WorldSpec spec;
  std::vector<std::string> hosts;
  std::vector<double> memory;
  c10::intrusive_ptr<c10d::TCPStore> store;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group;
  std::thread watcher;
  std::atomic<bool> closing{false};
  std::atomic<bool> announced{false};
  std::mutex store_mutex;  // the main thread's and the watcher's store calls

  std::string who(int rank) const {
    const std::string host = rank < static_cast<int>(hosts.size()) ? hosts[static_cast<size_t>(rank)] : "?";
    return "rank " + std::to_string(rank) + " (" + host + ")";
  }

  // Blocks until `work` completes; a peer that failed, vanished or did not
  // answer becomes PeerError naming it (`peer` -1: a collective).
  void wait(const c10::intrusive_ptr<c10d::Work>& work, int peer, const char* what);
  void wait_for(const std::function<c10::intrusive_ptr<c10d::Work>()>& start, int peer,
                const char* what) {
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = start();
    } catch (const std::exception& e) {
      throw explain(e, peer, what);
    }
    wait(work, peer, what);
  }
  PeerError explain(const std::exception& e, int peer, const char* what);
  std::optional<std::pair<int, std::string>> ended_peer();  // a peer's announced end: exit status, line
  void watch(const std::function<bool()>& stop_requested);
  bool claim_end(int exit_status, const std::string& line);
};

void ProcessWorld::Impl::wait(const c10::intrusive_ptr<c10d::Work>& work, int peer, const char* what) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    throw explain(e, peer, what);
  }
}

std::optional<std::pair<int, std::string>> ProcessWorld::Impl::ended_peer() {
  try {
    const std::lock_guard<std::mutex> lock(store_mutex);
    if (!store->check({kEnd})) return std::nullopt;
    const std::string end = as_string(store->get(kEnd));
    return std::pair(std::atoi(end.c_str()), end.substr(end.find('\t') + 1));
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// A peer that ended first says why; else the failed call is named.
PeerError ProcessWorld::Impl::explain(const std::exception& e, int peer, const char* what) {
  if (const auto ended = ended_peer()) return PeerError(stopping_line(ended->first, ended->second), ended->first);
  const std::string detail = first_line(e);
  const std::string whom = peer >= 0 ? who(peer) : "another process";
  if (detail.find("Timed out") != std::string::npos || detail.find("timed out") != std::string::npos) {
    return PeerError(who(spec.rank) + ": " + whom + " did not answer within " +
                     std::to_string(std::lround(spec.timeout_seconds)) + " s (" + what + "; --dist-timeout)");
  }
  return PeerError(who(spec.rank) + ": lost " + whom + " (" + what + "): " + detail);
}

bool ProcessWorld::Impl::claim_end(int exit_status, const std::string& line) {
  if (announced.exchange(true)) return false;
  try {
    const std::lock_guard<std::mutex> lock(store_mutex);
    if (store->add(kEndClaims, 1) != 1) return false;  // another process ended first
    store->set(kEnd, as_bytes(std::to_string(exit_status) + "\t" + line));
  } catch (const std::exception&) {
    return false;  // the store is gone with rank 0: the others find out from their own calls
  }
  if (spec.rank != 0) return true;
  // Rank 0 serves the store: it stays until the others have read the end (or a few seconds).
  for (int tries = 0; tries < 50; ++tries) {
    try {
      const std::lock_guard<std::mutex> lock(store_mutex);
      if (store->add(kEndAcks, 0) >= spec.world_size - 1) break;
    } catch (const std::exception&) {
      break;
    }
    std::this_thread::sleep_for(Milliseconds(100));
  }
  return true;
}

// Polls the store: a peer's announced end ends this process with the same
// status; a local stop request ends every process; a store gone ends this one.
void ProcessWorld::Impl::watch(const std::function<bool()>& stop_requested) {
  c10d::TCPStoreOptions options = store_options(spec, /*server=*/false);
  options.waitWorkers = false;
  c10::intrusive_ptr<c10d::TCPStore> own;  // a connection of its own: the main thread's may be busy
  try {
    own = c10::make_intrusive<c10d::TCPStore>(spec.master_addr, options);
  } catch (const std::exception&) {
    return;
  }
  auto stopped_at = std::chrono::steady_clock::time_point::max();
  while (!closing.load()) {
    std::this_thread::sleep_for(Milliseconds(100));
    if (closing.load()) return;
    if (stop_requested && stop_requested() && stopped_at == std::chrono::steady_clock::time_point::max()) {
      stopped_at = std::chrono::steady_clock::now();
      claim_end(static_cast<int>(ExitStatus::kInterrupted), who(spec.rank));
    }
    // The main thread leaves at its next safe point; one stuck in a collective is ended here.
    if (std::chrono::steady_clock::now() - stopped_at > std::chrono::seconds(2)) {
      end_now(static_cast<int>(ExitStatus::kInterrupted), "interrupted; nothing was written");
    }
    std::string end;
    try {
      if (!own->check({kEnd})) continue;
      end = as_string(own->get(kEnd));
    } catch (const std::exception&) {
      if (closing.load() || spec.rank == 0) return;
      end_now(static_cast<int>(ExitStatus::kInternal),
              "error: " + who(spec.rank) + ": lost " + who(0) + ", which serves the rendezvous: it stopped answering");
    }
    if (announced.load()) continue;  // this process ended first and is on its way out
    try {
      own->add(kEndAcks, 1);
    } catch (const std::exception&) {
    }
    const int status = std::atoi(end.c_str());
    const std::string line = stopping_line(status, end.substr(end.find('\t') + 1));
    end_now(status, status == static_cast<int>(ExitStatus::kInterrupted) ? line : "error: " + line);
  }
}

ProcessWorld::ProcessWorld(const WorldSpec& spec) : impl_(std::make_unique<Impl>()) {
  Impl& w = *impl_;
  w.spec = spec;
  const Milliseconds timeout = timeout_of(spec);
  const std::string master = spec.master_addr + ":" + std::to_string(spec.master_port);
  try {
    c10d::TCPStoreOptions options = store_options(spec, /*server=*/spec.rank == 0 && spec.serve_store);
    options.numWorkers = static_cast<size_t>(spec.world_size);
    options.waitWorkers = true;
    w.store = c10::make_intrusive<c10d::TCPStore>(spec.master_addr, options);
    w.store->set(key("host", spec.rank), as_bytes(this_host()));
    w.store->set(key("memory", spec.rank), as_bytes(std::to_string(spec.memory_bytes)));
    for (int r = 0; r < spec.world_size; ++r) {
      w.hosts.push_back(as_string(w.store->get(key("host", r))));
      w.memory.push_back(std::stod(as_string(w.store->get(key("memory", r)))));
    }
    auto gloo = c10d::ProcessGroupGloo::Options::create(timeout);
    gloo->devices.push_back(gloo_device(spec.master_addr));
    w.group = c10::make_intrusive<c10d::ProcessGroupGloo>(w.store, spec.rank, spec.world_size, gloo);
  } catch (const std::exception& e) {
    throw PeerError("rank " + std::to_string(spec.rank) + " (" + this_host() + "): the " +
                    std::to_string(spec.world_size) + " processes did not all meet at " + master + " within " +
                    std::to_string(std::lround(spec.timeout_seconds)) + " s: " + first_line(e));
  }
}

ProcessWorld::~ProcessWorld() {
  impl_->closing = true;
  if (impl_->watcher.joinable()) impl_->watcher.join();
}

void ProcessWorld::finish() {
  Impl& w = *impl_;
  w.wait_for([&] { return w.group->barrier(); }, -1, "the last barrier");
  w.closing = true;
  if (w.watcher.joinable()) w.watcher.join();
  // Rank 0 serves the store: it leaves last, so no watcher sees the store go and takes it for a failure.
  try {
    const std::lock_guard<std::mutex> lock(w.store_mutex);
    if (w.spec.rank != 0) {
      w.store->add(kLeft, 1);
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout_of(w.spec);
    while (w.store->add(kLeft, 0) < w.spec.world_size - 1 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(Milliseconds(5));
    }
  } catch (const std::exception&) {
  }
}

int ProcessWorld::rank() const { return impl_->spec.rank; }
int ProcessWorld::size() const { return impl_->spec.world_size; }
std::string ProcessWorld::who(int rank) const { return impl_->who(rank); }
const std::vector<double>& ProcessWorld::memory() const { return impl_->memory; }

void ProcessWorld::send(const torch::Tensor& tensor, int to) {
  const torch::Tensor host = tensor.defined() ? tensor.detach().cpu().contiguous() : tensor;
  std::vector<torch::Tensor> header{torch::zeros({kHeaderSize}, torch::kInt64)};
  auto* h = header[0].data_ptr<int64_t>();
  if (host.defined()) {
    TORCH_CHECK(host.dim() <= kHeaderSize - 3, "a tensor of more than five dimensions between processes");
    h[0] = 1;
    h[1] = static_cast<int64_t>(host.scalar_type());
    h[2] = host.dim();
    for (int64_t d = 0; d < host.dim(); ++d) h[3 + d] = host.size(d);
  }
  impl_->wait_for([&] { return impl_->group->send(header, to, kTensorHeader); }, to, "sending");
  if (!host.defined() || host.numel() == 0) return;
  std::vector<torch::Tensor> data{host};
  impl_->wait_for([&] { return impl_->group->send(data, to, kTensorData); }, to, "sending");
}

torch::Tensor ProcessWorld::receive(int from) {
  std::vector<torch::Tensor> header{torch::zeros({kHeaderSize}, torch::kInt64)};
  impl_->wait_for([&] { return impl_->group->recv(header, from, kTensorHeader); }, from, "receiving");
  const auto* h = header[0].data_ptr<int64_t>();
  if (h[0] == 0) return torch::Tensor();
  const std::vector<int64_t> sizes(h + 3, h + 3 + h[2]);
  const auto type = static_cast<c10::ScalarType>(h[1]);
  std::vector<torch::Tensor> data{torch::empty(sizes, torch::TensorOptions().dtype(type))};
  if (data[0].numel() == 0) return data[0];
  impl_->wait_for([&] { return impl_->group->recv(data, from, kTensorData); }, from, "receiving");
  return data[0];
}

void ProcessWorld::broadcast(torch::Tensor& tensor, int root) {
  std::vector<torch::Tensor> data{tensor.detach().cpu().contiguous()};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  impl_->wait_for([&] { return impl_->group->broadcast(data, options); }, root, "a broadcast");
  tensor = data[0];
}

std::vector<std::string> ProcessWorld::all_gather(const std::string& mine) {
  const int n = size();
  auto gather = [&](const torch::Tensor& input) {
    std::vector<torch::Tensor> in{input};
    std::vector<std::vector<torch::Tensor>> out(1);
    for (int r = 0; r < n; ++r) out[0].push_back(torch::empty_like(input));
    impl_->wait_for([&] { return impl_->group->allgather(out, in); }, -1, "gathering probe records");
    return out[0];
  };
  const std::vector<torch::Tensor> sizes = gather(torch::full({1}, static_cast<int64_t>(mine.size()), torch::kInt64));
  int64_t longest = 1;
  for (const torch::Tensor& s : sizes) longest = std::max(longest, s.item<int64_t>());
  torch::Tensor padded = torch::zeros({longest}, torch::kUInt8);
  std::memcpy(padded.data_ptr(), mine.data(), mine.size());
  std::vector<std::string> all;
  const std::vector<torch::Tensor> gathered = gather(padded);
  for (int r = 0; r < n; ++r) {
    all.emplace_back(static_cast<const char*>(gathered[static_cast<size_t>(r)].data_ptr()),
                     static_cast<size_t>(sizes[static_cast<size_t>(r)].item<int64_t>()));
  }
  return all;
}

void ProcessWorld::watch(std::function<bool()> stop_requested) {
  impl_->watcher = std::thread([this, stop = std::move(stop_requested)] { impl_->watch(stop); });
}

void ProcessWorld::announce_end(int exit_status, const std::string& line) { impl_->claim_end(exit_status, line); }

namespace {
std::shared_ptr<ProcessWorld>& world_slot() {
  static std::shared_ptr<ProcessWorld> world;
  return world;
}
}  // namespace

void set_default_world(std::shared_ptr<ProcessWorld> world) { world_slot() = std::move(world); }
ProcessWorld* default_world() {
  ProcessWorld* world = world_slot().get();
  return world != nullptr && world->size() > 1 ? world : nullptr;
}

}  // namespace nanreplay
