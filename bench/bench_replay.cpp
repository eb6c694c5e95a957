// The replay's cost on a model large enough to matter, as ratios measured
// side by side in one run:
//   probes   replay step with every probe on / with probes off   (target <= 1.10)
//   eager    replay step / the same step in eager PyTorch         (target <= 1.0)
//   memory   peak RSS of `nanreplay run` on a 10-step bundle / on a 1-step
//            bundle of the same model                             (target <= 1.2)
//   derived  a rolled-forward step (probes on, then clip and AdamW) / an
//            eager PyTorch training step (forward, backward, clip_grad_norm_,
//            torch.optim.AdamW)                                   (target <= 1.0)
//   rolling  peak RSS of `nanreplay run` on a 50-step / a 5-step window rolled
//            forward from one checkpoint, probes on               (target <= 1.2)
// A step is every micro-batch forward and backward from the step's checkpoint
// plus (probes on) the parameter-gradient probes: replay_step(), the replay's
// inner loop, with the checkpoint already mapped (loading is timed apart).
// The eager side is bench/bench_eager.py in Debian's python3 (the same
// LibTorch), kept running and asked for one step at a time, so repetitions
// interleave: on, off, eager, eager as PyTorch starts by default, rotating
// which goes first, with a pause before each; it prints the median and the
// best repetition of each side. This program loads the BLAS `nanreplay`
// loads (CMakeLists.txt, nanreplay_use_openmp_blas); one eager peer runs on
// that same BLAS, the other as PyTorch starts here (the system's BLAS).
// bench_whole_run.cpp times whole processes instead.
// Bundles are synthesized once into --work and reused.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <cxxopts.hpp>
#include <torch/torch.h>

#include "loaders/bundle.h"
#include "replay/checkpoint.h"
#include "replay/replay_engine.h"
#include "replay/runtime.h"
#include "replay/step.h"
#include "replay/step_scan.h"
#include "replay/trajectory.h"
#include "synth/synthetic_bundle.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

struct BenchConfig {
  int64_t hidden = 512, layers = 8, heads = 8, seq = 256, batch = 2, vocab = 8192;
  int repetitions = 7;
  int threads = 2;
  bool eager = true, memory = true, roll = true;
  int64_t roll_steps = 50;
  std::string only;  // "on" or "off": time that side alone (for a profiler)
  fs::path work, cli, python, eager_script;
};

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

nanreplay::SyntheticSpec bench_spec(const BenchConfig& c, int64_t steps, int64_t checkpoint_every) {
  nanreplay::SyntheticSpec spec = nanreplay::synthetic_preset("clean-fp32");
  nanreplay::ModelConfig& m = spec.model;
  m.hidden_size = c.hidden;
  m.num_layers = static_cast<int>(c.layers);
  m.num_heads = static_cast<int>(c.heads);
  m.num_kv_heads = static_cast<int>(c.heads);
  m.intermediate_size = (c.hidden * 8 / 3 + 15) / 16 * 16;  // llama's 8/3, rounded up to 16
  m.vocab_size = c.vocab;
  m.max_seq_len = c.seq;
  spec.seq_len = c.seq;
  spec.micro_batch_size = c.batch;
  spec.grad_accum_steps = 1;
  spec.num_steps = steps;
  spec.checkpoint_every = checkpoint_every;
  spec.num_tokens = std::max<int64_t>(65536, (4 * steps * c.batch + 1) * c.seq + 1);
  return spec;
}

// The bundle of `steps` steps for this model, written on first use; rolled
// forward from its first checkpoint when `rolled`.
fs::path bundle_for(const BenchConfig& c, int64_t steps, bool rolled = false) {
  const fs::path dir = c.work / ("llama-h" + std::to_string(c.hidden) + "-l" + std::to_string(c.layers) +
                                 "-s" + std::to_string(c.seq) + "-b" + std::to_string(c.batch) + "-v" +
                                 std::to_string(c.vocab) + "-" + std::to_string(steps) + "steps" +
                                 (rolled ? "-rolled" : ""));
  if (!fs::exists(dir / "manifest.json")) {
    std::printf("writing %s ...\n", dir.c_str());
    std::fflush(stdout);
    nanreplay::write_synthetic_bundle(dir, bench_spec(c, steps, rolled ? steps : 1));
  }
  return dir;
}

