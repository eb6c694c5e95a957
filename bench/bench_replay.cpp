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
// --model moe (or both): the same ratios for Qwen3-MoE's mixture of experts
// in every layer (replay/arch/experts.cpp; 8 experts, top 2, each expert half the
// dense width, so a token's expert compute equals the dense MLP's), and one
// MoE layer alone: experts_mlp forward and backward with every probe of the
// layer and of its parameter gradients / Hugging Face's Qwen3MoeSparseMoeBlock
// (tests/py/torch_models.py) forward and backward on the same weights,
// input and upstream gradient                                  (target <= 1.0)
// The memory and rolling sections measure the dense model.
// A step is every micro-batch forward and backward from the step's checkpoint
// plus (probes on) the parameter-gradient probes: replay_step(), the replay's
// inner loop, with the checkpoint already mapped (loading is timed apart).
// The eager side is bench/bench_eager.py in Debian's python3 (the same
// LibTorch), kept running and asked for one step at a time, so repetitions
// interleave: on, off, eager, eager as PyTorch starts by default, in a new
// (seeded) order each repetition, with a pause before each; it prints the
// median and the best repetition of each side. This program loads the BLAS `nanreplay`
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
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <cxxopts.hpp>
#include <torch/torch.h>

#include "loaders/bundle/bundle.h"
#include "replay/step/checkpoint.h"
#include "replay/arch/experts.h"
#include "replay/probing/probe_session.h"
#include "replay/workflows/replay_engine.h"
#include "replay/step/runtime.h"
#include "replay/step/step.h"
#include "replay/step/step_scan.h"
#include "replay/step/trajectory.h"
#include "synth/synthetic_bundle.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

