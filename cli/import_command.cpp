// `nanreplay import ... --out BUNDLE`: a bundle from a checkpoint the user
// already has (Hugging Face, torch.save, torch.distributed.checkpoint), the
// data and the job's log. The reading and renaming is PyTorch's job, so it
// is done by capture/nanreplay_import.py, which needs only torch and the
// standard library; this command finds an interpreter, lets the helper write
// into a staging directory beside BUNDLE, validates the result as `inspect`
// does, and renames it into place: a bundle appears whole or not at all.
#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/cli_support.h"
#include "cli/command_table.h"
#include "cli/staging_dir.h"
#include "import_formats.h"  // NANREPLAY_IMPORT_FORMATS, from capture/nanreplay_import/formats/
#include "loaders/bundle/bundle.h"
#include "loaders/base/error.h"
#include "replay/step/bundle_structure.h"
#include "reports/outputs/bundle_summary.h"

namespace nanreplay {

namespace fs = std::filesystem;

namespace {

constexpr const char* kImportHelp =
    "Write an incident bundle from a checkpoint you already have, the data shards and the job's log.\n"
    "The bundle rolls forward from the checkpoint (docs/import.md).\n\n"
    "usage: nanreplay import --checkpoint PATH [--optimizer PATH] [--format " NANREPLAY_IMPORT_FORMATS "]\n"
    "         [--optimizer-class CLASS] [--aux-optimizer PATH [--aux-optimizer-class CLASS]]\n"
    "         [--naming auto|hf|meta|torchtitan|megatron|deepseek|nanogpt] [--config FILE]\n"
    "         --data SHARD... [--token-dtype uint16|uint32] --seq-len N --micro-batch-size N\n"
    "         [--grad-accum N] [--world-size N]\n"
    "         (--sampler-seed N [--epoch N] [--epoch-start-step N] | --samples FILE)\n"
    "         --log FILE --steps FIRST:LAST [--precision fp32|bf16|fp16|fp8] [--grad-clip X]\n"
    "         [--trust-pickle] [--num-heads N] [--num-kv-heads N] [--norm-eps X] [--rope-theta X]\n"
    "         [--rope-style rotate_half|interleaved] [--tie-embeddings true|false] [--activation NAME]\n"
    "         [--log-numbering zero|one] [--torchtitan-numerics STEP=PATH]... [--mtp-loss-scale F]\n"
    "         [--router-aux-loss-coef F]\n"
    "         [--json] --out BUNDLE\n\n"
    "FIRST is the step the checkpoint was taken at (its parameters before that step's update), LAST the\n"
    "last step to replay. Without --optimizer only step FIRST replays. --log is JSON lines, one object\n"
    "per step: step, lr, loss, and optionally grad_norm, loss_scale, skipped.\n"
    "--torchtitan-numerics STEP=PATH reads torchtitan's numerics capture of step STEP (numerics/, or one\n"
    "rank_<R>_activations.log) as that step's logged site statistics, which run compares with its own.\n"
    "--optimizer-class names the optimizer's class (torch.optim.AdamW, torch.optim.Adam, torch.optim.Muon,\n"
    "torch.optim.Adafactor, transformers.optimization.Adafactor) where its state's names do not say it;\n"
    "--aux-optimizer is a Muon run's second optimizer (AdamW over the parameters Muon does not take).\n"
    "FIRST is checked against the checkpoint's own step counters (the optimizer's step count, HF\n"
    "Trainer's global_step, torchtitan's train_state.step, iter_num): --log-numbering one when the log\n"
    "numbers a step after its update, as torchtitan and HF Trainer do (their default there).\n"
    "A value that changes the math and that no checkpoint or config gives is never guessed: give it\n"
    "as a flag (--num-heads, --norm-eps, --rope-theta, ...) or in --config, or the import names every\n"
    "missing one. The manifest's provenance block records where each value came from.\n"
    "--mtp-loss-scale is required when the checkpoint holds multi-token prediction layers (DeepSeek-V3's):\n"
    "the run's mtp_loss_scaling_factor replays them as Megatron-LM adds them to the loss, 0 leaves them out.\n"
    "--router-aux-loss-coef F: a mixture of experts whose run added the router's load-balancing loss times F\n"
    "(0: none) where the config's rule says otherwise (Hugging Face adds it only with output_router_logits).\n"
    "--data may be repeated: the shards are used in the order given. --token-dtype is given once for\n"
    "all shards or once per shard, in the same order.\n"
    "Pickles (torch.save files, DCP checkpoints) are read by an unpickler that loads only tensors, plain\n"
    "data and a short list of framework classes; anything else is refused, since a crafted pickle runs\n"
    "code. --trust-pickle loads them with Python's full unpickler, for files you trust (said on stderr\n"
    "and recorded in the manifest).\n"
    "Example: nanreplay import --checkpoint ckpt/ --data train.bin --seq-len 2048 --micro-batch-size 4 \\\n"
    "           --sampler-seed 1234 --log train.jsonl --steps 5000:5010 --out incident-5000/\n\n"
    "Runs capture/nanreplay_import.py with Python 3 and PyTorch: NANREPLAY_PYTHON, else /usr/bin/python3,\n"
    "else python3 on PATH (NANREPLAY_IMPORT_HELPER names another helper script). What it detects and chooses\n"
    "is printed on stdout as it goes; warnings (a DEFAULTED value, --trust-pickle) on stderr.\n"
    "--json: print one object instead: bundle, valid, replay_command, notes (what was detected and chosen)\n"
    "and warnings; an error is {\"error\": {exit_code, kind, message, file, key}} as in every command.\n";

// NANREPLAY_IMPORT_HELPER; else the installed copy beside the executable
// (PREFIX/bin/nanreplay -> PREFIX/share/nanreplay/capture/); else the source tree's.
fs::path helper_script() {
  if (const char* given = std::getenv("NANREPLAY_IMPORT_HELPER")) return given;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const fs::path installed = exe.parent_path().parent_path() / "share" / "nanreplay" / "capture" / "nanreplay_import.py";
    if (fs::is_regular_file(installed, ec)) return installed;
  }
  return fs::path(NANREPLAY_SOURCE_DIR) / "capture" / "nanreplay_import.py";
}

// NANREPLAY_PYTHON, /usr/bin/python3 (Debian's, with python3-torch), or python3 on PATH.
std::string python_interpreter() {
  if (const char* given = std::getenv("NANREPLAY_PYTHON")) {
    if (access(given, X_OK) != 0) {
      throw UsageError(std::string("import: NANREPLAY_PYTHON=") + given + " is not an executable Python");
    }
    return given;
  }
  if (access("/usr/bin/python3", X_OK) == 0) return "/usr/bin/python3";
  if (const char* path = std::getenv("PATH")) {
    std::string dirs = path;
    for (size_t begin = 0; begin <= dirs.size();) {
      const size_t end = std::min(dirs.find(':', begin), dirs.size());
      const fs::path candidate = fs::path(dirs.substr(begin, end - begin)) / "python3";
      if (end > begin && access(candidate.c_str(), X_OK) == 0) return candidate.string();
      begin = end + 1;
    }
  }
  throw UsageError("import: needs Python 3 with PyTorch, and found none (/usr/bin/python3 or python3 on PATH); "
                   "set NANREPLAY_PYTHON");
}

// The value of --out, and the arguments with it and --json (the command's, not the helper's) removed.
std::pair<fs::path, CommandArgs> take_out(const CommandArgs& args) {
  fs::path out;
  CommandArgs rest;
  for (size_t i = 1; i < args.size(); ++i) {
    if (args[i] == "--json") continue;
    if (args[i] == "--out" || args[i] == "-o") {
      if (i + 1 >= args.size()) throw UsageError("import: --out needs a directory (see nanreplay import --help)");
      out = args[++i];
    } else if (args[i].rfind("--out=", 0) == 0) {
      out = args[i].substr(6);
    } else {
      rest.push_back(args[i]);
    }
  }
  if (out.empty()) {
    for (const std::string& arg : rest) {  // --outt is a typo, not a missing --out
      const std::string flag = arg.substr(0, arg.find('='));
      if (flag.rfind("--", 0) == 0 && nearest_name(flag, {"--out"}) == "--out") {
        throw UsageError("import: unknown option '" + flag + "'; did you mean '--out'? (see nanreplay import --help)");
      }
    }
    throw UsageError("import: missing --out BUNDLE (see nanreplay import --help)");
  }
  return {out, rest};
}

// What the helper is started with: its words, its environment (ours, and
// kOutcomeVariable naming the file it reports to) and where its stdout goes.
struct HelperLaunch {
  std::vector<std::string> argv;
  fs::path outcome;            // the helper's notes, warnings or error (capture/nanreplay_import.py)
  bool silence_stdout = false;  // --json: stdout holds only the command's one object, not the helper's lines
};

constexpr const char* kOutcomeVariable = "NANREPLAY_IMPORT_RESULT";

// Everything fork's child needs, made before the fork: only async-signal-safe calls after it.
std::vector<std::string> helper_environment(const fs::path& outcome) {
  std::vector<std::string> environment;
  const std::string prefix = std::string(kOutcomeVariable) + "=";
  for (char** entry = environ; *entry != nullptr; ++entry) {
    if (std::string(*entry).rfind(prefix, 0) != 0) environment.push_back(*entry);
  }
  environment.push_back(prefix + outcome.string());
  return environment;
}

// The helper's stdout and stderr, read through pipes: what it prints quotes
// names from a stranger's checkpoint, so it reaches the user only through the
// command's own streams and their terminal guard (cli/terminal_guard.h).
class HelperOutput {
 public:
  HelperOutput() {
    for (int* ends : {out_, err_}) {
      if (::pipe2(ends, O_CLOEXEC) != 0) throw std::runtime_error(std::string("import: pipe failed: ") + std::strerror(errno));
    }
  }
  ~HelperOutput() {
    for (int fd : {out_[0], out_[1], err_[0], err_[1]}) {
      if (fd >= 0) ::close(fd);
    }
  }
  HelperOutput(const HelperOutput&) = delete;
  HelperOutput& operator=(const HelperOutput&) = delete;

