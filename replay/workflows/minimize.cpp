// See minimize.h. A candidate is a plan (which steps, which samples in which
// layout, how many layers); writing one copies tensors byte for byte where
// the step has a checkpoint (same dtype, same bits) and writes the replay's
// own fp32 parameters where it was derived (rolling forward), so the replay
// of the candidate starts from exactly what the original's replay held.
#include "replay/workflows/minimize.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <stdexcept>

#include <torch/torch.h>

#include "loaders/base/error.h"
#include "loaders/bundle/manifest_writer.h"
#include "loaders/base/message_text.h"
#include "loaders/formats/safetensors.h"
#include "loaders/base/sha256.h"
#include "probes/sites.h"
#include "replay/workflows/bisect.h"
#include "replay/step/bundle_structure.h"
#include "replay/workflows/replay_engine.h"
#include "replay/step/step_scan.h"
#include "replay/optim/optimizer_state_file.h"
#include "replay/step/trajectory.h"
#include "reports/results/number_text.h"

namespace nanreplay {

namespace fs = std::filesystem;

namespace {

// What one candidate keeps.
struct Plan {
  std::vector<int64_t> steps;  // ascending; the last is the failing step
  // true: every kept step reads its whole batch in the original layout
  // (ranks, micro-batches); false: samples[step], in this order, are each
  // kept step's only micro-batch on one rank (all of one size).
  bool original_layout = true;
  std::map<int64_t, std::vector<int64_t>> samples;
  int64_t num_layers = 0;
  std::string cut;  // in words, for the report
  // false: no optimizer state is written, so no update between kept steps is
  // checked (a one-batch spike candidate's update is another batch's).
  bool optimizer_state = true;
  // A spike candidate declares the spike it was cut for (incident.kind
  // "spike", incident.step): its one-batch steps keep no finite logged loss
  // to find it in.
  std::optional<int64_t> spike_step{};
};

// A sample's index as the run knew it: through the bundle's own
// original_samples / original_offsets when it has them, else its index here.
struct OriginalKey {
  bool offset = false;
  int64_t value = -1;
  bool operator==(const OriginalKey& o) const { return offset == o.offset && value == o.value; }
};

OriginalKey original_key(const Manifest& m, int64_t sample) {
  if (sample < 0) return {};
  if (const std::optional<OriginalSample> o = original_of_sample(m, sample)) return {o->is_offset, o->value};
  return {false, sample};
}

// What kept_samples_original holds: the run's token offsets where the bundle
// records those for the origin's sample, else its dataset indices.
std::string run_numbering_words(const MinimizeReport& r) {
  if (r.origin && r.origin->original_offset) return "the run's token offsets";
  return r.origin ? "the run's dataset indices" : "the run's numbering";
}

nlohmann::json number_or_string(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}

void write_file(const fs::path& path, const void* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
  out.flush();
  if (!out) throw OutputError(path.string(), "cannot write");
}

// The decoder layers a forward value at `site` depends on: those up to its
// own (nothing after layer L feeds it); none fewer than every layer for the
// final norm, logits, loss and model.mtp's blocks (after the LM loss, which
// every layer feeds): nullopt.
std::optional<int64_t> layers_feeding(const ModelConfig& model, const SiteRef& site) {
  if (is_mtp_layer(model, site.layer)) return std::nullopt;
  if (site.layer >= 0) return site.layer + 1;
  if (site.id == SiteId::kEmbed) return 1;  // a model has at least one layer
  return std::nullopt;
}

// The tensors a bisect report names rewritten outside the optimizer into the
// checkpoint of `step` (SYSTEM_UPDATE_MISMATCH errors): evidence a verdict rests on.
std::vector<std::string> rewritten_into(const std::vector<Finding>& findings, int64_t step) {
  std::vector<std::string> names;
  for (const Finding& f : findings) {
    if (f.code == FindingCode::kSystemUpdateMismatch && f.severity == Severity::kError &&
        f.evidence.integer(EvidenceKey::kStep) == step) {
      names.push_back(f.evidence.text(EvidenceKey::kParam).value_or(""));
    }
  }
  return names;
}

class Minimizer {
 public:
  Minimizer(const Bundle& bundle, const BisectReport& bisected, const MinimizeOptions& options)
      : bundle_(bundle), m_(bundle.manifest()), bisected_(bisected), options_(options) {}

  std::vector<Plan> plans() const {
    const FirstNonfinite& o = *bisected_.origin;
    const int64_t layers = m_.model.num_layers;
    std::vector<Plan> plans;
    const bool previous_listed = bundle_.find_step_files(o.step - 1) != nullptr;
    Plan whole{{o.step}, true, {}, layers, "step " + std::to_string(o.step) + " only, its whole batch, every layer"};
    Plan with_previous{{o.step - 1, o.step}, true, {}, layers,
                       "steps " + std::to_string(o.step - 1) + " and " + std::to_string(o.step) +
                           ", whole batches, every layer"};
    if (!o.contaminated_params.empty() || !rewritten_into(bisected_.findings, o.step).empty()) {
      // The values came in with the checkpoint (non-finite, or rewritten
      // outside the optimizer): the update that made it is the evidence, and
      // it needs the step before with its whole batch.
      if (previous_listed) plans.push_back(with_previous);
      plans.push_back(whole);
      return plans;
    }
    const std::vector<int64_t> reduced = reduced_samples();
    if (!reduced.empty()) {
      const std::string samples_text = "step " + std::to_string(o.step) + " only, samples {" + comma_list(reduced) +
                                       "} as one micro-batch of one rank";
      if (const std::optional<int64_t> cut = cut_layers(); cut && *cut < layers) {
        plans.push_back({{o.step}, false, {{o.step, reduced}}, *cut,
                         samples_text + ", layers 0.." + std::to_string(*cut - 1) + " of " +
                             std::to_string(layers)});
      }
      plans.push_back({{o.step}, false, {{o.step, reduced}}, layers, samples_text + ", every layer"});
      const std::vector<int64_t>& pass = bisected_.samples.candidates;
      if (!pass.empty() && pass != reduced) {
        plans.push_back({{o.step}, false, {{o.step, pass}}, layers,
                         "step " + std::to_string(o.step) + " only, the origin's whole micro-batch {" + comma_list(pass) +
                             "}, every layer"});
      }
    }
    plans.push_back(whole);
    if (previous_listed) plans.push_back(with_previous);
    return plans;
  }

