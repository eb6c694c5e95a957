// A replay split across processes; see distributed.h. The only file that
// includes c10d's process groups: the rest of the replay sees tensors and bytes.
#include "replay/step/ranks/distributed.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
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
#include <type_traits>
#include <utility>
#include <thread>

// The backends the build found (CMakeLists.txt). Gloo's header declares the
// group only when told so (TorchConfig's flags usually do).
#if defined(NANREPLAY_HAVE_GLOO)
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#if defined(NANREPLAY_HAVE_NCCL)
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL 1
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include "loaders/base/error.h"
#include "loaders/base/exit_cleanup.h"
#include "replay/step/ranks/dist_admission.h"
#include "replay/step/ranks/run_secret.h"

namespace nanreplay {

namespace {

using Milliseconds = std::chrono::milliseconds;
// Under the run's own key prefix (dist_admission.h), which only holders of the secret can compute.
constexpr const char* kEndClaims = "end-claims";  // the first process to end claims the end
constexpr const char* kEnd = "end";               // tagged "<exit status>\t<line>"
constexpr const char* kEndAcks = "end-acks";      // the others that read it
constexpr const char* kDeparted = "left";         // the others that finished, after the last barrier
constexpr int kHeaderFields = 8;  // defined, scalar type, dimensions, up to five sizes
constexpr int kTagFields = 4;     // a tag: 32 bytes
enum Tag : int { kTensorHeader = 1, kTensorData = 2 };

#if defined(NANREPLAY_HAVE_GLOO)
using AnyGroup = c10d::ProcessGroupGloo;
#elif defined(NANREPLAY_HAVE_NCCL)
using AnyGroup = c10d::ProcessGroupNCCL;
#endif
#if defined(NANREPLAY_HAVE_GLOO) || defined(NANREPLAY_HAVE_NCCL)
// LibTorch 1.13's groups derive from ProcessGroup, 2.x's from Backend; their calls are the same.
using Group = std::conditional_t<std::is_base_of_v<c10d::Backend, AnyGroup>, c10d::Backend, c10d::ProcessGroup>;
#else
using Group = c10d::ProcessGroup;  // never made: no backend was built
#endif

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


bool is_loopback(const std::string& addr) { return addr == "127.0.0.1" || addr == "localhost" || addr == "::1"; }

#if defined(NANREPLAY_HAVE_GLOO)
// Gloo listens where its device binds: loopback for one host, else the
// interface named (--dist-interface, else GLOO_SOCKET_IFNAME as PyTorch),
// else the host name's address.
std::shared_ptr<::gloo::transport::Device> gloo_device(const WorldSpec& spec) {
  if (is_loopback(spec.master_addr)) return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  if (!spec.interface.empty()) return c10d::ProcessGroupGloo::createDeviceForInterface(spec.interface);
  if (const char* interface = std::getenv("GLOO_SOCKET_IFNAME")) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(interface);
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}
#endif

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

// A socket listening on `addr`:`port` (an IPv4 address), or -1.
int listening_socket(const std::string& addr, int port) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, is_loopback(addr) ? "127.0.0.1" : addr.c_str(), &address.sin_addr) != 1) return -1;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int on = 1;
  if (fd >= 0 && ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on)) == 0 &&
      ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 && ::listen(fd, 128) == 0) {
    return fd;
  }
  if (fd >= 0) ::close(fd);
  return -1;
}

// LibTorch 2.x serves the store on a socket it is given (masterListenFd):
// bound to loopback for one host, to --master-addr when that is an address.
// 1.13 has no such option and listens on every interface: there the port
// is open, but nothing on it is of use without the secret (docs/distributed.md).
// The store owns the socket from here on.
template <typename Options>
auto serve_on_master_addr(Options& options, const WorldSpec& spec, int)
    -> decltype(options.masterListenFd = 0, void()) {
  const int fd = listening_socket(spec.master_addr, spec.master_port);
  if (fd >= 0) options.masterListenFd = fd;
}
template <typename Options>
void serve_on_master_addr(Options&, const WorldSpec&, long) {}