  // In the child, before exec: only async-signal-safe calls.
  void attach_child() const {
    ::dup2(out_[1], STDOUT_FILENO);
    ::dup2(err_[1], STDERR_FILENO);
  }
  void close_child_ends() {
    ::close(out_[1]);
    ::close(err_[1]);
    out_[1] = err_[1] = -1;
  }
  // Copies what is ready to `out` (unless silenced) and `err`, waiting at most `wait_ms`.
  void pump(CommandIo& io, bool silence_stdout, int wait_ms) {
    // A pipe at its end is left out, so a helper that closed its streams is not polled in a spin.
    pollfd fds[2] = {{out_open_ ? out_[0] : -1, POLLIN, 0}, {err_open_ ? err_[0] : -1, POLLIN, 0}};
    if (::poll(fds, 2, wait_ms) <= 0) return;
    if (fds[0].revents != 0) out_open_ = still_open(copy(out_[0], io.out, silence_stdout));
    if (fds[1].revents != 0) err_open_ = still_open(copy(err_[0], io.err, false));
  }
  void drain(CommandIo& io, bool silence_stdout) {
    copy_all(out_[0], io.out, silence_stdout);
    copy_all(err_[0], io.err, false);
  }

 private:
  static bool still_open(ssize_t read_result) { return read_result > 0 || (read_result < 0 && errno == EINTR); }
  static ssize_t copy(int fd, std::ostream& to, bool discard) {
    char chunk[4096];
    const ssize_t n = ::read(fd, chunk, sizeof chunk);
    if (n > 0 && !discard) to.write(chunk, n).flush();
    return n;
  }
  static void copy_all(int fd, std::ostream& to, bool discard) {
    const int flags = ::fcntl(fd, F_GETFL);
    ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);  // a grandchild holding the pipe must not hang us
    while (copy(fd, to, discard) > 0) {
    }
  }