  // A flipped bit in the checkpoint of step T is judged by the update from
  // T - 1: both steps, T - 1 with its optimizer state. The check recomputes
  // T - 1's gradient, so fewer samples give another update unless the
  // flipped element's gradient does not depend on them (an embedding row no
  // sample reads): one sample, then one micro-batch, are tried before the
  // whole batches. Every layer: the gradient comes down through all of them.
  std::vector<Plan> flip_plans(const FlippedBit& flip) const {
    const int64_t s = flip.step - 1;
    const std::vector<int64_t> steps{s, flip.step};
    const int64_t layers = m_.model.num_layers;
    const std::string both = "steps " + std::to_string(s) + " and " + std::to_string(flip.step);
    const auto first_of = [&](int64_t step, size_t n) {
      const std::vector<int64_t> rank0 = batch_of_step(bundle_, step).samples.at(0);
      const auto count = static_cast<std::ptrdiff_t>(std::min(n, rank0.size()));
      return std::vector<int64_t>(rank0.begin(), rank0.begin() + count);
    };
    std::vector<Plan> plans;
    const size_t micro = static_cast<size_t>(m_.data.micro_batch_size);
    const bool one_pass = m_.data.world_size == 1 && m_.data.grad_accum_steps == 1;
    if (micro > 1 || !one_pass) {
      plans.push_back({steps, false, {{s, first_of(s, 1)}, {flip.step, first_of(flip.step, 1)}}, layers,
                       both + ", the first sample of each as one micro-batch of one rank"});
    }
    if (micro > 1 && !one_pass) {
      plans.push_back({steps, false, {{s, first_of(s, micro)}, {flip.step, first_of(flip.step, micro)}}, layers,
                       both + ", the first micro-batch of rank 0 of each"});
    }
    plans.push_back({steps, true, {}, layers, both + ", whole batches, every layer"});
    return plans;
  }

  // A spike origin at step T rests on the trajectory of its site over the
  // healthy steps before T (docs/spikes.md): the `min_history + 1` listed
  // steps before T are the fewest it can be judged against. Smallest first:
  // those steps and T each as one micro-batch of one rank (T with the
  // origin's sample, which carries the spike, each step before it with its
  // first sample), with the model cut after the origin's layer, then every
  // layer; then their whole batches; then every step up to T. Steps after T
  // never count. With weights rewritten into T's checkpoint the update is
  // evidence too, and it needs the whole batch before it.
  std::vector<Plan> spike_plans(const SpikeOrigin& o) const {
    const int64_t T = o.step, layers = m_.model.num_layers;
    const SpikeThresholds t = m_.incident && m_.incident->spike ? *m_.incident->spike : SpikeThresholds{};
    std::vector<int64_t> upto;
    for (const StepFiles& f : bundle_.steps()) {
      if (f.step <= T) upto.push_back(f.step);
    }
    const size_t history = std::min(upto.size(), static_cast<size_t>(t.min_history) + 2);
    const std::vector<int64_t> steps(upto.end() - static_cast<std::ptrdiff_t>(history), upto.end());
    const std::string span = "steps " + std::to_string(steps.front()) + ".." + std::to_string(T);
    std::vector<Plan> plans;
    if (o.sample >= 0 && rewritten_into(bisected_.findings, T).empty()) {
      std::map<int64_t, std::vector<int64_t>> one;
      for (int64_t step : steps) one[step] = {step == T ? o.sample : batch_of_step(bundle_, step).samples.at(0).front()};
      const std::string text = span + ", each as one sample in one micro-batch of one rank (step " +
                               std::to_string(T) + ": sample " + std::to_string(o.sample) + ", the spike's)";
      const int64_t cut = layers_feeding(m_.model, o.site).value_or(layers);
      if (cut < layers) {
        plans.push_back({steps, false, one, cut, text + ", layers 0.." + std::to_string(cut - 1) + " of " +
                                                     std::to_string(layers), false, T});
      }
      plans.push_back({steps, false, one, layers, text + ", every layer", false, T});
    }
    plans.push_back({steps, true, {}, layers, span + ", whole batches, every layer", true, T});
    if (upto.size() > steps.size()) {
      plans.push_back({upto, true, {}, layers,
                       "steps " + std::to_string(upto.front()) + ".." + std::to_string(T) +
                           " (every step up to the spike), whole batches, every layer", true, T});
    }
    return plans;
  }