// bench_eager.py, kept running; one timed eager step per request.
class EagerPeer {
 public:
  // `users_environment`: PyTorch as it starts here; otherwise on this
  // program's BLAS (its directory first on LD_LIBRARY_PATH).
  // `train`: each step also clips and applies torch.optim.AdamW.
  EagerPeer(const BenchConfig& c, const fs::path& bundle, int64_t step, bool users_environment, bool train = false) {
    int to_child[2], from_child[2];
    if (pipe(to_child) != 0 || pipe(from_child) != 0) throw std::runtime_error("pipe failed");
    std::fflush(stdout);  // or the child's stdio would print our buffered lines again
    pid_ = fork();
    if (pid_ == 0) {
      dup2(to_child[0], 0);
      dup2(from_child[1], 1);
      close(to_child[1]);
      close(from_child[0]);
      const std::string blas = nanreplay::blas_in_use().path;
      if (!users_environment && !blas.empty()) setenv("LD_LIBRARY_PATH", fs::path(blas).parent_path().c_str(), 1);
      const std::string threads = std::to_string(c.threads), step_text = std::to_string(step);
      execl(c.python.c_str(), c.python.c_str(), c.eager_script.c_str(), "--bundle", bundle.c_str(),
            "--step", step_text.c_str(), "--threads", threads.c_str(), train ? "--train" : static_cast<char*>(nullptr),
            static_cast<char*>(nullptr));
      std::perror("exec python");
      _exit(127);
    }
    close(to_child[0]);
    close(from_child[1]);
    requests_ = fdopen(to_child[1], "w");
    replies_ = fdopen(from_child[0], "r");
  }
  ~EagerPeer() {
    std::fputs("quit\n", requests_);
    std::fclose(requests_);
    std::fclose(replies_);
    waitpid(pid_, nullptr, 0);
  }
  EagerPeer(const EagerPeer&) = delete;
  EagerPeer& operator=(const EagerPeer&) = delete;

  struct Reply {
    double seconds = 0, loss = 0, grad_norm = 0;
  };
  Reply step() {
    std::fputs("step\n", requests_);
    std::fflush(requests_);
    Reply r;
    if (std::fscanf(replies_, "%lf %lf %lf", &r.seconds, &r.loss, &r.grad_norm) != 3) {
      throw std::runtime_error("bench_eager.py did not answer (does --python have torch?)");
    }
    return r;
  }

 private:
  pid_t pid_ = -1;
  FILE* requests_ = nullptr;
  FILE* replies_ = nullptr;
};

