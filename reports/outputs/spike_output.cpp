// See spike_output.h.
#include "reports/outputs/spike_output.h"

#include "reports/outputs/damage_output.h"
#include "reports/outputs/outlier_output.h"
#include "reports/results/number_text.h"
#include "reports/results/report.h"
#include "reports/triage/spike_origin.h"

namespace nanreplay {

nlohmann::json spike_json(const std::optional<SpikeReport>& spike) {
  if (!spike) return nullptr;
  const std::optional<SpikeOrigin>& o = spike->origin;
  const bool named = spike->reproduced && o.has_value();
  auto index = [&](int64_t value) { return named ? optional_index(value) : nlohmann::json(nullptr); };
  return {{"reproduced", spike->reproduced},
          {"step", named ? nlohmann::json(o->step) : nlohmann::json(nullptr)},
          {"phase", named ? nlohmann::json(phase_name(o->phase)) : nlohmann::json(nullptr)},
          {"site", named ? nlohmann::json(o->name()) : nlohmann::json(nullptr)},
          {"layer", index(named ? o->layer : -1)},
          {"head", index(named ? o->head : -1)},
          {"expert", index(named ? o->expert : -1)},
          {"rank", index(named ? o->rank : -1)},
          {"micro_batch", index(named ? o->micro_batch : -1)},
          {"sample", index(named ? o->sample : -1)},
          {"position", index(named ? o->position : -1)},
          {"statistic", named ? nlohmann::json(o->statistic) : nlohmann::json(nullptr)},
          {"score", named ? json_number(o->score) : nlohmann::json(nullptr)},
          {"damage", named ? damage_json(o->damage) : nlohmann::json(nullptr)}};
}

namespace {

nlohmann::json departure_json(const SpikeOrigin& o) {
  return {{"step", o.step},        {"site", o.name()},         {"head", optional_index(o.head)},
          {"expert", optional_index(o.expert)}, {"statistic", o.statistic}, {"score", json_number(o.score)},
          {"ratio", json_number(o.ratio)}, {"damage", damage_json(o.damage)}};
}

}  // namespace

nlohmann::json spike_check_json(const std::optional<SpikeReport>& spike) {
  if (!spike) return nullptr;
  auto optional_number = [](const std::optional<double>& v) { return v ? json_number(*v) : nlohmann::json(nullptr); };
  return {{"declared", spike->declared},
          {"spike_step", spike->step ? nlohmann::json(*spike->step) : nlohmann::json(nullptr)},
          {"quantity", spike->quantity.empty() ? nlohmann::json(nullptr) : nlohmann::json(spike->quantity)},
          {"logged_ratio", optional_number(spike->logged_ratio)},
          {"replayed_ratio", optional_number(spike->replayed_ratio)},
          {"ratio", spike->origin && spike->reproduced ? json_number(spike->origin->ratio) : nlohmann::json(nullptr)},
          {"first_departure", spike->first_departure ? departure_json(*spike->first_departure) : nlohmann::json(nullptr)},
          {"mechanism", mechanism_json(spike->mechanism)},
          {"not_reproduced_reason",
           spike->reproduced ? nlohmann::json(nullptr) : nlohmann::json(spike->not_reproduced_reason)}};
}

std::string spike_sentence(const SpikeReport& spike) {
  if (!spike.reproduced) return "SPIKE NOT REPRODUCED: " + spike.not_reproduced_reason;
  const std::string what = spike.quantity == "grad_norm" ? "gradient norm" : "loss";
  std::string text = "SPIKE: the replay reproduces the " + what + " spike of step " + std::to_string(*spike.step);
  if (!spike.origin) return text + "; no site leaves its own trajectory before it";
  const SpikeOrigin& o = *spike.origin;
  text += "; it starts at step " + std::to_string(o.step) + ", " + o.name();
  if (o.head >= 0) text += " head " + std::to_string(o.head);
  if (o.expert >= 0) text += " expert " + std::to_string(o.expert);
  text += " (rank " + std::to_string(o.rank) + ", micro-batch " + std::to_string(o.micro_batch);
  if (o.sample >= 0) text += ", sample " + std::to_string(o.sample) + " position " + std::to_string(o.position);
  text += "): " + o.statistic + " " + format_number(o.ratio) + "x its trend, robust z " + format_number(o.score);
  return text + logit_growth_clause(spike.mechanism);
}

}  // namespace nanreplay