  // Writes `plan` as a bundle in `dir` (created).
  void write(const Plan& plan, const fs::path& dir) {
    fs::create_directories(dir / "data");
    std::vector<std::vector<std::vector<int64_t>>> batches;  // per kept step, per rank
    for (int64_t step : plan.steps) {
      batches.push_back(plan.original_layout ? batch_of_step(bundle_, step).samples
                                             : std::vector<std::vector<int64_t>>{plan.samples.at(step)});
    }
    const std::map<int64_t, int64_t> index = write_tokens(batches, dir);

    Manifest m = m_;
    m.model.num_layers = plan.num_layers;
    // Multi-token prediction reads the last layer's output: a cut model leaves its layers out.
    if (plan.num_layers != m_.model.num_layers) m.model.mtp.reset();
    // The per-layer lists follow the layers kept (Gemma 3's and OLMo 3's layer_types, Llama 4's no_rope_layers).
    const auto kept = static_cast<size_t>(plan.num_layers);
    if (!m.model.layer_types.empty()) m.model.layer_types.resize(kept);
    if (!m.model.no_rope_layers.empty()) m.model.no_rope_layers.resize(kept);
    if (m.model.moe && !m.model.moe->layers.empty()) {  // Llama 4's MoE layers: those kept; none left, a dense model
      std::vector<int>& moe_layers = m.model.moe->layers;
      // A kept model.mtp keeps its blocks' layers (past the decoder's) with their experts.
      const size_t blocks = kept + static_cast<size_t>(m.model.mtp ? m.model.mtp->num_layers : 0);
      moe_layers.erase(std::remove_if(moe_layers.begin(), moe_layers.end(),
                                      [&](int layer) { return static_cast<size_t>(layer) >= blocks; }),
                       moe_layers.end());
      if (moe_layers.empty()) m.model.moe.reset();
    }
    m.data.shards = {shard_};
    m.data.sampler = SamplerSpec{};
    m.data.sampler.kind = SamplerSpec::Kind::kExplicit;
    if (!plan.original_layout) {
      m.data.world_size = 1;
      m.data.grad_accum_steps = 1;
      m.data.micro_batch_size = static_cast<int64_t>(plan.samples.at(plan.steps.back()).size());
    }
    if (plan.spike_step) {
      IncidentInfo incident = m_.incident.value_or(IncidentInfo{});
      incident.kind = IncidentKind::kSpike;
      incident.step = plan.spike_step;
      m.incident = incident;
    }
    m.steps.clear();
    for (size_t i = 0; i < plan.steps.size(); ++i) m.steps.push_back(step_entry_for(plan.steps[i], batches[i], index));
    m.minimized = MinimizedFrom{fs::absolute(bundle_.root()).lexically_normal().string(), manifest_sha256()};
    nlohmann::json manifest = manifest_json(m);
    manifest["minimized"]["steps"] = plan.steps;
    manifest["minimized"]["num_layers"] = m_.model.num_layers;
    manifest["minimized"]["cut"] = plan.cut;
    const std::string text = manifest.dump(2) + "\n";
    write_file(dir / "manifest.json", text.data(), text.size());

    for (size_t i = 0; i < plan.steps.size(); ++i) {
      const bool next_kept = i + 1 < plan.steps.size();
      write_step(plan, plan.steps[i], next_kept, dir / "steps" / std::to_string(plan.steps[i]));
    }
  }

  // Replays the candidate in `dir`; the origin it names, when any, and the
  // tensors it names rewritten into the origin's checkpoint.
  std::optional<FirstNonfinite> replay(const fs::path& dir, std::optional<OriginalKey>& key,
                                       std::vector<std::string>* rewritten = nullptr,
                                       std::optional<SpikeReport>* spike = nullptr) const {
    const Bundle candidate(dir);
    validate_bundle_structure(candidate);
    BisectOptions options;
    options.minimize_samples = false;
    options.devices = options_.devices;
    options.native_low_precision = options_.native_low_precision;
    options.should_stop = options_.should_stop;
    options.tool_version = options_.tool_version;
    const BisectReport report = bisect_bundle(candidate, options);
    if (report.origin) key = original_key(candidate.manifest(), report.origin->sample);
    if (report.origin && rewritten != nullptr) *rewritten = rewritten_into(report.findings, report.origin->step);
    if (spike != nullptr) {
      *spike = report.spike;
      if (report.spike && report.spike->origin) {
        key = original_key(candidate.manifest(), report.spike->origin->sample);
        if (rewritten != nullptr) *rewritten = rewritten_into(report.findings, report.spike->origin->step);
      }
    }
    return report.origin;
  }

  // `run`'s findings on `bundle` without probes: every check that needs no
  // probe record, the update check (flipped bits) included.
  ReplayReport checked(const Bundle& bundle) const {
    ReplayOptions options;
    options.probes = false;
    options.check_determinism = false;
    options.devices = options_.devices;
    options.native_low_precision = options_.native_low_precision;
    options.should_stop = options_.should_stop;
    options.tool_version = options_.tool_version;
    if (options_.on_progress) {
      options.on_progress = [&](const ReplayProgress& p) {
        options_.on_progress("update check: replay step " + std::to_string(p.step));
      };
    }
    return replay_bundle(bundle, options);
  }

  // Empty when the origins agree; otherwise the first field that differs.
  std::string difference(const FirstNonfinite& a, const FirstNonfinite& b, const OriginalKey& b_key) const {
    if (a.step != b.step) return "step " + std::to_string(b.step) + " instead of " + std::to_string(a.step);
    if (a.phase != b.phase || !(a.site == b.site) || a.param != b.param) return "site " + b.name() + " instead of " + a.name();
    if (a.layer != b.layer || a.head != b.head || a.expert != b.expert) return "another layer, head or expert";
    if (a.kind != b.kind) return std::string("kind ") + nonfinite_kind_name(b.kind);
    if (a.position != b.position) return "position " + std::to_string(b.position) + " instead of " + std::to_string(a.position);
    if (!(original_key(m_, a.sample) == b_key)) {
      return std::string("another sample (the run's ") + (b_key.offset ? "token offset " : "sample ") +
             std::to_string(b_key.value) + ")";
    }
    return "";
  }

  // Empty when the spike origins agree (a replay of other batches scores
  // them differently: the score is not compared); otherwise what differs.
  std::string spike_difference(const SpikeOrigin& a, const SpikeOrigin& b, const OriginalKey& b_key) const {
    if (a.step != b.step) return "step " + std::to_string(b.step) + " instead of " + std::to_string(a.step);
    if (a.phase != b.phase || !(a.site == b.site)) return "site " + b.name() + " instead of " + a.name();
    if (a.layer != b.layer || a.head != b.head || a.expert != b.expert) return "another layer, head or expert";
    if (a.position != b.position) return "position " + std::to_string(b.position) + " instead of " + std::to_string(a.position);
    if (a.sample >= 0 && !(original_key(m_, a.sample) == b_key)) {
      return std::string("another sample (the run's ") + (b_key.offset ? "token offset " : "sample ") +
             std::to_string(b_key.value) + ")";
    }
    return "";
  }

  std::vector<int64_t> originals_of(const std::vector<int64_t>& samples) const {
    std::vector<int64_t> out;
    for (int64_t s : samples) out.push_back(original_key(m_, s).value);
    return out;
  }

