// Time to verdict: a whole `nanreplay run` (every probe on, every check, every
// output written), from process start to exit, against a whole plain eager
// PyTorch replay of the same steps (bench/eager_replay.py: same weights,
// batches and threads, no probe), alternated, median of --reps each:
//   RATIO run / eager, PyTorch as it starts    (target <= 0.9)
//   RATIO run / eager, the same BLAS as the run
// for a 27M-parameter llama (hidden 512, 8 layers, vocab 4096, tied
// embeddings, seq 256, 4 micro-batches of 2 per step) in a 3-step and a
// 10-step bundle. "As it starts" is /usr/bin/python3 in this environment (the
// system's BLAS, libgomp's default spin); "the same BLAS" points the eager
// process at the OpenBLAS this program (linked as `nanreplay` is) loaded.
// With --compare-cli, a second nanreplay (an older build) is timed in the
// same rotation. Prints the run's own timing breakdown (report.json
// `timings`) of its median repetition and the losses of both sides.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <cxxopts.hpp>
#include <nlohmann/json.hpp>

#include "replay/step/runtime.h"
#include "synth/synthetic_bundle.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

struct Config {
  int repetitions = 5, threads = 2;
  std::vector<int64_t> windows{3, 10};
  fs::path work, cli, compare_cli, python, eager_script;
};

nanreplay::SyntheticSpec whole_run_spec(int64_t steps) {
  nanreplay::SyntheticSpec spec = nanreplay::synthetic_preset("clean-fp32");
  nanreplay::ModelConfig& m = spec.model;
  m.hidden_size = 512;
  m.num_layers = 8;
  m.num_heads = m.num_kv_heads = 8;
  m.intermediate_size = 1376;  // llama's 8/3, rounded up to 16
  m.vocab_size = 4096;
  m.tie_embeddings = true;
  m.max_seq_len = 256;
  spec.seq_len = 256;
  spec.micro_batch_size = 2;
  spec.grad_accum_steps = 4;
  spec.num_steps = steps;
  spec.checkpoint_every = 1;
  spec.num_tokens = std::max<int64_t>(65536, (2 * steps * 8 + 1) * spec.seq_len + 1);
  return spec;
}

fs::path bundle_of(const Config& c, int64_t steps) {
  const fs::path dir = c.work / ("whole-llama27m-" + std::to_string(steps) + "steps");
  if (!fs::exists(dir / "manifest.json")) {
    std::printf("writing %s ...\n", dir.c_str());
    std::fflush(stdout);
    nanreplay::write_synthetic_bundle(dir, whole_run_spec(steps));
  }
  return dir;
}

