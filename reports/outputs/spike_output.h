// A spike incident as every renderer shows it (docs/spikes.md): report.json's
// "spike" and "spike_check" objects, and one sentence for the terminal,
// report.md and report.html, said before anything else when the replay does
// not reproduce the spike.
#pragma once

#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "reports/results/spike.h"

namespace nanreplay {

// report-v1's "spike": null without a spike incident; when not reproduced,
// every field but "reproduced" is null.
nlohmann::json spike_json(const std::optional<SpikeReport>& spike);
// This project's "spike_check": how the spike was judged (null without one).
nlohmann::json spike_check_json(const std::optional<SpikeReport>& spike);
// "SPIKE NOT REPRODUCED: ..." or "SPIKE at step 212 starts at layers.1.attn.scores ..."; empty without one.
std::string spike_sentence(const SpikeReport& spike);

}  // namespace nanreplay