  int out_[2] = {-1, -1};
  int err_[2] = {-1, -1};
  bool out_open_ = true;
  bool err_open_ = true;
};

// The helper's exit status; a stop request kills it and throws Interrupted.
int run_helper(const HelperLaunch& launch, CommandIo& io) {
  std::vector<std::string> argv = launch.argv;
  std::vector<std::string> environment = helper_environment(launch.outcome);
  std::vector<char*> words;
  for (std::string& w : argv) words.push_back(w.data());
  words.push_back(nullptr);
  std::vector<char*> envp;
  for (std::string& e : environment) envp.push_back(e.data());
  envp.push_back(nullptr);
  HelperOutput output;
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error(std::string("import: fork failed: ") + std::strerror(errno));
  if (pid == 0) {
    output.attach_child();
    execve(words[0], words.data(), envp.data());
    _exit(127);  // told by the parent: one line, through the command's own error path
  }
  output.close_child_ends();
  int status = 0;
  for (;;) {
    output.pump(io, launch.silence_stdout, 50);
    const pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (done < 0 && errno != EINTR) {
      throw std::runtime_error(std::string("import: waitpid failed: ") + std::strerror(errno));
    }
    if (stop_requested()) {
      ::kill(pid, SIGTERM);
      waitpid(pid, &status, 0);
      throw Interrupted("interrupted while importing; nothing was written");
    }
  }
  output.drain(io, launch.silence_stdout);
  if (stop_requested()) throw Interrupted("interrupted while importing; nothing was written");
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return WEXITSTATUS(status);
}

