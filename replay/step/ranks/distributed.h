// A replay split across processes, on one host or several, through
// PyTorch's c10d: a TCPStore on rank 0 for the rendezvous and a Gloo process
// group (NCCL for CUDA devices, where built) for the tensors
// (docs/distributed.md). Only processes that hold the run's secret are
// admitted (replay/step/ranks/dist_admission.h). Every process runs the same
// command and the same replay; inside each forward and backward pass the
// processes split the layers into contiguous ranges (replay/step/layer_stream.h),
// the residual stream sent forward and its gradient backward at the
// boundaries. After each pass every process holds every probe record and,
// after each rank of the bundle, every gradient, so all of them decide alike
// and rank 0 writes the outputs. Like PyTorch's default process group this
// is process-wide: set once by the CLI, read where a model is built.
#pragma once

#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>


namespace at {
class Tensor;  // torch::Tensor: this header stays LibTorch-free for replay/workflows/incident.cpp
}  // namespace at

namespace nanreplay {

// How this process joins: torchrun's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
struct WorldSpec {
  int rank = 0;
  int world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  double timeout_seconds = 1800;  // PyTorch's default process-group timeout
  double memory_bytes = 0;        // this process's memory limit: its share of the layers
  bool serve_store = true;        // rank 0 serves the rendezvous store (not under torchrun's agent, which does)
  std::string secret;             // every process of the run holds it (replay/step/ranks/run_secret.h)
  std::string device = "cpu";     // where this process computes: cpu or cuda:N
  std::string backend = "auto";   // --dist-backend: auto, gloo or nccl
  std::string interface;          // --dist-interface: the network interface Gloo binds across hosts
};

// The c10d backends this nanreplay was built with, as --dist-backend names
// them ("gloo", "nccl"); none: replays run in one process only.
std::vector<std::string> built_backends();
// The backend for processes computing on `device`: `asked` ("auto", "gloo"
// or "nccl") against what was built. UsageError (exit 2) naming a backend
// this build lacks, or NCCL for a CPU device.
std::string choose_backend(const std::string& asked, const std::string& device);

// A peer that failed, vanished or did not answer in time: exit 3, the line
// naming the rank and host.
// A peer that ended first with an error of its own passes its exit status
// on (2 for its bad input, 130 for an interrupt).
class PeerError : public std::runtime_error {
 public:
  explicit PeerError(const std::string& what, int exit_status = 3)
      : std::runtime_error(what), exit_status_(exit_status) {}
  int exit_status() const { return exit_status_; }

 private:
  int exit_status_;
};

// How the processes share the work (--split): the layers of every pass
// (replay/step/layer_stream.h), or the bundle's data-parallel ranks of every step
// (replay/step/rank_spread.h).
enum class ProcessSplit { kLayers, kRanks };

// A contiguous range [first, end) of layers or of data-parallel ranks.
struct IndexRange {
  int first = 0;
  int end = 0;
  bool holds(int layer) const { return layer >= first && layer < end; }
};

// `layers` split in proportion to `memory` (one entry per process), in rank
// order; rank 0 always holds layer 0 (it also holds the embeddings, the
// final norm and the head) and a process may hold none.
std::vector<IndexRange> split_layers(int layers, const std::vector<double>& memory);
// Process `process`'s block of the bundle's `data_ranks` data-parallel ranks
// among `processes`: contiguous and as even as can be, the larger first.
IndexRange rank_block(int data_ranks, int processes, int process);

class ProcessWorld {
 public:
  // The rendezvous: PeerError when the others do not all arrive in time.
  explicit ProcessWorld(const WorldSpec& spec);
  ~ProcessWorld();
  ProcessWorld(const ProcessWorld&) = delete;
  ProcessWorld& operator=(const ProcessWorld&) = delete;

  int rank() const;
  int size() const;
  std::string who(int rank) const;  // "rank 1 (host-b)"
  const std::vector<double>& memory() const;  // every process's memory limit, in rank order
  std::vector<IndexRange> layer_ranges(int layers) const { return split_layers(layers, memory()); }
  // Whether this process keeps its blocks in memory between passes (else it
  // streams them from the mapped checkpoint); decided with the memory estimate.
  bool keep_blocks() const { return keep_blocks_; }
  void set_keep_blocks(bool keep) { keep_blocks_ = keep; }
  ProcessSplit split() const { return split_; }
  // `data_ranks`: the bundle's data-parallel world size (with kRanks).
  void set_split(ProcessSplit split, int data_ranks = 0) {
    split_ = split;
    data_ranks_ = data_ranks;
  }
  int data_ranks() const { return data_ranks_; }

  // A tensor of any shape and type, undefined included, to or from one peer
  // (received in host memory over Gloo, on this process's device over NCCL).
  void send(const at::Tensor& tensor, int to);
  at::Tensor receive(int from);
  // `tensor` (the same shape and type everywhere) replaced by root's, in host memory.
  void broadcast(at::Tensor& tensor, int root);
  // Every process's bytes, in rank order.
  std::vector<std::string> all_gather(const std::string& mine);

  // From here on a peer's failure or interrupt ends this process too, and a
  // stop request here (`stop_requested`) ends every process: exit 130 for an
  // interrupt, 3 for a failure, nothing left behind (loaders/base/exit_cleanup.h).
  void watch(std::function<bool()> stop_requested);
  // This process is ending with `exit_status` and `line`: the others stop too.
  void announce_end(int exit_status, const std::string& line);
  // Every process is done (a barrier): PeerError when one failed on its way,
  // writing its outputs. Then nobody reads the store rank 0 serves.
  void finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  bool keep_blocks_ = false;
  ProcessSplit split_ = ProcessSplit::kLayers;
  int data_ranks_ = 0;
};

// The process-wide world (none: one process).
void set_default_world(std::shared_ptr<ProcessWorld> world);
ProcessWorld* default_world();  // null unless more than one process replays

}  // namespace nanreplay