Milliseconds timeout_of(const WorldSpec& spec) {
  return Milliseconds(static_cast<int64_t>(spec.timeout_seconds * 1000));
}

c10d::TCPStoreOptions store_options(const WorldSpec& spec, bool server) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(spec.master_port);
  options.isServer = server;
  options.timeout = timeout_of(spec);
  without_libuv(options, 0);
  if (server) serve_on_master_addr(options, spec, 0);
  return options;
}

[[noreturn]] void end_now(int exit_status, const std::string& line) {
  std::cerr << "nanreplay: " << line << std::endl;
  remove_for_exit();
  ::_exit(exit_status);
}

// The process group of `backend` on `store` (the run's prefix), or UsageError.
c10::intrusive_ptr<Group> make_group(const std::string& backend, const c10::intrusive_ptr<c10d::Store>& store,
                                     const WorldSpec& spec) {
#if defined(NANREPLAY_HAVE_GLOO)
  if (backend == "gloo") {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout_of(spec));
    options->devices.push_back(gloo_device(spec));
    return c10::make_intrusive<c10d::ProcessGroupGloo>(store, spec.rank, spec.world_size, options);
  }
#endif
#if defined(NANREPLAY_HAVE_NCCL)
  if (backend == "nccl") {
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout_of(spec);
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, spec.rank, spec.world_size, options);
  }
#endif
  (void)store;
  (void)spec;
  throw UsageError("the c10d backend " + backend + " was not built into this nanreplay");
}

// A tag over what one message carries: who sent it to whom, its place in
// their exchange, and the SHA-256 of its bytes.
std::string exchange_tag(const std::string& secret, const std::string& context, const std::string& digest) {
  return hmac_sha256(secret, context + '\0' + digest);
}

std::string tensor_digest(const torch::Tensor& host) {
  return sha256(host.data_ptr(), static_cast<size_t>(host.numel()) * host.element_size());
}

}  // namespace

std::vector<std::string> built_backends() {
  std::vector<std::string> built;
#if defined(NANREPLAY_HAVE_GLOO)
  built.push_back("gloo");
#endif
#if defined(NANREPLAY_HAVE_NCCL)
  built.push_back("nccl");
#endif
  return built;
}

