// The shape of the damage as every renderer shows it (docs/report-format.md,
// "damage"): report.json's optional "damage" object on the origin, one line
// for the terminal, and a small map (at most 16 x 64 cells) for report.md and
// report.html. Every string here is made from numbers and fixed words.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "probes/damage_shape.h"
#include "reports/results/report.h"

namespace nanreplay {

// Null without one.
nlohmann::json damage_json(const std::shared_ptr<const DamageShape>& damage);

// The damage the report shows: the non-finite origin's, else the spike
// origin's, else the spike's first departure's; `where` names its site and step.
struct ShownDamage {
  const DamageShape* damage = nullptr;
  std::string where;  // "layers.1.attn.scores at step 103"
};
ShownDamage shown_damage(const ReplayReport& report);

// "Damage at layers.1.attn.scores at step 103: head (head 2): 37 of 4096 elements non-finite"
std::string damage_sentence(const ShownDamage& shown);
// What the map's rows and columns are, then one line per row of cells.
std::vector<std::string> damage_map_lines(const DamageShape& damage);
// report.md's and report.html's block: the sentence and the map; empty without one.
std::string damage_markdown(const ReplayReport& report);
std::string damage_html(const ReplayReport& report);

}  // namespace nanreplay