 private:
  // The failing step's samples a one-batch candidate keeps: ddmin's minimal
  // set; the origin's own sample when the failure is not the data's (any
  // sample fails, and this one is where the origin names it); none when the
  // origin is not a sample's (a parameter gradient sums every pass).
  std::vector<int64_t> reduced_samples() const {
    const FirstNonfinite& o = *bisected_.origin;
    if (o.phase == Phase::kGrad || o.sample < 0) return {};
    const BisectSampleStage& stage = bisected_.samples;
    if (stage.ran && stage.data_dependent.value_or(false) && !stage.minimal.empty()) return stage.minimal;
    return {o.sample};
  }

  // Layers a forward origin needs (layers_feeding). A backward origin needs
  // every layer: the gradient comes down through them.
  std::optional<int64_t> cut_layers() const {
    const FirstNonfinite& o = *bisected_.origin;
    if (o.phase != Phase::kForward) return std::nullopt;
    return layers_feeding(m_.model, o.site);
  }

  // The one shard: each kept sample's seq_len + 1 tokens, consecutive
  // samples sharing a token where the original stream allows it, otherwise
  // a gap of the original's following tokens (no sample reads them).
  std::map<int64_t, int64_t> write_tokens(const std::vector<std::vector<std::vector<int64_t>>>& batches,
                                          const fs::path& dir) {
    std::set<int64_t> unique;
    for (const auto& ranks : batches) {
      for (const auto& rows : ranks) unique.insert(rows.begin(), rows.end());
    }
    const int64_t S = m_.data.seq_len;
    const TokenStream& tokens = bundle_.tokens();
    std::vector<int64_t> stream;
    std::map<int64_t, int64_t> index;
    int64_t previous = -1;
    for (int64_t sample : unique) {
      const std::vector<int64_t> window = tokens.sample_tokens(sample, S);
      int64_t at = 0;
      if (previous >= 0) {
        const int64_t prev_at = index.at(previous);
        if (stream.back() == window.front()) {
          at = prev_at + 1;
        } else {
          at = prev_at + 2;
          const int64_t from = previous * S + S + 1;
          for (int64_t k = 0; k < S - 1; ++k) {
            const int64_t g = from + k;
            stream.push_back(g < tokens.total_tokens() ? tokens.token(g) : 0);
          }
          stream.push_back(window.front());
        }
      } else {
        stream.push_back(window.front());
      }
      stream.insert(stream.end(), window.begin() + 1, window.end());
      index[sample] = at;
      previous = sample;
    }
    bool wide = false;
    for (size_t i = 0; i < tokens.num_shards(); ++i) wide = wide || tokens.spec(i).dtype == TokenDtype::kUint32;
    std::vector<uint8_t> bytes(stream.size() * (wide ? 4 : 2));
    for (size_t i = 0; i < stream.size(); ++i) {
      if (wide) {
        const uint32_t v = static_cast<uint32_t>(stream[i]);
        std::memcpy(bytes.data() + 4 * i, &v, 4);
      } else {
        const uint16_t v = static_cast<uint16_t>(stream[i]);
        std::memcpy(bytes.data() + 2 * i, &v, 2);
      }
    }
    write_file(dir / "data" / "samples.bin", bytes.data(), bytes.size());
    shard_ = ShardSpec{"data/samples.bin", wide ? TokenDtype::kUint32 : TokenDtype::kUint16,
                       static_cast<int64_t>(stream.size()), sha256_hex(bytes.data(), bytes.size())};
    return index;
  }

  // The kept step's entry: samples re-indexed, and what they were in the run.
  StepEntry step_entry_for(int64_t step, const std::vector<std::vector<int64_t>>& ranks,
                           const std::map<int64_t, int64_t>& index) const {
    StepEntry e;
    e.step = step;
    e.dir = "steps/" + std::to_string(step);
    std::vector<std::vector<int64_t>> samples, originals;
    bool offsets = false, indices = false;
    for (const auto& rows : ranks) {
      samples.emplace_back();
      originals.emplace_back();
      for (int64_t s : rows) {
        samples.back().push_back(index.at(s));
        const OriginalKey key = original_key(m_, s);
        originals.back().push_back(key.value);
        (key.offset ? offsets : indices) = true;
      }
    }
    e.samples = samples;
    // A step mixing both kinds (never written by capture) keeps this bundle's own indices.
    if (offsets && !indices) {
      e.original_offsets = originals;
    } else if (offsets) {
      std::vector<std::vector<int64_t>> own;
      for (const auto& rows : ranks) own.push_back(rows);
      e.original_samples = own;
    } else {
      e.original_samples = originals;
    }
    return e;
  }

  std::string manifest_sha256() const {
    const std::string text = read_text_file(bundle_.root() / "manifest.json", "manifest.json");
    return sha256_hex(reinterpret_cast<const uint8_t*>(text.data()), text.size());
  }

  // A step as the original replay starts it; derived ones rolled forward once and kept.
  const RolledStart& rolled(int64_t step) {
    auto it = rolled_.find(step);
    if (it == rolled_.end()) {
      if (options_.on_progress) options_.on_progress("roll forward to step " + std::to_string(step));
      it = rolled_.emplace(step, std::make_unique<RolledStart>(roll_to(bundle_, step))).first;
    }
    return *it->second;
  }

