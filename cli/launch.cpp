// Launching a replay across processes; see launch.h.
#include "cli/launch.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <thread>
#include <vector>

#include "cli/cli_support.h"
#include "loaders/base/error.h"
#include "replay/step/abandoned_scratch.h"
#include "replay/step/ranks/distributed.h"
#include "replay/step/ranks/run_secret.h"

extern char** environ;

namespace nanreplay {

namespace {

constexpr const char* kWorkerVariable = "NANREPLAY_WORKER";  // set by the launcher: a worker never launches again

std::optional<std::string> env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? std::optional<std::string>(value) : std::nullopt;
}

int env_int(const char* name, int fallback) {
  const std::optional<std::string> text = env(name);
  if (!text) return fallback;
  try {
    size_t used = 0;
    const int value = std::stoi(*text, &used);
    if (used == text->size()) return value;
  } catch (const std::exception&) {
  }
  throw UsageError(std::string(name) + "=" + *text + ": not a whole number");
}

// A port nothing listens on now (as torchrun's --standalone picks one).
int free_local_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    if (fd >= 0) ::close(fd);
    throw std::runtime_error("cannot find a free local port for the processes to meet on");
  }
  ::close(fd);
  return ntohs(address.sin_port);
}

struct Worker {
  pid_t pid = -1;
  int rank = 0;
  bool running = true;
};

std::string describe_wait_status(int status) {
  if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
  return "exit status " + std::to_string(WEXITSTATUS(status));
}

// The secret a launcher hands its processes: the file's when given (and
// needed across hosts, which must all hold the same), else a fresh one.
std::string launch_secret(const LaunchFlags& flags) {
  if (flags.secret_file) return read_secret_file(*flags.secret_file);
  if (const std::optional<std::string> file = env(kSecretFileVariable)) return read_secret_file(*file);
  if (flags.nnodes > 1) {
    throw UsageError("--nnodes " + std::to_string(flags.nnodes) + ": every host must prove it belongs to this run: "
                     "give each the same --secret-file (or " + kSecretFileVariable + ")");
  }
  return new_run_secret();
}

// A worker's secret: its launcher's; else (torchrun, srun, by hand) the
// file every process reads.
std::string worker_secret(const LaunchFlags& flags) {
  if (env(kWorkerVariable)) {
    const std::string secret = from_hex(env(kSecretVariable).value_or(""));
    if (secret.empty()) throw UsageError(std::string(kSecretVariable) + ": not the secret its launcher makes");
    return secret;
  }
  if (flags.secret_file) return read_secret_file(*flags.secret_file);
  if (const std::optional<std::string> file = env(kSecretFileVariable)) return read_secret_file(*file);
  throw UsageError("WORLD_SIZE=" + env("WORLD_SIZE").value_or("") + ": a process started by another launcher "
                   "proves it belongs to the run with --secret-file FILE (or " + kSecretFileVariable +
                   "), the same file for every process");
}

// Where a worker finds the run: the rendezvous address, the port and the secret.
struct Rendezvous {
  std::string addr;
  int port = 0;
  std::string secret;
};

// This process's environment less what names a rank, plus the worker's own.
std::vector<std::string> worker_environment(const LaunchFlags& flags, const Rendezvous& at, int local) {
  static const std::set<std::string> kReplaced{"RANK",        "WORLD_SIZE",    "LOCAL_RANK",    "LOCAL_WORLD_SIZE",
                                               "MASTER_ADDR", "MASTER_PORT",   kWorkerVariable, kSecretVariable};
  std::vector<std::string> env_text;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    if (!kReplaced.count(entry.substr(0, entry.find('=')))) env_text.push_back(entry);
  }
  const int rank = flags.node_rank * flags.nproc + local;
  for (const auto& [name, value] :
       {std::pair<std::string, std::string>{"RANK", std::to_string(rank)},
        {"WORLD_SIZE", std::to_string(flags.nproc * flags.nnodes)},
        {"LOCAL_RANK", std::to_string(local)}, {"LOCAL_WORLD_SIZE", std::to_string(flags.nproc)},
        {"MASTER_ADDR", at.addr}, {"MASTER_PORT", std::to_string(at.port)}, {kWorkerVariable, "1"},
        {kSecretVariable, to_hex(at.secret)}}) {
    env_text.push_back(name + "=" + value);
  }
  return env_text;
}