std::string choose_backend(const std::string& asked, const std::string& device) {
  const std::vector<std::string> built = built_backends();
  const bool cuda = device.rfind("cuda", 0) == 0;
  auto has = [&](const std::string& name) { return std::find(built.begin(), built.end(), name) != built.end(); };
  std::string built_text;
  for (const std::string& name : built) built_text += (built_text.empty() ? "" : ", ") + name;
  if (built_text.empty()) built_text = "none";
  if (asked != "auto" && asked != "gloo" && asked != "nccl") {
    throw UsageError("--dist-backend " + asked + ": auto, gloo or nccl");
  }
  const std::string chosen = asked != "auto" ? asked : cuda && has("nccl") ? "nccl" : "gloo";
  if (!has(chosen)) {
    const std::string lacking = "this nanreplay was built without the c10d backend " + chosen + " (it has: " +
                                built_text + "; docs/distributed.md, \"Backends\")";
    throw UsageError(asked == "auto" ? "a replay across processes on " + device + ": " + lacking
                                     : "--dist-backend " + asked + ": " + lacking);
  }
  if (chosen == "nccl" && !cuda) throw UsageError("--dist-backend nccl exchanges CUDA tensors: give --device cuda");
  return chosen;
}

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
  std::string backend;  // "gloo" or "nccl"
  std::vector<std::string> hosts;
  std::vector<double> memory;
  std::string prefix;  // the run's own keys (dist_admission.h)
  c10::intrusive_ptr<c10d::TCPStore> store;
  c10::intrusive_ptr<Group> group;
  std::vector<uint64_t> sent, received;  // messages to and from each peer: their place in the exchange
  uint64_t collectives = 0;
  std::thread watcher;
  std::atomic<bool> closing{false};
  std::atomic<bool> announced{false};
  std::atomic<bool> forged_said{false};
  std::mutex store_mutex;  // the main thread's and the watcher's store calls

  std::string key(const char* what) const { return prefix + what; }
  // Gloo's tensors pass through host memory, where they are tagged; NCCL's stay on the device, untagged.
  bool host_exchange() const { return backend != "nccl"; }
  torch::Device exchange_device() const { return host_exchange() ? torch::Device(torch::kCPU) : torch::Device(spec.device); }

  std::string who(int rank) const {
    const std::string host = rank < static_cast<int>(hosts.size()) ? hosts[static_cast<size_t>(rank)] : "?";
    return "rank " + std::to_string(rank) + " (" + printable(host) + ")";
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
  // The end a peer announced, when its tag verifies; a forged one is said once and ignored.
  std::optional<std::pair<int, std::string>> read_end(c10d::Store& from);
  std::optional<std::pair<int, std::string>> ended_peer();  // a peer's announced end: exit status, line
  void watch(const std::function<bool()>& stop_requested);
  bool claim_end(int exit_status, const std::string& line);
  std::string context(const char* what, int from, int to, uint64_t place) const {
    return prefix + what + "\t" + std::to_string(from) + "\t" + std::to_string(to) + "\t" + std::to_string(place);
  }
  PeerError forged(int peer, const char* what) const {
    return PeerError(who(spec.rank) + ": " + what + " from " + who(peer) +
                     " do not carry this run's tag: a process without the secret is in the exchange");
  }
};

void ProcessWorld::Impl::wait(const c10::intrusive_ptr<c10d::Work>& work, int peer, const char* what) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    throw explain(e, peer, what);
  }
}

std::optional<std::pair<int, std::string>> ProcessWorld::Impl::read_end(c10d::Store& from) {
  if (!from.check({key(kEnd)})) return std::nullopt;
  std::string end;
  if (!untagged(spec.secret, key(kEnd), as_string(from.get(key(kEnd))), end)) {
    if (!forged_said.exchange(true)) {
      std::cerr << "nanreplay: warning: " << who(spec.rank) << ": ignored the store key " << key(kEnd)
                << ": its value does not carry this run's tag" << std::endl;
    }
    return std::nullopt;
  }
  return std::pair(std::atoi(end.c_str()), end.substr(end.find('\t') + 1));
}