  void write_step(const Plan& plan, int64_t step, bool next_kept, const fs::path& dir) {
    fs::create_directories(dir);
    const StepFiles& files = bundle_.step_files(step);
    ModelConfig cut = m_.model;
    cut.num_layers = plan.num_layers;
    if (plan.num_layers != m_.model.num_layers) cut.mtp.reset();  // as the cut manifest says
    std::vector<std::string> keep;
    for (const ParamSpec& p : expected_parameters(cut)) keep.push_back(p.name);

    StepState state = bundle_.load_state(files);
    const RolledStart* start = nullptr;
    if (bundle_.rolls_forward()) {
      start = &rolled(step);
      state = start->state;
    }
    if (files.has_model) {
      copy_tensors(SafetensorsFile::open(files.model.string(), files.label("model.safetensors")), keep,
                   dir / "model.safetensors");
    } else {
      write_params(start->checkpoint, keep, dir / "model.safetensors");
    }
    if (next_kept && plan.optimizer_state) {  // the update to the next kept step is checked: its optimizer state goes too
      if (files.has_model && bundle_.has_optimizer(files)) {
        // Every kept parameter's state, whatever its optimizer names it (docs/optimizers.md).
        const SafetensorsFile optimizer = SafetensorsFile::open(files.optimizer.string(), files.label("optimizer.safetensors"));
        std::vector<std::string> moments;
        if (optimizer.find("step") != nullptr) moments.push_back("step");
        for (const std::string& k : keep) {
          for (const TensorInfo& t : optimizer.tensors()) {
            if (t.name.rfind(k + ".", 0) == 0) moments.push_back(t.name);
          }
        }
        copy_tensors(optimizer, moments, dir / "optimizer.safetensors");
      } else if (start && start->moments) {
        write_moments(start->checkpoint.order(), *start->moments, dir / "optimizer.safetensors");
      }
    }
    const std::string text = state_json(plan, state).dump(2) + "\n";
    write_file(dir / "state.json", text.data(), text.size());
  }

  // state.json of a kept step. A one-batch candidate is another batch than
  // the job's: its finite logged values no longer describe it and are
  // dropped; a non-finite one is the symptom and stays. fp16: the one
  // micro-batch's backward starts from loss * loss_scale, where the job's
  // started from loss * loss_scale / grad_accum_steps; the scale is divided
  // by that so the backward values are the same.
  nlohmann::json state_json(const Plan& plan, const StepState& s) const {
    nlohmann::json j = {{"step", s.step}};
    if (s.lr) j["lr"] = *s.lr;
    if (!s.lr_by_group.empty()) j["lr"] = s.lr_by_group;  // per optimizer group, as the run gave it
    double scale = s.loss_scale;
    if (!plan.original_layout && m_.precision.compute == Compute::kFp16) scale /= static_cast<double>(m_.data.grad_accum_steps);
    j["loss_scale"] = number_or_string(scale);
    if (s.skipped) j["skipped"] = *s.skipped;
    nlohmann::json fp8 = nlohmann::json::object();
    for (const auto& [module, scales] : s.fp8_scales) {
      nlohmann::json entry = nlohmann::json::object();
      if (scales.input) entry["input"] = number_or_string(*scales.input);
      if (scales.weight) entry["weight"] = number_or_string(*scales.weight);
      if (scales.grad_output) entry["grad_output"] = number_or_string(*scales.grad_output);
      fp8[module] = entry;
    }
    if (!fp8.empty()) j["fp8_scales"] = fp8;
    nlohmann::json bias = nlohmann::json::object();  // DeepSeek-V3's router bias of the layers kept
    std::map<std::string, std::vector<double>> biases = s.router_score_bias;
    // A rolled-forward step without a logged bias replayed with the derived one: the kept step logs it.
    for (const auto& [layer, numbers] : s.derived_router_score_bias) biases.emplace(router_score_bias_key(layer), numbers);
    // model.mtp's blocks (kept with every layer) may hold experts too: their biases stay with them.
    const int64_t mtp_blocks = plan.num_layers == m_.model.num_layers && m_.model.mtp ? m_.model.mtp->num_layers : 0;
    for (const auto& [name, numbers] : biases) {
      if (layer_of_parameter(name) >= plan.num_layers + mtp_blocks) continue;
      for (const double v : numbers) bias[name].push_back(number_or_string(v));
    }
    if (!bias.empty()) j["router_score_bias"] = bias;
    nlohmann::json logged = nlohmann::json::object();
    auto keep = [&](const char* key, const std::optional<double>& v) {
      if (v && (plan.original_layout || !std::isfinite(*v))) logged[key] = number_or_string(*v);
    };
    keep("loss", s.logged.loss);
    keep("grad_norm", s.logged.grad_norm);
    if (plan.original_layout) {
      nlohmann::json losses = nlohmann::json::array(), norms = nlohmann::json::array();
      for (double v : s.logged.rank_losses) losses.push_back(number_or_string(v));
      for (double v : s.logged.rank_grad_norms) norms.push_back(number_or_string(v));
      if (!losses.empty()) logged["rank_losses"] = losses;
      if (!norms.empty()) logged["rank_grad_norms"] = norms;
    }
    j["logged"] = logged;
    return j;
  }

  // The named tensors of `file`, bytes and dtype as stored.
  static void copy_tensors(const SafetensorsFile& file, const std::vector<std::string>& names, const fs::path& path) {
    SafetensorsWriter writer;
    for (const std::string& name : names) {
      const TensorInfo& t = file.at(name);
      writer.add(name, t.dtype, t.shape, t.data, t.nbytes());
    }
    writer.write(path.string());
  }

  static void add_f32(SafetensorsWriter& writer, const std::string& name, const torch::Tensor& tensor) {
    const torch::Tensor t = tensor.detach().to(torch::kCPU, torch::kFloat32).contiguous();
    writer.add(name, DType::kF32, t.sizes().vec(), t.data_ptr(), static_cast<size_t>(t.numel()) * sizeof(float));
  }

  static void write_params(const ModelCheckpoint& checkpoint, const std::vector<std::string>& names,
                           const fs::path& path) {
    SafetensorsWriter writer;
    for (const std::string& name : names) add_f32(writer, name, checkpoint.params().at(name));
    writer.write(path.string());
  }

  // Each parameter's state under its own names and its own `<param>.step`
  // (the bundle format's per-parameter form), plus the scalar `step` of the
  // first, which every reader of the AdamW-only format expects.
  static void write_moments(const std::vector<std::string>& order, const OptimizerMoments& moments, const fs::path& path) {
    SafetensorsWriter writer;
    for (size_t i = 0; i < order.size(); ++i) add_param_state(writer, order[i], moments.params.at(i));
    if (!moments.params.empty()) writer.add("step", DType::kI64, {}, &moments.params.front().step, sizeof(int64_t));
    writer.write(path.string());
  }