std::vector<char*> pointers_of(std::vector<std::string>& texts) {
  std::vector<char*> out;
  for (std::string& t : texts) out.push_back(t.data());
  out.push_back(nullptr);
  return out;
}

// One process per local rank, each this executable with the same arguments.
std::vector<Worker> start_workers(const LaunchFlags& flags, const Rendezvous& at, const CommandArgs& args) {
  std::vector<std::string> argv_text{"nanreplay"};
  argv_text.insert(argv_text.end(), args.begin(), args.end());
  std::vector<char*> argv = pointers_of(argv_text);
  std::vector<Worker> workers;
  for (int local = 0; local < flags.nproc; ++local) {
    const int rank = flags.node_rank * flags.nproc + local;
    std::vector<std::string> env_text = worker_environment(flags, at, local);
    std::vector<char*> envp = pointers_of(env_text);
    pid_t pid = -1;
    if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv.data(), envp.data()) != 0) {
      for (const Worker& w : workers) ::kill(w.pid, SIGKILL);
      throw std::runtime_error("cannot start worker process " + std::to_string(rank));
    }
    workers.push_back({pid, rank, true});
  }
  return workers;
}

// Waits for the workers. A stop request here is passed on to them; after the
// first failure the rest get a few seconds to end by themselves (they are told
// through the rendezvous), then SIGTERM (5 s after the failure), then SIGKILL
// (10 s after it), after which the launcher removes the scratch directories
// a killed worker held (a worker stuck on a store gone silent may outlive
// its SIGTERM by its --dist-timeout).
class WorkerSupervision {
 public:
  WorkerSupervision(std::vector<Worker> workers, int rank_zero) : workers_(std::move(workers)), rank_zero_(rank_zero) {}

  int wait_all() {
    for (int running = static_cast<int>(workers_.size()); running > 0;) {
      int status = 0;
      const pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid > 0) {
        running -= reap(pid, status);
        continue;
      }
      pass_on_stop();
      escalate();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    remove_if_abandoned(killed_scratch_);  // the workers are reaped: their locks are gone with them
    if (stop_passed_on_) return static_cast<int>(ExitStatus::kInterrupted);
    return first_failure_.value_or(rank_zero_status_);
  }

 private:
  int reap(pid_t pid, int status) {
    for (Worker& w : workers_) {
      if (w.pid != pid || !w.running) continue;
      w.running = false;
      const int code = WIFEXITED(status) ? WEXITSTATUS(status) : static_cast<int>(ExitStatus::kInternal);
      if (WIFSIGNALED(status) && escalation_ == 0) {
        std::cerr << "nanreplay: error: rank " << w.rank << " died (" << describe_wait_status(status) << ")"
                  << std::endl;
      }
      const bool failed = code != static_cast<int>(ExitStatus::kClean) && code != static_cast<int>(ExitStatus::kFound);
      if (failed && !first_failure_) {
        first_failure_ = code;
        failed_at_ = std::chrono::steady_clock::now();
      }
      if (w.rank == rank_zero_) rank_zero_status_ = code;
      return 1;
    }
    return 0;
  }

  void pass_on_stop() {
    if (!stop_requested() || stop_passed_on_) return;
    stop_passed_on_ = true;
    for (const Worker& w : workers_) {
      if (w.running) ::kill(w.pid, SIGINT);
    }
  }

  void escalate() {
    const auto waited = std::chrono::steady_clock::now() - failed_at_;
    if (!first_failure_ || escalation_ >= 2 || waited <= std::chrono::seconds(escalation_ == 0 ? 5 : 10)) return;
    for (const Worker& w : workers_) {
      if (!w.running) continue;
      if (escalation_ == 1) {  // killed outright it cannot remove its scratch directories: noted first
        for (const std::filesystem::path& dir : scratch_dirs_held_by(w.pid)) killed_scratch_.push_back(dir);
      }
      ::kill(w.pid, escalation_ == 0 ? SIGTERM : SIGKILL);
      if (escalation_ == 0) ::kill(w.pid, SIGCONT);  // a stopped worker, to take its SIGTERM and clean up
    }
    ++escalation_;
  }

  std::vector<Worker> workers_;
  int rank_zero_;
  std::optional<int> first_failure_;
  int rank_zero_status_ = 0;
  bool stop_passed_on_ = false;
  std::chrono::steady_clock::time_point failed_at_ = std::chrono::steady_clock::time_point::max();
  int escalation_ = 0;  // 1: SIGTERM sent, 2: SIGKILL sent
  std::vector<std::filesystem::path> killed_scratch_;  // held by a worker sent SIGKILL
};