// What the helper reported (an empty object when it wrote nothing: an older or a stand-in helper).
nlohmann::json helper_outcome(const fs::path& outcome) {
  std::ifstream in(outcome);
  if (!in) return nlohmann::json::object();
  const nlohmann::json parsed = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  return parsed.is_object() ? parsed : nlohmann::json::object();
}

// A failed helper's error, thrown as the command's own so run_cli tells it
// like every command's (one stderr line, and the object under --json).
[[noreturn]] void throw_helper_failure(int status, const nlohmann::json& outcome, const HelperLaunch& launch) {
  const nlohmann::json error = outcome.value("error", nlohmann::json::object());
  const std::string script = launch.argv.at(1);
  if (error.value("kind", "") == "bad_input") {
    throw InputError(error.value("file", ""), error.value("key", ""), error.value("what", ""));
  }
  if (error.contains("message")) throw std::runtime_error(error.value("message", ""));
  if (status == 127) throw std::runtime_error("import: cannot run " + launch.argv.at(0));
  if (status == static_cast<int>(ExitStatus::kBadInput)) {
    throw InputError(script, "", "the import helper refused the input (exit 2) and said why above");
  }
  throw std::runtime_error("import: the helper " + script + " failed with status " + std::to_string(status));
}

// --json's object: where the bundle is, how to replay it, and what the helper detected and warned of.
nlohmann::json import_json(const fs::path& out, const nlohmann::json& outcome) {
  return {{"bundle", out.string()}, {"valid", true},
          {"replay_command", "nanreplay run " + out.string() + " --out triage/"},
          {"notes", outcome.value("notes", nlohmann::json::array())},
          {"warnings", outcome.value("warnings", nlohmann::json::array())}};
}

// `inspect`'s checks on the staged bundle, its messages naming BUNDLE rather than the staging directory.
void validate_like_inspect(const fs::path& staged, const fs::path& out) {
  try {
    const Bundle bundle(staged);
    validate_bundle_structure(bundle);
    const nlohmann::json summary = summarize_bundle(bundle);
    if (!summary["valid"].get<bool>()) throw InputError(out.string(), "data.shards", "a shard's checksum does not match");
  } catch (const InputError& e) {
    std::string message = e.what();
    const std::string staged_text = staged.string();
    for (size_t at = message.find(staged_text); at != std::string::npos; at = message.find(staged_text, at)) {
      message.replace(at, staged_text.size(), out.string());
    }
    throw InputError("", "", "import: the bundle written is invalid: " + message);
  }
}

}  // namespace

int import_command(const CommandArgs& args, CommandIo& io) {
  for (size_t i = 1; i < args.size(); ++i) {
    if (args[i] == "--help" || args[i] == "-h") {
      io.out << kImportHelp << exit_status_help("import");
      return 0;
    }
  }
  const auto [out, helper_args] = take_out(args);
  std::error_code ec;
  if (fs::exists(out, ec) && !(fs::is_directory(out, ec) && fs::is_empty(out, ec))) {
    throw OutputError(out.string(), "already exists; import writes a new bundle (choose another --out)");
  }
  const fs::path script = helper_script();
  if (!fs::exists(script)) throw UsageError("import: the helper " + script.string() + " is missing");
  const std::string python = python_interpreter();
  const bool json = json_requested(args);
  const StopDeferral staged_output;  // a stop now is polled, and the staging directory removed
  StagingDir staging(out, "import");
  HelperLaunch launch{{python, script.string()}, staging.dir() / "outcome.json", json};
  launch.argv.insert(launch.argv.end(), helper_args.begin(), helper_args.end());
  launch.argv.push_back("--out");
  launch.argv.push_back((staging.dir() / "bundle").string());
  const int status = run_helper(launch, io);
  const nlohmann::json outcome = helper_outcome(launch.outcome);
  if (status != 0) throw_helper_failure(status, outcome, launch);
  validate_like_inspect(staging.dir() / "bundle", out);
  if (fs::exists(out, ec)) fs::remove(out, ec);  // the empty directory the user made
  fs::rename(staging.dir() / "bundle", out, ec);
  if (ec) throw OutputError(out.string(), "cannot move the bundle into place: " + ec.message());
  if (json) {
    io.out << import_json(out, outcome).dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } else {
    io.out << "wrote " << out.string() << " (valid; replay it with: nanreplay run " << out.string()
           << " --out triage/)\n";
  }
  return 0;
}

}  // namespace nanreplay