  const Bundle& bundle_;
  const Manifest& m_;
  const BisectReport& bisected_;
  const MinimizeOptions& options_;
  ShardSpec shard_;
  std::map<int64_t, std::unique_ptr<RolledStart>> rolled_;
};

BundleSize size_of(const Bundle& bundle) {
  const Manifest& m = bundle.manifest();
  BundleSize s;
  s.bytes = directory_bytes(bundle.root());
  s.steps = static_cast<int64_t>(bundle.steps().size());
  std::set<int64_t> samples;
  for (const StepFiles& f : bundle.steps()) {
    s.checkpoints += f.has_model ? 1 : 0;
    for (const auto& rows : batch_of_step(bundle, f.step).samples) samples.insert(rows.begin(), rows.end());
  }
  s.samples = static_cast<int64_t>(samples.size());
  s.tokens = bundle.tokens().total_tokens();
  s.layers = m.model.num_layers;
  s.world_size = m.data.world_size;
  s.grad_accum_steps = m.data.grad_accum_steps;
  s.micro_batch_size = m.data.micro_batch_size;
  return s;
}

// What went, from the two sizes.
void explain_removed(MinimizeReport& r) {
  const BundleSize& b = r.before;
  const BundleSize& a = r.after;
  r.removed.push_back(std::to_string(b.steps - a.steps) + " of " + std::to_string(b.steps) + " steps");
  if (b.samples > a.samples) {
    r.removed.push_back(std::to_string(b.samples - a.samples) + " of " + std::to_string(b.samples) + " samples");
  }
  if (b.layers > a.layers) {
    r.removed.push_back("layers " + std::to_string(a.layers) + ".." + std::to_string(b.layers - 1));
  }
  if (b.world_size > a.world_size) {
    r.removed.push_back("ranks: " + std::to_string(b.world_size) + " -> " + std::to_string(a.world_size));
  }
  if (b.grad_accum_steps > a.grad_accum_steps) {
    r.removed.push_back("micro-batches per rank: " + std::to_string(b.grad_accum_steps) + " -> " +
                        std::to_string(a.grad_accum_steps));
  }
  r.removed.push_back(std::to_string(b.tokens - a.tokens) + " of " + std::to_string(b.tokens) + " tokens");
}

// What MIN holds and why, for an origin.
void explain(MinimizeReport& r, const Plan& plan, const FirstNonfinite& o) {
  const BundleSize& b = r.before;
  const BundleSize& a = r.after;
  r.kept.push_back(plan.steps.size() == 1
                       ? "step " + std::to_string(o.step) + ": the step that fails, with its parameters as the replay "
                                                            "held them (checkpoint, or derived and written as one)"
                   : !o.contaminated_params.empty()
                       ? "steps " + std::to_string(plan.steps.front()) + " and " + std::to_string(o.step) +
                             ": the checkpoint of " + std::to_string(o.step) +
                             " already holds non-finite values, and the update from the step before shows where "
                             "they came from (both checkpoints, the optimizer state of the first)"
                       : "steps " + std::to_string(plan.steps.front()) + " and " + std::to_string(o.step) +
                             ": the update from the step before into the checkpoint of " + std::to_string(o.step) +
                             " is the evidence: the update check names the weights the optimizer did not compute "
                             "(both checkpoints, the optimizer state of the first)");
  if (plan.original_layout) {
    r.kept.push_back("every sample of the kept steps, ranks and micro-batches as the run had them");
  } else {
    r.kept.push_back("samples {" + comma_list(r.kept_samples_original) +
                     "} (" + run_numbering_words(r) + "): the smallest set that still fails (ddmin), as one micro-batch of one "
                     "rank; only the token windows they read");
  }
  if (a.layers < b.layers) {
    r.kept.push_back("layers 0.." + std::to_string(a.layers - 1) + ": the origin is in the forward pass at layer " +
                     std::to_string(a.layers - 1) +
                     ", which nothing after it feeds; the embeddings, final norm and output head stay because the "
                     "loss (and so the backward) needs them");
  } else {
    std::string why;
    if (o.phase != Phase::kForward) {
      why = "the origin is in the " + std::string(phase_name(o.phase)) +
            " pass, which comes down through every layer above it";
    } else if (o.site.layer >= b.layers) {  // past the decoder: a model.mtp block
      why = "the origin is in a multi-token prediction block (model.mtp), which reads every layer";
    } else if (o.site.layer + 1 == b.layers) {
      why = "the origin is in the last layer";
    } else if (o.site.layer < 0 && o.site.id != SiteId::kEmbed) {
      why = "the origin is after the last layer (final norm, logits or loss)";
    } else {
      why = "cutting after the origin's layer changed the origin (see the rejected attempt), so no layer is cut";
    }
    r.kept.push_back("every layer: " + why);
  }
  explain_removed(r);
}

// What MIN holds and why, for a flipped bit.
void explain_flip(MinimizeReport& r, const Plan& plan, const FlippedBit& flip, size_t other_flips) {
  const std::string s = std::to_string(flip.step - 1), t = std::to_string(flip.step);
  r.kept.push_back("steps " + s + " and " + t + ": the checkpoint of " + t +
                   " holds the flipped value; the update check replays step " + s +
                   " and applies AdamW to its checkpoint and optimizer state, which predicts what " + t +
                   " should hold");
  r.kept.push_back("the one tensor that shows the flip: " + flip.param + " element " + bracketed_list(flip.index) +
                   " in steps/" + t + "/model.safetensors, bit " + std::to_string(flip.bit) + " (" +
                   format_number(flip.before) + " became " + format_number(flip.after) + "; AdamW from step " + s +
                   " predicts " + format_number(flip.expected) + ")");
  r.kept.push_back("both checkpoints whole, every parameter, and step " + s +
                   "'s optimizer state whole: a bundle's checkpoint holds every parameter of the model, and the "
                   "update check recomputes step " + s + "'s gradient (clipped by the norm of all of them), which "
                   "every parameter and layer feeds");
  if (plan.original_layout) {
    r.kept.push_back("every sample of both steps, ranks and micro-batches as the run had them: the update check "
                     "recomputes the gradient of step " + s + "'s whole batch, and a smaller batch gives another "
                     "update (see the rejected attempts)");
  } else {
    r.kept.push_back("samples {" + comma_list(r.kept_samples_original) + "} of step " + s +
                     " (" + run_numbering_words(r) + "), as one micro-batch of one rank: the update check still names the same "
                     "flip with only these; only the token windows they read");
  }
  explain_removed(r);
  if (other_flips > 0) {
    r.removed.push_back(std::to_string(other_flips) + " other flipped bit(s) outside these two steps (minimize "
                        "keeps the first; run on BUNDLE names them all)");
  }
}

using K = EvidenceKey;

// The flipped bits `run`'s update check names, in its order (step by step).
std::vector<FlippedBit> flips_in(const std::vector<Finding>& findings) {
  std::vector<FlippedBit> flips;
  for (const Finding& f : findings) {
    if (f.code != FindingCode::kSystemBitFlip || f.severity != Severity::kError) continue;
    FlippedBit b;
    b.step = f.evidence.integer(K::kStep).value_or(-1);
    b.param = f.evidence.text(K::kParam).value_or("");
    if (const std::vector<int64_t>* index = f.evidence.integers(K::kIndex)) b.index = *index;
    b.bit = f.evidence.integer(K::kBit).value_or(-1);
    b.before = f.evidence.number(K::kBefore).value_or(0.0);
    b.after = f.evidence.number(K::kAfter).value_or(0.0);
    b.expected = f.evidence.number(K::kExpected).value_or(0.0);
    b.message = f.message;
    flips.push_back(b);
  }
  return flips;
}

bool same_flip(const FlippedBit& a, const FlippedBit& b) {
  return a.step == b.step && a.param == b.param && a.index == b.index && a.bit == b.bit;
}

// A candidate's outcome against the original flip.
MinimizeAttempt judge_flip(const FlippedBit& flip, const ReplayReport& report, std::optional<FlippedBit>& found) {
  const std::vector<FlippedBit> flips = flips_in(report.findings);
  for (const FlippedBit& f : flips) {
    if (same_flip(flip, f)) {
      found = f;
      return {"", true, "same flipped bit"};
    }
  }
  if (!flips.empty()) return {"", false, "another flipped bit: " + flips.front().message};
  int64_t mismatched = 0;
  for (const Finding& f : report.findings) mismatched += f.code == FindingCode::kSystemUpdateMismatch ? 1 : 0;
  if (mismatched > 0) {
    return {"", false, "no flipped bit: the update no longer follows from this batch (SYSTEM_UPDATE_MISMATCH on " +
                           std::to_string(mismatched) + " parameter(s))"};
  }
  return {"", false, "no flipped bit"};
}

// Writes each plan in turn, smallest first, and keeps the first `judge`
// accepts; the others are removed and recorded as rejected.
std::optional<Plan> first_reproducing(Minimizer& minimizer, const std::vector<Plan>& plans,
                                      const MinimizeOptions& options, MinimizeOutcome& outcome,
                                      const std::function<MinimizeAttempt(const fs::path&)>& judge) {
  const fs::path workspace = options.workspace();
  int n = 0;
  for (const Plan& plan : plans) {
    if (options.on_progress) options.on_progress("candidate: " + plan.cut);
    const fs::path dir = workspace / ("candidate-" + std::to_string(n++));
    minimizer.write(plan, dir);
    MinimizeAttempt attempt = judge(dir);
    attempt.cut = plan.cut;
    outcome.report.attempts.push_back(attempt);
    if (attempt.reproduced) {
      outcome.accepted = dir;
      outcome.report.after = size_of(Bundle(dir));
      return plan;
    }
    fs::remove_all(dir);
  }
  return std::nullopt;
}

// No origin: a flipped bit `run`'s update check names, else nothing (and why).
void minimize_flip(const Bundle& bundle, const BisectReport& bisected, Minimizer& minimizer,
                   const MinimizeOptions& options, MinimizeOutcome& outcome) {
  MinimizeReport& r = outcome.report;
  const ReplayReport checked = minimizer.checked(bundle);
  const std::vector<FlippedBit> flips = flips_in(checked.findings);
  if (flips.empty()) {
    // The probe-less check cannot see what needs probes (SYSTEM_SITE_MISMATCH):
    // bisect's full probe pass on a spike or logged site statistics did.
    std::set<std::string> codes;
    for (const std::vector<Finding>* found : {&checked.findings, &bisected.findings}) {
      for (const Finding& f : *found) {
        if (f.severity == Severity::kError) codes.insert(f.name());
      }
    }
    r.not_minimized.assign(codes.begin(), codes.end());
    r.reason = codes.empty()
                   ? "no step holds a non-finite value, the update check names no flipped bit, and no finding is an "
                     "error"
                   : "no step holds a non-finite value and the update check names no flipped bit; minimize has no "
                     "cut for the other error finding(s), which run names";
    if (checked.spike && codes.empty()) {
      r.reason = "a spike incident: its origin rests on every step before it, replayed with full probes, so "
                 "minimize has no cut for it; run and bisect name it";
    }
    return;
  }
  r.finding = "bit_flip";
  r.flip = flips.front();
  const std::optional<Plan> plan =
      first_reproducing(minimizer, minimizer.flip_plans(*r.flip), options, outcome, [&](const fs::path& dir) {
        const Bundle candidate(dir);
        validate_bundle_structure(candidate);
        return judge_flip(*r.flip, minimizer.checked(candidate), r.flip_after);
      });
  if (!plan) {
    throw std::runtime_error("minimize: no candidate shows the flipped bit, both whole steps included; "
                             "nothing was written");
  }
  if (!plan->original_layout) r.kept_samples_original = minimizer.originals_of(plan->samples.at(r.flip->step - 1));
  const size_t others = static_cast<size_t>(std::count_if(flips.begin(), flips.end(), [&](const FlippedBit& f) {
    return f.step != r.flip->step;
  }));
  explain_flip(r, *plan, *r.flip, others);
}

// What MIN holds and why, for a spike origin.
void explain_spike(MinimizeReport& r, const Plan& plan, const SpikeOrigin& o) {
  const std::string T = std::to_string(o.step);
  r.kept.push_back("steps " + std::to_string(plan.steps.front()) + ".." + T + ": the spike's step and the healthy "
                   "steps before it, the fewest its site's trajectory is judged against (docs/spikes.md); MIN "
                   "declares the spike (incident.kind \"spike\", incident.step " + T + ")");
  if (plan.original_layout) {
    r.kept.push_back("every sample of the kept steps, ranks and micro-batches as the run had them" +
                     std::string(plan.optimizer_state ? ", with the optimizer state the update check reads" : ""));
  } else {
    r.kept.push_back("sample {" + comma_list(r.kept_samples_original) + "} (" + run_numbering_words(r) +
                     ") at step " + T + ", which carries the spike, and one sample of each step before it, each step "
                     "one micro-batch of one rank; their finite logged values go (another batch), and no optimizer "
                     "state: the update from another batch is not the run's");
  }
  r.kept.push_back(r.after.layers < r.before.layers
                       ? "layers 0.." + std::to_string(r.after.layers - 1) + ": the spike's origin is in the forward "
                         "pass at " + o.name() + ", which nothing after it feeds"
                       : "every layer");
  explain_removed(r);
}

// A reproduced spike origin and nothing non-finite: the candidates of spike_plans,
// each kept only if bisect on it names the same spike origin, reproduced.
void minimize_spike(const BisectReport& bisected, Minimizer& minimizer, const MinimizeOptions& options,
                    MinimizeOutcome& outcome) {
  MinimizeReport& r = outcome.report;
  r.finding = "spike";
  r.spike = bisected.spike;
  const SpikeOrigin& o = *r.spike->origin;
  const std::vector<std::string> rewritten = rewritten_into(bisected.findings, o.step);
  const std::optional<Plan> plan =
      first_reproducing(minimizer, minimizer.spike_plans(o), options, outcome, [&](const fs::path& dir) {
        std::optional<OriginalKey> key;
        std::vector<std::string> rewritten_after;
        std::optional<SpikeReport> spike;
        if (minimizer.replay(dir, key, &rewritten_after, &spike)) {
          return MinimizeAttempt{"", false, "a non-finite value where the run had none"};
        }
        if (!spike || !spike->reproduced || !spike->origin) {
          return MinimizeAttempt{"", false, spike && !spike->not_reproduced_reason.empty()
                                                ? "spike not reproduced: " + spike->not_reproduced_reason
                                                : "spike not reproduced"};
        }
        const std::string diff = minimizer.spike_difference(o, *spike->origin, key.value_or(OriginalKey{}));
        if (!diff.empty()) return MinimizeAttempt{"", false, "spike origin changed: " + diff};
        if (rewritten_after != rewritten) {
          return MinimizeAttempt{"", false, std::string("the update check ") +
                                                (rewritten.empty() ? "names" : "no longer names") + " rewritten weights"};
        }
        r.spike_after = spike;
        return MinimizeAttempt{"", true, "same spike origin, reproduced"};
      });
  if (!plan) {
    throw std::runtime_error("minimize: no candidate reproduces the spike origin, every step up to the spike "
                             "included; nothing was written");
  }
  if (!plan->original_layout) r.kept_samples_original = minimizer.originals_of(plan->samples.at(o.step));
  if (o.sample >= 0) r.original_sample = minimizer.originals_of({o.sample}).front();
  explain_spike(r, *plan, o);
}

}  // namespace

uint64_t directory_bytes(const fs::path& dir) {
  uint64_t total = 0;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (entry.is_regular_file()) total += entry.file_size();
  }
  return total;
}