// Starts the local workers and waits for them.
int launch_local(const LaunchFlags& flags, const CommandArgs& args) {
  choose_backend(flags.backend, flags.device);  // a backend not built: exit 2 before any process starts
  Rendezvous at;
  at.secret = launch_secret(flags);
  at.addr = flags.master_addr.value_or(env("MASTER_ADDR").value_or("127.0.0.1"));
  at.port = flags.master_port ? *flags.master_port
            : env("MASTER_PORT") ? env_int("MASTER_PORT", 29500)
                                 : flags.nnodes == 1 ? free_local_port() : 29500;
  const StopDeferral polled;  // a stop is passed on to the workers, not acted on here
  WorkerSupervision supervision(start_workers(flags, at, args), flags.node_rank * flags.nproc);
  return supervision.wait_all();
}

// One process of the launch: meets the others, runs `body`, and on the way
// out either waits for the others (all went well) or tells them it failed.
int run_as_worker(const WorldSpec& spec, const std::function<int(bool)>& body) {
  // Until every process has arrived a stop ends this one at once; from then on the watcher tells them all.
  set_default_world(std::make_shared<ProcessWorld>(spec));
  const StopDeferral polled;
  default_world()->watch(stop_requested);
  int status = 0;
  try {
    status = body(spec.rank == 0);
  } catch (...) {
    const CommandFailure failure = describe_failure(std::current_exception());
    const std::string who = default_world()->who(spec.rank);
    const bool interrupted = failure.exit_status == static_cast<int>(ExitStatus::kInterrupted);
    const std::string what = failure.line.rfind("error: ", 0) == 0 ? failure.line.substr(7) : failure.line;
    const bool names_itself = what.rfind(who, 0) == 0;  // a PeerError already says whose it is
    default_world()->announce_end(failure.exit_status, interrupted ? who : names_itself ? what : who + ": " + what);
    throw;
  }
  default_world()->finish();  // every process done: a peer that failed writing its outputs is PeerError here
  set_default_world(nullptr);
  return status;
}

}  // namespace

void add_launch_flags(cxxopts::Options& options) {
  options.add_options("distributed")
      ("nproc", "split the replay across N processes on this host (as torchrun --nproc-per-node)",
       cxxopts::value<int>()->default_value("1"), "N")
      ("nnodes", "hosts taking part; each runs the same command with its --node-rank",
       cxxopts::value<int>()->default_value("1"), "M")
      ("node-rank", "this host's place among them, 0 to M-1", cxxopts::value<int>()->default_value("0"), "R")
      ("master-addr", "the host rank 0 runs on (default $MASTER_ADDR, else 127.0.0.1)",
       cxxopts::value<std::string>(), "HOST")
      ("master-port", "the port the processes meet on (default $MASTER_PORT; one host: a free port, "
                      "several: 29500)", cxxopts::value<int>(), "PORT")
      ("dist-timeout", "seconds to wait for a peer before giving up on it (PyTorch's default)",
       cxxopts::value<double>()->default_value("1800"), "SECONDS")
      ("secret-file", "a file (mode 0600) holding the secret every process of the run proves it has; needed "
                      "across hosts and under other launchers (default with --nproc: a fresh one per run; "
                      "or $NANREPLAY_DIST_SECRET_FILE)", cxxopts::value<std::string>(), "FILE")
      ("dist-backend", "how tensors travel between processes: auto (NCCL for CUDA devices where built, else "
                       "Gloo), gloo or nccl", cxxopts::value<std::string>()->default_value("auto"), "NAME")
      ("dist-interface", "across hosts: the network interface Gloo listens on (default $GLOO_SOCKET_IFNAME, "
                         "else the host name's address; one host: loopback)", cxxopts::value<std::string>(), "IF")
      ("split", "what the processes share out: layers (each computes a range of every pass) or ranks (each "
                "replays some of the bundle's data-parallel ranks); default: ranks when the bundle has several "
                "and the model fits each process's memory, else layers", cxxopts::value<std::string>(), "WHAT");
}