std::optional<std::pair<int, std::string>> ProcessWorld::Impl::ended_peer() {
  try {
    const std::lock_guard<std::mutex> lock(store_mutex);
    return read_end(*store);
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
    if (store->add(key(kEndClaims), 1) != 1) return false;  // another process ended first
    store->set(key(kEnd), as_bytes(tagged(spec.secret, key(kEnd), std::to_string(exit_status) + "\t" + line)));
  } catch (const std::exception&) {
    return false;  // the store is gone with rank 0: the others find out from their own calls
  }
  if (spec.rank != 0) return true;
  // Rank 0 serves the store: it stays until the others have read the end (or a few seconds).
  for (int tries = 0; tries < 50; ++tries) {
    try {
      const std::lock_guard<std::mutex> lock(store_mutex);
      if (store->add(key(kEndAcks), 0) >= spec.world_size - 1) break;
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
    std::optional<std::pair<int, std::string>> end;
    try {
      end = read_end(*own);
      if (!end) continue;
    } catch (const std::exception&) {
      if (closing.load() || spec.rank == 0) return;
      end_now(static_cast<int>(ExitStatus::kInternal),
              "error: " + who(spec.rank) + ": lost " + who(0) + ", which serves the rendezvous: it stopped answering");
    }
    if (announced.load()) continue;  // this process ended first and is on its way out
    try {
      own->add(key(kEndAcks), 1);
    } catch (const std::exception&) {
    }
    const std::string line = stopping_line(end->first, end->second);
    end_now(end->first, end->first == static_cast<int>(ExitStatus::kInterrupted) ? line : "error: " + line);
  }
}

ProcessWorld::ProcessWorld(const WorldSpec& spec) : impl_(std::make_unique<Impl>()) {
  Impl& w = *impl_;
  w.spec = spec;
  w.backend = choose_backend(spec.backend, spec.device);  // UsageError before anyone meets
  w.sent.assign(static_cast<size_t>(spec.world_size), 0);
  w.received.assign(static_cast<size_t>(spec.world_size), 0);
  const std::string master = spec.master_addr + ":" + std::to_string(spec.master_port);
  const std::string self = "rank " + std::to_string(spec.rank) + " (" + printable(this_host()) + ")";
  try {
    c10d::TCPStoreOptions options = store_options(spec, /*server=*/spec.rank == 0 && spec.serve_store);
    options.numWorkers = static_cast<size_t>(spec.world_size);
    options.waitWorkers = true;
    w.store = c10::make_intrusive<c10d::TCPStore>(spec.master_addr, options);
  } catch (const std::exception& e) {
    throw PeerError(self + ": the " + std::to_string(spec.world_size) + " processes did not all meet at " + master +
                    " within " + std::to_string(std::lround(spec.timeout_seconds)) + " s: " + first_line(e));
  }
  AdmissionRequest request;
  request.secret = spec.secret;
  request.rank = spec.rank;
  request.world_size = spec.world_size;
  request.self = Member{this_host(), spec.memory_bytes};
  request.timeout = timeout_of(spec);
  request.self_name = self;
  request.rendezvous = master;
  request.warn = [](const std::string& line) { std::cerr << "nanreplay: " << line << std::endl; };
  Admission admission;
  try {
    admission = admit(*w.store, request);
  } catch (const PeerError&) {
    throw;
  } catch (const UsageError&) {
    throw;
  } catch (const std::exception& e) {  // the store's own failures: the rendezvous gone or silent
    throw PeerError(self + ": admitting the processes at " + master + ": " + first_line(e));
  }
  w.prefix = admission.key_prefix;
  for (const Member& member : admission.members) {
    w.hosts.push_back(member.host);
    w.memory.push_back(member.memory_bytes);
  }
  try {
    // c10d's own keys (Gloo's addresses) under the run's prefix too.
    const auto run_store = c10::make_intrusive<c10d::PrefixStore>(w.prefix + "c10d", w.store);
    w.group = make_group(w.backend, run_store, spec);
  } catch (const UsageError&) {
    throw;
  } catch (const std::exception& e) {
    throw PeerError(self + ": the " + w.backend + " process group at " + master + ": " + first_line(e));
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
      w.store->add(w.key(kDeparted), 1);
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout_of(w.spec);
    while (w.store->add(w.key(kDeparted), 0) < w.spec.world_size - 1 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(Milliseconds(5));
    }
  } catch (const std::exception&) {
  }
}

int ProcessWorld::rank() const { return impl_->spec.rank; }
int ProcessWorld::size() const { return impl_->spec.world_size; }
std::string ProcessWorld::who(int rank) const { return impl_->who(rank); }
const std::vector<double>& ProcessWorld::memory() const { return impl_->memory; }

// The header: defined, type, dimensions, sizes; then (through host memory)
// the header's tag, checked before the data is received, and the data's,
// checked once it arrived.
void ProcessWorld::send(const torch::Tensor& tensor, int to) {
  Impl& w = *impl_;
  const torch::Device device = w.exchange_device();
  const torch::Tensor data = tensor.defined() ? tensor.detach().to(device).contiguous() : tensor;
  torch::Tensor header = torch::zeros({kHeaderFields + 2 * kTagFields}, torch::kInt64);
  auto* h = header.data_ptr<int64_t>();
  if (data.defined()) {
    TORCH_CHECK(data.dim() <= kHeaderFields - 3, "a tensor of more than five dimensions between processes");
    h[0] = 1;
    h[1] = static_cast<int64_t>(data.scalar_type());
    h[2] = data.dim();
    for (int64_t d = 0; d < data.dim(); ++d) h[3 + d] = data.size(d);
  }
  const uint64_t place = w.sent[static_cast<size_t>(to)]++;
  if (w.host_exchange()) {
    const std::string context = w.context("tensor", w.spec.rank, to, place);
    const std::string fields(reinterpret_cast<const char*>(h), kHeaderFields * sizeof(int64_t));
    const std::string header_tag = exchange_tag(w.spec.secret, context + "\theader", fields);
    const std::string data_tag = exchange_tag(w.spec.secret, context + "\tdata", data.defined() ? tensor_digest(data) : "");
    std::memcpy(h + kHeaderFields, header_tag.data(), kHmacTagBytes);
    std::memcpy(h + kHeaderFields + kTagFields, data_tag.data(), kHmacTagBytes);
  }
  std::vector<torch::Tensor> headers{header.to(device)};
  w.wait_for([&] { return w.group->send(headers, to, kTensorHeader); }, to, "sending");
  if (!data.defined() || data.numel() == 0) return;
  std::vector<torch::Tensor> payload{data};
  w.wait_for([&] { return w.group->send(payload, to, kTensorData); }, to, "sending");
}

torch::Tensor ProcessWorld::receive(int from) {
  Impl& w = *impl_;
  const torch::Device device = w.exchange_device();
  std::vector<torch::Tensor> headers{
      torch::zeros({kHeaderFields + 2 * kTagFields}, torch::TensorOptions(device).dtype(torch::kInt64))};
  w.wait_for([&] { return w.group->recv(headers, from, kTensorHeader); }, from, "receiving");
  const torch::Tensor header = headers[0].cpu();
  const auto* h = header.data_ptr<int64_t>();
  const uint64_t place = w.received[static_cast<size_t>(from)]++;
  const std::string context = w.context("tensor", from, w.spec.rank, place);
  auto tag_at = [&](int field) { return std::string(reinterpret_cast<const char*>(h + field), kHmacTagBytes); };
  if (w.host_exchange()) {
    const std::string fields(reinterpret_cast<const char*>(h), kHeaderFields * sizeof(int64_t));
    if (!same_tag(tag_at(kHeaderFields), exchange_tag(w.spec.secret, context + "\theader", fields))) {
      throw w.forged(from, "the tensors");
    }
  }
  if (h[0] == 0) return torch::Tensor();
  if (h[2] < 0 || h[2] > kHeaderFields - 3) throw w.forged(from, "the tensors");  // untagged over NCCL
  const std::vector<int64_t> sizes(h + 3, h + 3 + h[2]);
  const auto type = static_cast<c10::ScalarType>(h[1]);
  std::vector<torch::Tensor> payload{torch::empty(sizes, torch::TensorOptions(device).dtype(type))};
  if (payload[0].numel() > 0) {
    w.wait_for([&] { return w.group->recv(payload, from, kTensorData); }, from, "receiving");
  }
  if (w.host_exchange() && !same_tag(tag_at(kHeaderFields + kTagFields),
                                     exchange_tag(w.spec.secret, context + "\tdata", tensor_digest(payload[0])))) {
    throw w.forged(from, "the tensors");
  }
  return payload[0];
}

void ProcessWorld::broadcast(torch::Tensor& tensor, int root) {
  Impl& w = *impl_;
  std::vector<torch::Tensor> data{tensor.detach().to(w.exchange_device()).contiguous()};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  w.wait_for([&] { return w.group->broadcast(data, options); }, root, "a broadcast");
  const uint64_t place = w.collectives++;
  if (w.host_exchange()) {  // root's tag follows, for the others to check what they received
    const std::string tag = exchange_tag(w.spec.secret, w.context("broadcast", root, -1, place), tensor_digest(data[0]));
    std::vector<torch::Tensor> tags{torch::empty({static_cast<int64_t>(kHmacTagBytes)}, torch::kUInt8)};
    std::memcpy(tags[0].data_ptr(), tag.data(), kHmacTagBytes);
    w.wait_for([&] { return w.group->broadcast(tags, options); }, root, "a broadcast");
    if (!same_tag(tag, std::string(static_cast<const char*>(tags[0].data_ptr()), kHmacTagBytes))) {
      throw w.forged(root, "the gradients");
    }
  }
  tensor = data[0].cpu();  // as its callers keep it: on the host, whichever backend carried it
}

// Each process's length travels with its tag and its bytes' tag; every
// receiver checks the lengths before it makes room, then the bytes.
std::vector<std::string> ProcessWorld::all_gather(const std::string& mine) {
  Impl& w = *impl_;
  const int n = size();
  const uint64_t place = w.collectives++;
  auto tag_of = [&](int rank, const char* what, const std::string& text) {
    return exchange_tag(w.spec.secret, w.context(what, rank, -1, place), sha256(text.data(), text.size()));
  };
  const torch::Device device = w.exchange_device();
  auto gather = [&](const torch::Tensor& input) {
    std::vector<torch::Tensor> in{input.to(device)};
    std::vector<std::vector<torch::Tensor>> out(1);
    for (int r = 0; r < n; ++r) out[0].push_back(torch::empty_like(in[0]));
    w.wait_for([&] { return w.group->allgather(out, in); }, -1, "gathering probe records");
    for (torch::Tensor& t : out[0]) t = t.cpu();
    return out[0];
  };
  const bool tags = w.host_exchange();
  torch::Tensor own = torch::zeros({1 + 2 * kTagFields}, torch::kInt64);  // length, its tag, the bytes' tag
  int64_t* o = own.data_ptr<int64_t>();
  o[0] = static_cast<int64_t>(mine.size());
  if (tags) {
    std::memcpy(o + 1, tag_of(rank(), "gather-length", std::to_string(o[0])).data(), kHmacTagBytes);
    std::memcpy(o + 1 + kTagFields, tag_of(rank(), "gather", mine).data(), kHmacTagBytes);
  }
  const std::vector<torch::Tensor> heads = gather(own);
  auto tag_in = [&](int r, int field) {
    return std::string(reinterpret_cast<const char*>(heads[static_cast<size_t>(r)].data_ptr<int64_t>() + field), kHmacTagBytes);
  };
  auto length_of = [&](int r) { return heads[static_cast<size_t>(r)].data_ptr<int64_t>()[0]; };
  int64_t longest = 1;
  for (int r = 0; r < n; ++r) {
    if (length_of(r) < 0 || (tags && !same_tag(tag_in(r, 1), tag_of(r, "gather-length", std::to_string(length_of(r)))))) {
      throw w.forged(r, "the probe records");
    }
    longest = std::max(longest, length_of(r));
  }
  torch::Tensor padded = torch::zeros({longest}, torch::kUInt8);
  std::memcpy(padded.data_ptr(), mine.data(), mine.size());
  const std::vector<torch::Tensor> gathered = gather(padded);
  std::vector<std::string> all;
  for (int r = 0; r < n; ++r) {
    all.emplace_back(static_cast<const char*>(gathered[static_cast<size_t>(r)].data_ptr()),
                     static_cast<size_t>(length_of(r)));
    if (tags && !same_tag(tag_in(r, 1 + kTagFields), tag_of(r, "gather", all.back()))) {
      throw w.forged(r, "the probe records");
    }
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