// One process, start to exit: wall seconds; its stdout into `output` when given.
double time_process(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                    std::string* output = nullptr) {
  int pipe_fds[2] = {-1, -1};
  if (output != nullptr && pipe(pipe_fds) != 0) throw std::runtime_error("pipe failed");
  std::fflush(stdout);
  const auto start = Clock::now();
  const pid_t pid = fork();
  if (pid == 0) {
    for (const std::string& e : env) putenv(const_cast<char*>(e.c_str()));
    if (output != nullptr) {
      dup2(pipe_fds[1], 1);
      close(pipe_fds[0]);
    } else if (std::freopen("/dev/null", "w", stdout) == nullptr) {
      _exit(127);
    }
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    std::perror(args[0]);
    _exit(127);
  }
  if (output != nullptr) {
    close(pipe_fds[1]);
    char buffer[4096];
    ssize_t n = 0;
    while ((n = read(pipe_fds[0], buffer, sizeof buffer)) > 0) output->append(buffer, static_cast<size_t>(n));
    close(pipe_fds[0]);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (!WIFEXITED(status) || WEXITSTATUS(status) > 1) {
    throw std::runtime_error(argv[0] + " exited with status " + std::to_string(WEXITSTATUS(status)));
  }
  return seconds;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Side {
  std::string name;
  std::vector<std::string> argv, env;
  std::vector<double> seconds;
  std::vector<nlohmann::json> reports;  // nanreplay sides: report.json of each repetition
  std::string last_output;
};

// The eager side's per-step losses from its stdout ("step N loss L grad_norm G").
std::vector<double> eager_losses(const std::string& output) {
  std::vector<double> losses;
  std::istringstream lines(output);
  std::string word, loss_word;
  long long step = 0;
  double loss = 0, norm = 0;
  while (lines >> word >> step >> loss_word >> loss >> word >> norm) losses.push_back(loss);
  return losses;
}

void print_breakdown(const nlohmann::json& report, double process_seconds) {
  const nlohmann::json& t = report.at("timings");
  std::printf("  breakdown of the median run (report.json timings; process %.2f s, of which %.2f s after start-up):\n",
              process_seconds, t.at("total_seconds").get<double>());
  for (const auto& [phase, s] : t.at("seconds").items()) {
    const double seconds = s.get<double>();
    if (seconds >= 0.0005) std::printf("    %-14s %7.3f s  %5.1f %%\n", phase.c_str(), seconds, 100 * seconds / process_seconds);
  }
  const double determinism = t.at("seconds").at("determinism").get<double>();
  std::printf("  determinism check (%s %s): %.1f %% of the run (target <= 10 %%)\n",
              report.at("determinism").at("replayed").get<std::string>().c_str(),
              report.at("determinism").at("micro_batch").dump().c_str(), 100 * determinism / process_seconds);
}

void bench_window(const Config& c, int64_t steps) {
  const fs::path bundle = bundle_of(c, steps);
  const std::string threads = std::to_string(c.threads);
  const nanreplay::BlasInUse blas = nanreplay::blas_in_use();
  const std::string blas_dir = fs::path(blas.path).parent_path().string();
  std::vector<Side> sides;
  auto run_side = [&](const std::string& name, const fs::path& cli, const std::string& out) {
    sides.push_back({name, {cli.string(), "run", bundle.string(), "--out", (c.work / out).string(), "--quiet",
                            "--threads", threads}, {}, {}, {}, {}});
  };
  run_side("nanreplay run", c.cli, "whole-run-out");
  if (!c.compare_cli.empty()) run_side("nanreplay run (--compare-cli)", c.compare_cli, "whole-run-out-compared");
  const std::vector<std::string> eager = {c.python.string(), c.eager_script.string(), "--bundle", bundle.string(),
                                          "--threads", threads};
  sides.push_back({"eager PyTorch, as it starts", eager, {}, {}, {}, {}});
  sides.push_back({"eager PyTorch, the run's BLAS", eager, {"LD_LIBRARY_PATH=" + blas_dir}, {}, {}, {}});

  std::printf("\n== whole run, %lld steps (27.4M-parameter llama, 4 micro-batches of 2 x 256 per step, %d threads; "
              "BLAS here: %s, threads %s)\n", static_cast<long long>(steps), c.threads, blas.description.c_str(),
              blas.threading.c_str());
  for (int r = 0; r < c.repetitions; ++r) {
    for (size_t k = 0; k < sides.size(); ++k) {
      Side& side = sides[(static_cast<size_t>(r) + k) % sides.size()];
      std::this_thread::sleep_for(std::chrono::milliseconds(400));  // the previous side's threads park
      side.last_output.clear();
      side.seconds.push_back(time_process(side.argv, side.env, &side.last_output));
      if (side.argv[1] == "run") {
        std::ifstream in(fs::path(side.argv[4]) / "report.json");
        side.reports.push_back(nlohmann::json::parse(in));
      }
    }
  }
  std::printf("%-34s %8s %8s   all (s)\n", "whole process, seconds", "median", "best");
  for (const Side& s : sides) {
    std::printf("%-34s %8.3f %8.3f  ", s.name.c_str(), median(s.seconds), *std::min_element(s.seconds.begin(), s.seconds.end()));
    for (double v : s.seconds) std::printf(" %.2f", v);
    std::printf("\n");
  }
  const Side& run = sides.front();
  const Side& as_starts = sides[sides.size() - 2];
  const Side& same_blas = sides.back();
  std::printf("RATIO run / eager, PyTorch as it starts   %.3f  (target <= 0.9)\n", median(run.seconds) / median(as_starts.seconds));
  std::printf("RATIO run / eager, the run's BLAS         %.3f\n", median(run.seconds) / median(same_blas.seconds));
  if (!c.compare_cli.empty()) {
    std::printf("RATIO run / run of --compare-cli         %.3f\n", median(run.seconds) / median(sides[1].seconds));
  }
  const size_t median_rep = static_cast<size_t>(
      std::find(run.seconds.begin(), run.seconds.end(), median(run.seconds)) - run.seconds.begin());
  print_breakdown(run.reports[median_rep], run.seconds[median_rep]);
  const std::vector<double> losses = eager_losses(as_starts.last_output);
  double worst = 0.0;
  const nlohmann::json& replayed = run.reports.back().at("steps");
  for (size_t i = 0; i < losses.size() && i < replayed.size(); ++i) {
    const double mine = replayed[i].at("loss").get<double>();
    worst = std::max(worst, std::abs(mine - losses[i]) / std::abs(losses[i]));
  }
  std::printf("  losses: %zu steps each, largest relative difference run vs eager %.2e\n", losses.size(), worst);
}

Config parse(int argc, char** argv) {
  cxxopts::Options options("bench_whole_run", "Whole `nanreplay run` against a whole eager PyTorch replay");
  const fs::path exe_dir = fs::absolute(argv[0]).parent_path();
  options.add_options()
      ("reps", "repetitions of each side", cxxopts::value<int>()->default_value("5"))
      ("threads", "compute threads on every side", cxxopts::value<int>()->default_value("2"))
      ("steps", "bundle windows, comma-separated", cxxopts::value<std::vector<int64_t>>()->default_value("3,10"))
      ("work", "where bundles and outputs go", cxxopts::value<std::string>()->default_value("bench-work"))
      ("cli", "the nanreplay executable", cxxopts::value<std::string>()->default_value((exe_dir.parent_path() / "nanreplay").string()))
      ("compare-cli", "another nanreplay to time in the same rotation (an older build)", cxxopts::value<std::string>())
      ("python", "Python with torch", cxxopts::value<std::string>()->default_value("/usr/bin/python3"))
      ("h,help", "show this help");
  const auto args = options.parse(argc, argv);
  if (args.count("help")) {
    std::cout << options.help();
    std::exit(0);
  }
  Config c;
  c.repetitions = std::max(1, args["reps"].as<int>());
  c.threads = std::max(1, args["threads"].as<int>());
  c.windows = args["steps"].as<std::vector<int64_t>>();
  c.work = fs::absolute(args["work"].as<std::string>());
  c.cli = fs::absolute(args["cli"].as<std::string>());
  if (args.count("compare-cli")) c.compare_cli = fs::absolute(args["compare-cli"].as<std::string>());
  c.python = args["python"].as<std::string>();
  c.eager_script = fs::path(NANREPLAY_SOURCE_DIR) / "bench" / "eager_replay.py";
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  const Config c = parse(argc, argv);
  fs::create_directories(c.work);
  for (int64_t steps : c.windows) bench_window(c, steps);
  return 0;
}