LaunchFlags parse_launch_flags(const cxxopts::ParseResult& args) {
  LaunchFlags flags;
  flags.nproc = args["nproc"].as<int>();
  flags.nnodes = args["nnodes"].as<int>();
  flags.node_rank = args["node-rank"].as<int>();
  if (args.count("master-addr")) flags.master_addr = args["master-addr"].as<std::string>();
  if (args.count("master-port")) flags.master_port = args["master-port"].as<int>();
  flags.timeout_seconds = args["dist-timeout"].as<double>();
  if (args.count("secret-file")) flags.secret_file = args["secret-file"].as<std::string>();
  flags.backend = args["dist-backend"].as<std::string>();
  if (flags.backend != "auto" && flags.backend != "gloo" && flags.backend != "nccl") {
    throw UsageError("--dist-backend " + flags.backend + ": auto, gloo or nccl");
  }
  if (args.count("dist-interface")) flags.interface = args["dist-interface"].as<std::string>();
  if (flags.nproc < 1 || flags.nproc > 64) {
    throw UsageError("--nproc " + std::to_string(flags.nproc) + ": from 1 to 64");
  }
  if (flags.nnodes < 1) throw UsageError("--nnodes " + std::to_string(flags.nnodes) + ": at least 1");
  if (flags.node_rank < 0 || flags.node_rank >= flags.nnodes) {
    throw UsageError("--node-rank " + std::to_string(flags.node_rank) + ": from 0 to --nnodes - 1");
  }
  if (flags.master_port && (*flags.master_port < 1 || *flags.master_port > 65535)) {
    throw UsageError("--master-port " + std::to_string(*flags.master_port) + ": not a port");
  }
  if (!(flags.timeout_seconds > 0)) throw UsageError("--dist-timeout: a positive number of seconds");
  return flags;
}

int run_launched(const LaunchFlags& flags, const CommandArgs& args, double memory_bytes,
                 const std::function<int(bool)>& body) {
  const bool worker = env(kWorkerVariable).has_value();
  if (!worker && flags.nproc * flags.nnodes > 1) return launch_local(flags, args);
  const int world_size = env_int("WORLD_SIZE", 1);
  if (world_size <= 1) return body(true);
  WorldSpec spec;
  spec.rank = env_int("RANK", -1);
  spec.world_size = world_size;
  if (spec.rank < 0 || spec.rank >= world_size) {
    throw UsageError("RANK=" + env("RANK").value_or("") + ": WORLD_SIZE=" + std::to_string(world_size) +
                     " needs a RANK from 0 to " + std::to_string(world_size - 1));
  }
  spec.master_addr = flags.master_addr.value_or(env("MASTER_ADDR").value_or("127.0.0.1"));
  spec.master_port = flags.master_port.value_or(env_int("MASTER_PORT", 29500));
  // Under torchrun (torchelastic) its agent already serves the store on MASTER_PORT.
  spec.serve_store = env("TORCHELASTIC_USE_AGENT_STORE").value_or("") != "True";
  spec.timeout_seconds = flags.timeout_seconds;
  spec.memory_bytes = memory_bytes;
  spec.secret = worker_secret(flags);
  spec.device = flags.device;
  spec.backend = flags.backend;
  spec.interface = flags.interface;
  return run_as_worker(spec, body);
}

bool is_secondary_process() {
  try {  // called while reporting a failure: a malformed variable must not throw again
    return env_int("WORLD_SIZE", 1) > 1 && env_int("RANK", 0) != 0;
  } catch (const std::exception&) {
    return false;
  }
}

std::vector<std::string> process_devices(const std::vector<std::string>& given) {
  if (env_int("WORLD_SIZE", 1) <= 1 || given.size() != 1 || given[0].rfind("cuda", 0) != 0) return given;
  if (given[0] != "cuda" && given[0] != "cuda:0") {
    throw UsageError("--device " + given[0] + ": with several processes each computes on cuda:$LOCAL_RANK; "
                     "give --device cuda (CUDA_VISIBLE_DEVICES picks the GPUs)");
  }
  return {"cuda:" + std::to_string(env_int("LOCAL_RANK", 0))};
}

MemoryLimit process_memory_limit(const std::optional<MemoryLimit>& given) {
  if (given) return *given;
  MemoryLimit limit = default_memory_limit();
  const int local = env(kWorkerVariable) || env("LOCAL_WORLD_SIZE") ? env_int("LOCAL_WORLD_SIZE", 1) : 1;
  if (local > 1) {
    limit.bytes /= static_cast<uint64_t>(local);
    limit.source += ", shared by " + std::to_string(local) + " processes on this host";
  }
  return limit;
}

}  // namespace nanreplay
