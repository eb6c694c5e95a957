// `run` and `bisect` across processes, launched as torchrun launches a
// training job: --nproc N starts N local processes; across hosts every host
// runs the same command with --nnodes, --node-rank, --master-addr and
// --master-port; a process started by another launcher (torchrun, an srun
// wrapper) joins through RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
// docs/distributed.md.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <cxxopts.hpp>

#include "cli/command_table.h"
#include "replay/step/memory_estimate.h"

namespace nanreplay {

struct LaunchFlags {
  int nproc = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::optional<std::string> master_addr;
  std::optional<int> master_port;
  double timeout_seconds = 1800;  // PyTorch's default process-group timeout
  std::optional<std::string> secret_file;  // --secret-file: the secret every host reads (replay/step/ranks/run_secret.h)
  std::string backend = "auto";            // --dist-backend
  std::string interface;                   // --dist-interface
  std::string device = "cpu";              // this process's device (set with --device)
};

void add_launch_flags(cxxopts::Options& options);
LaunchFlags parse_launch_flags(const cxxopts::ParseResult& args);

// Runs the command's work as this process's part of the launch: alone
// (`body(true)`), as the launcher of --nproc local processes (each runs the
// same command; the exit status is the first failure's, else rank 0's), or
// as one of them (`body(rank == 0)`: only rank 0 prints and writes).
// `memory_bytes`: this process's memory limit, which sets its share of the layers.
int run_launched(const LaunchFlags& flags, const CommandArgs& args, double memory_bytes,
                 const std::function<int(bool rank_zero)>& body);

// A process of a launch other than rank 0 (WORLD_SIZE above 1, RANK not 0):
// rank 0 alone prints, a --json error object included.
bool is_secondary_process();

// The devices this process computes on: with several processes (WORLD_SIZE
// above 1), a CUDA --device becomes cuda:$LOCAL_RANK, as torchrun's
// convention; an index other than 0 is a UsageError, as it would be ignored.
std::vector<std::string> process_devices(const std::vector<std::string>& given);

// This process's memory limit: --max-memory as given, else the default
// shared among the processes on this host (LOCAL_WORLD_SIZE, as torchrun sets it).
MemoryLimit process_memory_limit(const std::optional<MemoryLimit>& given);

}  // namespace nanreplay