MinimizeOutcome minimize_bundle(const Bundle& bundle, const BisectReport& bisected, const MinimizeOptions& options) {
  const auto started = std::chrono::steady_clock::now();
  MinimizeOutcome outcome;
  MinimizeReport& r = outcome.report;
  r.bundle = bundle.root().string();
  r.tool_version = options.tool_version;
  r.before = size_of(bundle);
  Minimizer minimizer(bundle, bisected, options);
  if (!bisected.origin && bisected.spike && bisected.spike->reproduced && bisected.spike->origin) {
    minimize_spike(bisected, minimizer, options, outcome);
    r.elapsed_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    return outcome;
  }
  if (!bisected.origin) {
    minimize_flip(bundle, bisected, minimizer, options, outcome);
    r.elapsed_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    return outcome;
  }
  r.finding = "origin";
  r.origin = bisected.origin;
  const std::vector<std::string> rewritten = rewritten_into(bisected.findings, r.origin->step);
  if (r.origin->sample >= 0) r.original_sample = original_key(bundle.manifest(), r.origin->sample).value;

  const std::optional<Plan> plan =
      first_reproducing(minimizer, minimizer.plans(), options, outcome, [&](const fs::path& dir) {
        std::optional<OriginalKey> key;
        std::vector<std::string> rewritten_after;
        const std::optional<FirstNonfinite> origin = minimizer.replay(dir, key, &rewritten_after);
        if (!origin) return MinimizeAttempt{"", false, "no non-finite value"};
        const std::string diff = minimizer.difference(*r.origin, *origin, key.value_or(OriginalKey{}));
        if (!diff.empty()) return MinimizeAttempt{"", false, "origin changed: " + diff};
        if (rewritten_after != rewritten) {
          const std::vector<std::string>& named = rewritten.empty() ? rewritten_after : rewritten;
          return MinimizeAttempt{"", false, std::string("the update check ") +
                                                (rewritten.empty() ? "names" : "no longer names") +
                                                " the rewritten weights (" + named.front() +
                                                (named.size() > 1 ? " and others)" : ")")};
        }
        r.origin_after = origin;
        return MinimizeAttempt{"", true, "same origin"};
      });
  if (!plan) {
    throw std::runtime_error("minimize: no candidate reproduces the origin, the whole failing step included; "
                             "nothing was written");
  }
  if (!plan->original_layout) r.kept_samples_original = minimizer.originals_of(plan->samples.at(r.origin->step));
  explain(r, *plan, *r.origin);
  r.elapsed_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return outcome;
}

}  // namespace nanreplay