// Peak resident set of one `nanreplay run` of `bundle`, in MiB (the child's own, via wait4).
double peak_rss_mib(const BenchConfig& c, const fs::path& bundle, int* exit_code) {
  const fs::path out = c.work / ("rss-" + bundle.filename().string());
  const std::string threads = std::to_string(c.threads);
  std::fflush(stdout);  // or the child's freopen would print our buffered lines again
  const pid_t pid = fork();
  if (pid == 0) {
    if (std::freopen("/dev/null", "w", stdout) == nullptr) _exit(127);
    execl(c.cli.c_str(), c.cli.c_str(), "run", bundle.c_str(), "--out", out.c_str(), "--force", "--quiet",
          "--threads", threads.c_str(), static_cast<char*>(nullptr));
    std::perror("exec nanreplay");
    _exit(127);
  }
  int status = 0;
  struct rusage usage {};
  wait4(pid, &status, 0, &usage);
  *exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

BenchConfig parse(int argc, char** argv) {
  cxxopts::Options options("bench_replay", "Replay cost ratios: probes on/off, replay/eager, peak RSS 10/1 "
                                           "steps, derived/eager training step, peak RSS 50/5 derived steps");
  BenchConfig c;
  const fs::path exe_dir = fs::absolute(argv[0]).parent_path();
  options.add_options()
      ("hidden", "hidden size", cxxopts::value<int64_t>()->default_value("512"))
      ("layers", "layers", cxxopts::value<int64_t>()->default_value("8"))
      ("heads", "attention heads", cxxopts::value<int64_t>()->default_value("8"))
      ("seq", "sequence length", cxxopts::value<int64_t>()->default_value("256"))
      ("batch", "micro-batch size (one micro-batch per step)", cxxopts::value<int64_t>()->default_value("2"))
      ("vocab", "vocabulary size", cxxopts::value<int64_t>()->default_value("8192"))
      ("reps", "timed repetitions of each side", cxxopts::value<int>()->default_value("7"))
      ("threads", "compute threads on both sides", cxxopts::value<int>()->default_value("2"))
      ("work", "where bundles and outputs go", cxxopts::value<std::string>()->default_value("bench-work"))
      ("cli", "the nanreplay executable", cxxopts::value<std::string>()->default_value((exe_dir.parent_path() / "nanreplay").string()))
      ("python", "Python with torch", cxxopts::value<std::string>()->default_value("/usr/bin/python3"))
      ("skip-eager", "leave out the eager comparison")
      ("skip-memory", "leave out the peak RSS comparison")
      ("skip-roll", "leave out rolling forward (derived step / eager training step, peak RSS 50/5 steps)")
      ("roll-steps", "steps of the long rolled window (the short one has 5)",
       cxxopts::value<int64_t>()->default_value("50"))
      ("only", "run only the probes 'on' or 'off' replay, --reps times, no ratios (to profile it)",
       cxxopts::value<std::string>())
      ("h,help", "show this help");
  const auto args = options.parse(argc, argv);
  if (args.count("help")) {
    std::cout << options.help();
    std::exit(0);
  }
  c.hidden = args["hidden"].as<int64_t>();
  c.layers = args["layers"].as<int64_t>();
  c.heads = args["heads"].as<int64_t>();
  c.seq = args["seq"].as<int64_t>();
  c.batch = args["batch"].as<int64_t>();
  c.vocab = args["vocab"].as<int64_t>();
  c.repetitions = std::max(1, args["reps"].as<int>());
  c.threads = std::max(1, args["threads"].as<int>());
  c.work = fs::absolute(args["work"].as<std::string>());
  c.cli = args["cli"].as<std::string>();
  c.python = args["python"].as<std::string>();
  c.eager = args.count("skip-eager") == 0;
  c.memory = args.count("skip-memory") == 0;
  c.roll = args.count("skip-roll") == 0 && c.eager;
  c.roll_steps = std::max<int64_t>(6, args["roll-steps"].as<int64_t>());
  if (args.count("only")) {
    c.only = args["only"].as<std::string>();
    if (c.only != "on" && c.only != "off") throw std::invalid_argument("--only takes on or off");
  }
  c.eager_script = fs::path(NANREPLAY_SOURCE_DIR) / "bench" / "bench_eager.py";
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  const BenchConfig c = parse(argc, argv);
  fs::create_directories(c.work);
  nanreplay::set_compute_threads(c.threads);
  nanreplay::tune_heap_for_replay();  // as `nanreplay run` does

  const fs::path ten = bundle_for(c, 10);
  const nanreplay::Bundle bundle(ten);
  const nanreplay::StepFiles& files = bundle.steps().front();
  const nanreplay::StepState state = bundle.load_state(files);
  const nanreplay::StepBatch batch = nanreplay::batch_of_step(bundle, files.step);
  const auto load_start = Clock::now();
  nanreplay::ModelCheckpoint checkpoint(files, bundle.manifest().model);
  const double load_seconds = seconds_since(load_start);
  // The replay's one step function, as `nanreplay run` calls it, with probes on or off.
  auto replay_once = [&](bool probes) {
    nanreplay::StepRequest request;
    request.probes = probes ? nanreplay::ProbeLevel::kFull : nanreplay::ProbeLevel::kOff;
    return nanreplay::replay_step({bundle.manifest(), bundle.tokens(), files.step, state, batch}, checkpoint, {},
                                  request);
  };
  int64_t parameters = 0;
  for (const auto& [name, tensor] : checkpoint.params()) parameters += tensor.numel();

  std::printf("model llama hidden %lld, %lld layers, %lld heads, vocab %lld, %.1fM parameters; "
              "batch %lld x seq %lld; %d threads; median of %d interleaved repetitions\n",
              static_cast<long long>(c.hidden), static_cast<long long>(c.layers),
              static_cast<long long>(c.heads), static_cast<long long>(c.vocab), double(parameters) / 1e6,
              static_cast<long long>(c.batch), static_cast<long long>(c.seq), c.threads, c.repetitions);
  std::printf("checkpoint load (mmap, validate, fp32 in place): %.3f s, not in the step times\n", load_seconds);

  if (!c.only.empty()) {
    for (int r = 0; r < c.repetitions; ++r) {
      const auto start = Clock::now();
      replay_once(c.only == "on");
      std::printf("replay step, probes %s  %.3f s\n", c.only.c_str(), seconds_since(start));

    }
    return 0;
  }

  std::unique_ptr<EagerPeer> eager, eager_default, eager_training;
  if (c.eager) {
    eager = std::make_unique<EagerPeer>(c, ten, files.step, false);
    eager_default = std::make_unique<EagerPeer>(c, ten, files.step, true);
  }
  if (c.roll) eager_training = std::make_unique<EagerPeer>(c, ten, files.step, false, /*train=*/true);
  // Rolling forward: the step's parameters and AdamW state, advanced by every derived step.
  nanreplay::Trajectory trajectory;
  if (c.roll) trajectory.start(bundle, files);
  auto derive_once = [&] {
    nanreplay::ModelCheckpoint current = trajectory.checkpoint();
    nanreplay::StepRequest request;
    request.probes = nanreplay::ProbeLevel::kFull;
    nanreplay::StepResult step =
        nanreplay::replay_step({bundle.manifest(), bundle.tokens(), files.step, state, batch}, current, {}, request);
    trajectory.advance(step, state, /*scaler_skipped=*/false);
    return step;
  };
  const char* spin = std::getenv("GOMP_SPINCOUNT");
  const nanreplay::BlasInUse blas = nanreplay::blas_in_use();
  std::printf("BLAS: %s (threads: %s) from %s; GOMP_SPINCOUNT=%s\n", blas.description.c_str(),
              blas.threading.c_str(), blas.path.c_str(), spin ? spin : "unset");

  size_t probe_count = 0;
  double loss_on = 0, loss_off = 0;
  EagerPeer::Reply eager_reply, eager_default_reply, eager_training_reply;
  double loss_derived = 0;
  std::vector<std::function<double()>> sides = {
      [&] {
        const auto start = Clock::now();
        const nanreplay::StepResult step = replay_once(true);
        const double seconds = seconds_since(start);
        probe_count = step.probes.size();
        loss_on = step.loss;
        return seconds;
      },
      [&] {
        const auto start = Clock::now();
        const nanreplay::StepResult step = replay_once(false);
        const double seconds = seconds_since(start);
        loss_off = step.loss;
        return seconds;
      },
      [&] {
        eager_reply = eager->step();
        return eager_reply.seconds;
      },
      [&] {
        eager_default_reply = eager_default->step();
        return eager_default_reply.seconds;
      },
      [&] {
        const auto start = Clock::now();
        loss_derived = derive_once().loss;
        return seconds_since(start);
      },
      [&] {
        eager_training_reply = eager_training->step();
        return eager_training_reply.seconds;
      }};
  const size_t side_count = c.roll ? 6 : eager ? 4 : 2;
  for (size_t s = 0; s < side_count; ++s) sides[s]();  // warm up: page in, thread pools, allocator
  std::vector<std::vector<double>> times(side_count);
  for (int r = 0; r < c.repetitions; ++r) {
    for (size_t k = 0; k < side_count; ++k) {
      const size_t s = (static_cast<size_t>(r) + k) % side_count;
      // Idle threads of the side before (OpenBLAS workers yield-spin for about
      // 0.1 s, libgomp's spin) would take cores from this one: let them park.
      std::this_thread::sleep_for(std::chrono::milliseconds(400));
      times[s].push_back(sides[s]());
    }
  }
  // Medians, and the best repetition of each side: on a shared machine
  // interference only ever adds time, so the fastest runs are the most
  // comparable when the medians of one run drift apart.
  struct Summary {
    double median, best;
  };
  std::vector<Summary> sum;
  for (const std::vector<double>& t : times) sum.push_back({median(t), *std::min_element(t.begin(), t.end())});
  const char* names[] = {"replay step, probes on", "replay step, probes off",
                         "eager PyTorch, the replay's BLAS", "eager PyTorch, as it starts",
                         "derived step, probes on, clip + AdamW", "eager training step, clip + torch AdamW"};
  std::printf("%-46s %8s %8s\n", "seconds per step", "median", "best");
  for (size_t s = 0; s < side_count; ++s) std::printf("%-46s %8.3f %8.3f\n", names[s], sum[s].median, sum[s].best);
  std::printf("losses: probes on %.9g, probes off %.9g", loss_on, loss_off);
  if (eager) std::printf(", eager %.9g and %.9g", eager_reply.loss, eager_default_reply.loss);
  if (c.roll) std::printf("; training (last repetition): derived %.9g, eager %.9g", loss_derived, eager_training_reply.loss);
  std::printf("; %zu probe records\n", probe_count);
  auto ratio = [&](const char* label, size_t a, size_t b, const char* target) {
    std::printf("RATIO %-44s median %.3f  best %.3f  %s\n", label, sum[a].median / sum[b].median,
                sum[a].best / sum[b].best, target);
  };
  ratio("probes on / probes off", 0, 1, "(target <= 1.10)");
  if (eager) {
    eager.reset();
    eager_default.reset();
    ratio("replay (probes on) / eager, as it starts", 0, 3, "(target <= 1.0)");
    ratio("replay (probes on) / eager, the replay's BLAS", 0, 2, "(target <= 1.0)");
    ratio("replay (probes off) / eager, the replay's BLAS", 1, 2, "");
  }
  if (c.roll) {
    eager_training.reset();
    ratio("derived step / eager training step", 4, 5, "(target <= 1.0)");
  }

  if (c.memory) {
    const fs::path one = bundle_for(c, 1);
    std::vector<double> rss_one, rss_ten;
    int rc_one = 0, rc_ten = 0;
    for (int r = 0; r < 2; ++r) {
      rss_one.push_back(peak_rss_mib(c, one, &rc_one));
      rss_ten.push_back(peak_rss_mib(c, ten, &rc_ten));
    }
    const double peak_one = *std::max_element(rss_one.begin(), rss_one.end());
    const double peak_ten = *std::max_element(rss_ten.begin(), rss_ten.end());
    std::printf("nanreplay run, peak RSS: 1-step bundle %.0f MiB (exit %d), 10-step bundle %.0f MiB (exit %d)\n",
                peak_one, rc_one, peak_ten, rc_ten);
    std::printf("RATIO peak RSS 10 steps / 1 step %.3f  (target <= 1.2)\n", peak_ten / peak_one);
  }
  if (c.roll) {
    // One run each: a 50-step run of the default model takes about a minute on 2 threads.
    int rc_short = 0, rc_long = 0;
    const fs::path short_window = bundle_for(c, 5, true), long_window = bundle_for(c, c.roll_steps, true);
    const double peak_short = peak_rss_mib(c, short_window, &rc_short);
    const double peak_long = peak_rss_mib(c, long_window, &rc_long);
    const auto output_mib = [&](const fs::path& window, const char* name) {
      return static_cast<double>(fs::file_size(c.work / ("rss-" + window.filename().string()) / name)) / (1 << 20);
    };
    std::printf("nanreplay run rolled forward from one checkpoint, probes on, peak RSS: 5 steps %.0f MiB (exit %d), "
                "%lld steps %.0f MiB (exit %d)\n", peak_short, rc_short, static_cast<long long>(c.roll_steps),
                peak_long, rc_long);
    std::printf("  report.html %.2f MiB / %.2f MiB, trace.h5 %.2f MiB / %.2f MiB\n",
                output_mib(short_window, "report.html"), output_mib(long_window, "report.html"),
                output_mib(short_window, "trace.h5"), output_mib(long_window, "trace.h5"));
    std::printf("RATIO peak RSS %lld derived steps / 5 %.3f  (target <= 1.2)\n",
                static_cast<long long>(c.roll_steps), peak_long / peak_short);
  }
  return 0;
}