struct BenchConfig {
  int64_t hidden = 512, layers = 8, heads = 8, seq = 256, batch = 2, vocab = 8192;
  bool dense = true, moe = false;                   // --model dense, moe or both
  int64_t experts = 8, top_k = 2, expert_width = 0;  // 0: half the dense MLP's width
  int repetitions = 7;
  int threads = 2;
  bool eager = true, memory = true, roll = true;
  int64_t roll_steps = 50;
  std::string only;  // "on", "off" or "layer": time that side alone (for a profiler)
  fs::path work, cli, python, eager_script;
};

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double seconds_of(const std::function<void()>& work) {
  const auto start = Clock::now();
  work();
  return seconds_since(start);
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

int64_t dense_width(int64_t hidden) { return (hidden * 8 / 3 + 15) / 16 * 16; }  // llama's 8/3, rounded up to 16

nanreplay::SyntheticSpec bench_spec(const BenchConfig& c, bool moe, int64_t steps, int64_t checkpoint_every) {
  nanreplay::SyntheticSpec spec = nanreplay::synthetic_preset("clean-fp32");
  nanreplay::ModelConfig& m = spec.model;
  m.hidden_size = c.hidden;
  m.num_layers = static_cast<int>(c.layers);
  m.num_heads = static_cast<int>(c.heads);
  m.num_kv_heads = static_cast<int>(c.heads);
  m.intermediate_size = dense_width(c.hidden);
  m.vocab_size = c.vocab;
  m.max_seq_len = c.seq;
  if (moe) {  // the clean-moe preset's router (renormalized top-k, aux and z losses) at the bench's shape
    m.moe = nanreplay::synthetic_preset("clean-moe").model.moe;
    m.moe->num_experts = c.experts;
    m.moe->top_k = c.top_k;
    m.moe->intermediate_size = c.expert_width;
  }
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
fs::path bundle_for(const BenchConfig& c, int64_t steps, bool rolled = false, bool moe = false) {
  const std::string experts = moe ? "-moe" + std::to_string(c.experts) + "x" + std::to_string(c.top_k) + "w" +
                                        std::to_string(c.expert_width)
                                  : "";
  const fs::path dir = c.work / ("llama-h" + std::to_string(c.hidden) + "-l" + std::to_string(c.layers) +
                                 "-s" + std::to_string(c.seq) + "-b" + std::to_string(c.batch) + "-v" +
                                 std::to_string(c.vocab) + experts + "-" + std::to_string(steps) + "steps" +
                                 (rolled ? "-rolled" : ""));
  if (!fs::exists(dir / "manifest.json")) {
    std::printf("writing %s ...\n", dir.c_str());
    std::fflush(stdout);
    nanreplay::write_synthetic_bundle(dir, bench_spec(c, moe, steps, rolled ? steps : 1));
  }
  return dir;
}

// bench_eager.py, kept running; one timed eager step per request.
class EagerPeer {
 public:
  // `users_environment`: PyTorch as it starts here; otherwise on this
  // program's BLAS (its directory first on LD_LIBRARY_PATH).
  // `mode`: bench_eager.py's further arguments: "--train" (each step also
  // clips and applies torch.optim.AdamW) or "--moe-layer N" (N passes of one
  // MoE layer alone), or none.
  EagerPeer(const BenchConfig& c, const fs::path& bundle, int64_t step, bool users_environment,
            const std::vector<std::string>& mode = {}) {
    std::vector<std::string> args = {c.python.string(), c.eager_script.string(), "--bundle", bundle.string(),
                                     "--step", std::to_string(step), "--threads", std::to_string(c.threads)};
    args.insert(args.end(), mode.begin(), mode.end());
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
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
      execv(argv[0], argv.data());
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

// One model's first bundle step, its checkpoint mapped beforehand.
struct Subject {
  std::string name;  // "dense" or "MoE"
  fs::path dir;
  nanreplay::Bundle bundle;
  const nanreplay::StepFiles& files;
  nanreplay::StepState state;
  nanreplay::StepBatch batch;
  std::optional<nanreplay::ModelCheckpoint> checkpoint;
  double load_seconds = 0;
  // The last repetition of each side: its loss (and records), to print and compare.
  size_t probe_count = 0;
  double loss_on = 0, loss_off = 0;
  std::unique_ptr<EagerPeer> eager, eager_default;
  EagerPeer::Reply eager_reply, eager_default_reply;

  Subject(std::string name_, const fs::path& dir_)
      : name(std::move(name_)),
        dir(dir_),
        bundle(dir),
        files(bundle.steps().front()),
        state(bundle.load_state(files)),
        batch(nanreplay::batch_of_step(bundle, files.step)) {
    load_seconds = seconds_of([&] { checkpoint.emplace(files, bundle.manifest().model); });
  }
  // The replay's one step function, as `nanreplay run` calls it, with probes on or off.
  nanreplay::StepResult replay(bool probes) {
    nanreplay::StepRequest request;
    request.probes = probes ? nanreplay::ProbeLevel::kFull : nanreplay::ProbeLevel::kOff;
    return nanreplay::replay_step({bundle.manifest(), bundle.tokens(), files.step, state, batch}, *checkpoint, {},
                                  request);
  }
};

// One MoE layer alone, on layer 0's weights, `kPasses` times per timed
// repetition (one pass is tens of milliseconds, too short to time alone on a
// shared machine): experts_mlp forward from
// h = randn(batch, seq, hidden) after manual_seed(0), backward from the
// upstream gradient g = randn drawn next, as sum(out * g). Probes on: every
// site of the layer (router, probabilities, each expert's gate, up, act and
// down per expert, combine), forward and backward, and the statistics of the
// layer's parameter gradients, as a step takes them. bench_eager.py
// --moe-layer draws the same h and g.
class MoeLayer {
 public:
  static constexpr int kPasses = 5;
  explicit MoeLayer(Subject& s)
      : s_(s), arithmetic_(s.bundle.manifest(), s.state, {}, /*native=*/false) {
    const nanreplay::DataConfig& data = s.bundle.manifest().data;
    torch::manual_seed(0);
    h_ = torch::randn({data.micro_batch_size, data.seq_len, arithmetic_.model.hidden_size});
    g_ = torch::randn(h_.sizes());
    for (int64_t row = 0; row < data.micro_batch_size; ++row) rows_.push_back(row);
    for (const auto& [name, tensor] : s.checkpoint->compute_params()) {
      if (nanreplay::layer_of_parameter(name) == 0 && name.find(".mlp.") != std::string::npos) {
        params_.push_back(tensor);
      }
    }
  }
  // sum(out * g) of one pass
  double run(bool probes) {
    nanreplay::ProbeSession session({s_.files.step, 0, 0, rows_}, arithmetic_.numerics, probes, arithmetic_.model);
    nanreplay::RouterOutputs router;
    const torch::Tensor h = h_.detach().requires_grad_(true);
    const torch::Tensor out = nanreplay::experts_mlp(arithmetic_.model, s_.checkpoint->compute_params(), h, 0,
                                                     arithmetic_.numerics, session, router);
    const torch::Tensor objective = (out * g_).sum();
    objective.backward();
    size_t records = session.take_records().size();
    for (torch::Tensor& param : params_) {
      if (probes && param.grad().defined()) records += nanreplay::describe_tensor(param.grad(), nullptr, {}).size();
      param.mutable_grad().reset();
    }
    if (probes) records_ = records;
    return objective.item<double>();
  }
  size_t records() const { return records_; }  // of the last run with probes

 private:
  Subject& s_;
  nanreplay::StepArithmetic arithmetic_;
  torch::Tensor h_, g_;
  std::vector<int64_t> rows_;
  std::vector<torch::Tensor> params_;
  size_t records_ = 0;
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
      ("model", "dense (llama), moe (a mixture of experts in every layer, and one MoE layer alone) or both",
       cxxopts::value<std::string>()->default_value("dense"))
      ("experts", "MoE: experts per layer", cxxopts::value<int64_t>()->default_value("8"))
      ("top-k", "MoE: experts per token", cxxopts::value<int64_t>()->default_value("2"))
      ("expert-width", "MoE: each expert's intermediate size (0: half the dense model's)",
       cxxopts::value<int64_t>()->default_value("0"))
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
      ("only", "run only the probes 'on' or 'off' replay step (of the first --model) or, with --model moe, the "
               "MoE 'layer' alone with probes on, --reps times, no ratios (to profile it)",
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
  const std::string model = args["model"].as<std::string>();
  if (model != "dense" && model != "moe" && model != "both") throw std::invalid_argument("--model takes dense, moe or both");
  c.dense = model != "moe";
  c.moe = model != "dense";
  c.experts = args["experts"].as<int64_t>();
  c.top_k = args["top-k"].as<int64_t>();
  c.expert_width = args["expert-width"].as<int64_t>();
  if (c.expert_width <= 0) c.expert_width = dense_width(c.hidden) / 2;
  c.repetitions = std::max(1, args["reps"].as<int>());
  c.threads = std::max(1, args["threads"].as<int>());
  c.work = fs::absolute(args["work"].as<std::string>());
  c.cli = args["cli"].as<std::string>();
  c.python = args["python"].as<std::string>();
  c.eager = args.count("skip-eager") == 0;
  c.memory = args.count("skip-memory") == 0 && c.dense;
  c.roll = args.count("skip-roll") == 0 && c.eager && c.dense;
  c.roll_steps = std::max<int64_t>(6, args["roll-steps"].as<int64_t>());
  if (args.count("only")) {
    c.only = args["only"].as<std::string>();
    if (c.only != "on" && c.only != "off" && (c.only != "layer" || !c.moe)) {
      throw std::invalid_argument("--only takes on, off or (with --model moe) layer");
    }
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

  // The dense model's step is timed on its 10-step bundle (the memory
  // section's too); the MoE model needs only its first step (a checkpoint
  // is 2.5 times the dense one's).
  std::vector<std::unique_ptr<Subject>> subjects;
  if (c.dense) subjects.push_back(std::make_unique<Subject>("dense", bundle_for(c, 10)));
  if (c.moe) subjects.push_back(std::make_unique<Subject>("MoE", bundle_for(c, 1, false, /*moe=*/true)));

  std::printf("model llama hidden %lld, %lld layers, %lld heads (intermediate %lld), vocab %lld; batch %lld x seq %lld; "
              "%d threads; median of %d interleaved repetitions\n",
              static_cast<long long>(c.hidden), static_cast<long long>(c.layers), static_cast<long long>(c.heads),
              static_cast<long long>(dense_width(c.hidden)), static_cast<long long>(c.vocab),
              static_cast<long long>(c.batch), static_cast<long long>(c.seq), c.threads, c.repetitions);
  for (const auto& s : subjects) {
    int64_t parameters = 0;
    for (const auto& [name, tensor] : s->checkpoint->params()) parameters += tensor.numel();
    std::printf("%s: %.1fM parameters", s->name.c_str(), double(parameters) / 1e6);
    if (const auto& moe = s->bundle.manifest().model.moe) {
      std::printf(", MLP = %lld experts of width %lld, top %lld, norm_topk_prob %d, aux %g, z %g",
                  static_cast<long long>(moe->num_experts), static_cast<long long>(moe->intermediate_size),
                  static_cast<long long>(moe->top_k), moe->norm_topk_prob ? 1 : 0, moe->router_aux_loss_coef,
                  moe->router_z_loss_coef);
    }
    std::printf("; checkpoint load (mmap, validate, fp32 in place) %.3f s, not in the step times\n", s->load_seconds);
  }

  if (c.only == "layer") {
    MoeLayer layer(*subjects.back());
    for (int r = 0; r < c.repetitions; ++r) {
      const double seconds = seconds_of([&] { layer.run(true); });
      std::printf("MoE layer alone, probes on  %.4f s\n", seconds);
    }
    return 0;
  }
  if (!c.only.empty()) {
    for (int r = 0; r < c.repetitions; ++r) {
      const double seconds = seconds_of([&] { subjects.front()->replay(c.only == "on"); });
      std::printf("%s replay step, probes %s  %.3f s\n", subjects.front()->name.c_str(), c.only.c_str(), seconds);
    }
    return 0;
  }

  // Every side, timed in one rotation; ratios of their medians and best repetitions.
  struct Side {
    std::string name;
    std::function<double()> seconds;
  };
  struct Ratio {
    std::string label;
    size_t a, b;
    const char* target;
  };
  std::vector<Side> sides;
  std::vector<Ratio> ratios;
  auto side = [&](std::string name, std::function<double()> seconds) {
    sides.push_back({std::move(name), std::move(seconds)});
    return sides.size() - 1;
  };
  for (const auto& owned : subjects) {
    Subject& s = *owned;
    const std::string& n = s.name;
    const size_t on = side(n + " replay step, probes on", [&s] {
      return seconds_of([&] {
        const nanreplay::StepResult step = s.replay(true);
        s.probe_count = step.probes.size();
        s.loss_on = step.loss;
      });
    });
    const size_t off = side(n + " replay step, probes off", [&s] {
      return seconds_of([&] { s.loss_off = s.replay(false).loss; });
    });
    ratios.push_back({n + ": probes on / probes off", on, off, "(target <= 1.10)"});
    if (!c.eager) continue;
    s.eager = std::make_unique<EagerPeer>(c, s.dir, s.files.step, false);
    s.eager_default = std::make_unique<EagerPeer>(c, s.dir, s.files.step, true);
    const size_t eager = side(n + " eager PyTorch, the replay's BLAS", [&s] {
      s.eager_reply = s.eager->step();
      return s.eager_reply.seconds;
    });
    const size_t eager_default = side(n + " eager PyTorch, as it starts", [&s] {
      s.eager_default_reply = s.eager_default->step();
      return s.eager_default_reply.seconds;
    });
    ratios.push_back({n + ": replay (probes on) / eager, as it starts", on, eager_default, "(target <= 1.0)"});
    ratios.push_back({n + ": replay (probes on) / eager, the replay's BLAS", on, eager, "(target <= 1.0)"});
    ratios.push_back({n + ": replay (probes off) / eager, the replay's BLAS", off, eager, ""});
  }

  // One MoE layer alone against Hugging Face's block.
  std::unique_ptr<MoeLayer> layer;
  std::unique_ptr<EagerPeer> eager_layer;
  double layer_on = 0, layer_off = 0;
  EagerPeer::Reply eager_layer_reply;
  if (c.moe) {
    layer = std::make_unique<MoeLayer>(*subjects.back());
    auto passes = [&layer](bool probes, double& objective) {
      return seconds_of([&] {
        for (int pass = 0; pass < MoeLayer::kPasses; ++pass) objective = layer->run(probes);
      });
    };
    const std::string per = " (" + std::to_string(MoeLayer::kPasses) + " passes)";
    const size_t on = side("MoE layer, probes on" + per, [passes, &layer_on] { return passes(true, layer_on); });
    const size_t off = side("MoE layer, probes off" + per, [passes, &layer_off] { return passes(false, layer_off); });
    ratios.push_back({"MoE layer: probes on / probes off", on, off, ""});
    if (c.eager) {
      eager_layer = std::make_unique<EagerPeer>(c, subjects.back()->dir, subjects.back()->files.step, false,
                                                std::vector<std::string>{"--moe-layer", std::to_string(MoeLayer::kPasses)});
      const size_t hf = side("MoE layer, HF Qwen3MoeSparseMoeBlock" + per, [&] {
        eager_layer_reply = eager_layer->step();
        return eager_layer_reply.seconds;
      });
      ratios.push_back({"MoE layer: replay (probes on) / HF block, the replay's BLAS", on, hf, "(target <= 1.0)"});
      ratios.push_back({"MoE layer: replay (probes off) / HF block, the replay's BLAS", off, hf, ""});
    }
  }

  // Rolling forward: the step's parameters and AdamW state, advanced by every derived step.
  Subject& dense = *subjects.front();
  std::unique_ptr<EagerPeer> eager_training;
  nanreplay::Trajectory trajectory;
  double loss_derived = 0;
  EagerPeer::Reply eager_training_reply;
  if (c.roll) {
    eager_training = std::make_unique<EagerPeer>(c, dense.dir, dense.files.step, false,
                                                 std::vector<std::string>{"--train"});
    trajectory.start(dense.bundle, dense.files);
    const size_t derived = side("derived step, probes on, clip + AdamW", [&] {
      return seconds_of([&] {
        nanreplay::ModelCheckpoint current = trajectory.checkpoint();
        nanreplay::StepRequest request;
        request.probes = nanreplay::ProbeLevel::kFull;
        nanreplay::StepResult step = nanreplay::replay_step(
            {dense.bundle.manifest(), dense.bundle.tokens(), dense.files.step, dense.state, dense.batch}, current, {},
            request);
        trajectory.advance(step, dense.state, /*scaler_skipped=*/false);
        loss_derived = step.loss;
      });
    });
    const size_t training = side("eager training step, clip + torch AdamW", [&] {
      eager_training_reply = eager_training->step();
      return eager_training_reply.seconds;
    });
    ratios.push_back({"derived step / eager training step", derived, training, "(target <= 1.0)"});
  }
  const char* spin = std::getenv("GOMP_SPINCOUNT");
  const nanreplay::BlasInUse blas = nanreplay::blas_in_use();
  std::printf("BLAS: %s (threads: %s) from %s; GOMP_SPINCOUNT=%s\n", blas.description.c_str(),
              blas.threading.c_str(), blas.path.c_str(), spin ? spin : "unset");

  for (const Side& s : sides) s.seconds();  // warm up: page in, thread pools, allocator
  std::vector<std::vector<double>> times(sides.size());
  // Each repetition in a new order (seeded): a side pays for the state the
  // side before leaves (page faults of a heap another side trimmed, cold
  // caches), and in a fixed rotation the same side would always pay most.
  std::vector<size_t> order(sides.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::mt19937 shuffler(0);
  for (int r = 0; r < c.repetitions; ++r) {
    std::shuffle(order.begin(), order.end(), shuffler);
    for (const size_t s : order) {
      // Idle threads of the side before (OpenBLAS workers yield-spin for about
      // 0.1 s, libgomp's spin) would take cores from this one: let them park.
      std::this_thread::sleep_for(std::chrono::milliseconds(400));
      times[s].push_back(sides[s].seconds());
    }
  }
  for (const auto& s : subjects) {  // the eager peers quit
    s->eager.reset();
    s->eager_default.reset();
  }
  eager_layer.reset();
  eager_training.reset();
  // Medians, and the best repetition of each side: on a shared machine
  // interference only ever adds time, so the fastest runs are the most
  // comparable when the medians of one run drift apart.
  struct Summary {
    double median, best;
  };
  std::vector<Summary> sum;
  for (const std::vector<double>& t : times) sum.push_back({median(t), *std::min_element(t.begin(), t.end())});
  std::printf("%-56s %8s %8s\n", "seconds per step", "median", "best");
  for (size_t s = 0; s < sides.size(); ++s) {
    std::printf("%-56s %8.3f %8.3f\n", sides[s].name.c_str(), sum[s].median, sum[s].best);
  }
  for (const auto& s : subjects) {
    std::printf("%s losses: probes on %.9g, probes off %.9g", s->name.c_str(), s->loss_on, s->loss_off);
    if (c.eager) std::printf(", eager %.9g and %.9g", s->eager_reply.loss, s->eager_default_reply.loss);
    std::printf("; %zu probe records\n", s->probe_count);
  }
  if (layer) {
    std::printf("MoE layer sum(out * g): probes on %.9g, probes off %.9g", layer_on, layer_off);
    if (eager_layer_reply.seconds > 0) std::printf(", HF block %.9g", eager_layer_reply.loss);
    std::printf("; %zu probe records\n", layer->records());
  }
  if (c.roll) {
    std::printf("training (last repetition): derived %.9g, eager %.9g\n", loss_derived, eager_training_reply.loss);
  }
  for (const Ratio& r : ratios) {
    std::printf("RATIO %-60s median %.3f  best %.3f  %s\n", r.label.c_str(), sum[r.a].median / sum[r.b].median,
                sum[r.a].best / sum[r.b].best, r.target);
  }

  if (c.memory) {
    const fs::path one = bundle_for(c, 1), ten = dense.dir;
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
