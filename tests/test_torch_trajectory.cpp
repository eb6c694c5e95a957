// Rolling forward (replay/step/trajectory.h): the parameters the replay derives
// step by step from one checkpoint equal the checkpoints the training run
// wrote at every step, to rounding; and fp16's loss scale carries from step
// to step (halved after a skipped step) when state.json does not name it.
#include <catch2/catch.hpp>

#include <fstream>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "loaders/bundle/bundle.h"
#include "replay/step/checkpoint.h"
#include "replay/step/trajectory.h"
#include "synth/synthetic_bundle.h"
#include "tests/cli_harness.h"

using namespace nanreplay;
using nanreplay_test::read_json;
using nanreplay_test::ScratchDir;

namespace {

// The same training run written with a checkpoint at every step and with one at the first only.
struct TwinBundles {
  ScratchDir dir{"trajectory"};
  std::filesystem::path per_step = dir / "per-step";
  std::filesystem::path rolled = dir / "rolled";

  explicit TwinBundles(const std::string& preset, int64_t steps = 4) {
    SyntheticSpec spec = synthetic_preset(preset);
    spec.num_steps = steps;
    write_synthetic_bundle(per_step, spec);
    spec.checkpoint_every = 1000;
    write_synthetic_bundle(rolled, spec);
  }
};

// Largest |derived - stored| over every element, relative to the tensor's largest |stored|.
double largest_relative_gap(const ModelCheckpoint& derived, const ModelCheckpoint& stored) {
  double gap = 0;
  for (const std::string& name : stored.order()) {
    const torch::Tensor a = derived.params().at(name).detach().to(torch::kFloat64);
    const torch::Tensor b = stored.params().at(name).detach().to(torch::kFloat64);
    REQUIRE(a.sizes() == b.sizes());
    const double scale = std::max(b.abs().max().item<double>(), 1e-30);
    gap = std::max(gap, (a - b).abs().max().item<double>() / scale);
  }
  return gap;
}

void check_derived_matches_checkpoints(const std::string& preset) {
  INFO("preset " << preset);
  const TwinBundles twins(preset);
  const Bundle per_step(twins.per_step), rolled(twins.rolled);
  REQUIRE(rolled.rolls_forward());
  REQUIRE_FALSE(per_step.rolls_forward());
  for (const StepFiles& files : rolled.steps()) {
    INFO("step " << files.step);
    const RolledStart start = roll_to(rolled, files.step);
    const ModelCheckpoint stored(per_step.step_files(files.step), per_step.manifest().model);
    // fp32 masters updated by the same arithmetic: a few ulps at most.
    CHECK(largest_relative_gap(start.checkpoint, stored) <= 1e-6);
    CHECK(start.state.loss_scale == per_step.load_state(per_step.step_files(files.step)).loss_scale);
  }
}

}  // namespace

TEST_CASE("derived parameters equal the run's per-step checkpoints to rounding", "[torch][roll]") {
  for (const char* preset : {"clean-fp32", "clean-dp", "clean-gpt2", "clean-bf16"}) {
    check_derived_matches_checkpoints(preset);
  }
}

TEST_CASE("fp16 rolled forward: a skipped step changes nothing and halves the carried loss scale", "[torch][roll]") {
  const TwinBundles twins("transient-fp16");  // the scaler skips step 101
  // The job logged its loss scale only at the first step: the rest carries.
  for (const auto& entry : std::filesystem::directory_iterator(twins.rolled / "steps")) {
    if (entry.path().filename() == "100") continue;
    nlohmann::json state = read_json(entry.path() / "state.json");
    state.erase("loss_scale");
    std::ofstream(entry.path() / "state.json") << state.dump(2) << "\n";
  }
  const Bundle per_step(twins.per_step), rolled(twins.rolled);
  const double first_scale = per_step.load_state(per_step.step_files(100)).loss_scale;
  REQUIRE(per_step.load_state(per_step.step_files(101)).skipped == true);
  CHECK(roll_to(rolled, 101).state.loss_scale == first_scale);
  CHECK(roll_to(rolled, 102).state.loss_scale == first_scale / 2);
  CHECK(roll_to(rolled, 103).state.loss_scale == first_scale / 2);
  // Step 101 was skipped: step 102 starts from exactly the parameters 101 had.
  const RolledStart at_101 = roll_to(rolled, 101), at_102 = roll_to(rolled, 102);
  CHECK(largest_relative_gap(at_102.checkpoint, at_101.checkpoint) == 0.0);
  const ModelCheckpoint stored(per_step.step_files(103), per_step.manifest().model);
  CHECK(largest_relative_gap(roll_to(rolled, 103).checkpoint, stored) <= 1e-6);
}
