// See damage_output.h.
#include "reports/outputs/damage_output.h"

#include <sstream>

#include "reports/outputs/html_charts.h"

namespace nanreplay {

nlohmann::json damage_json(const std::shared_ptr<const DamageShape>& damage) {
  if (!damage) return nullptr;
  const DamageShape& d = *damage;
  auto positive = [](int64_t value) { return value > 0 ? nlohmann::json(value) : nlohmann::json(nullptr); };
  return {{"pattern", d.name()},
          {"meaning", d.meaning()},
          {"criterion", d.criterion},
          {"elements", d.count},
          {"considered", d.considered},
          {"sampled", d.sampled},
          {"rows_hit", d.rows_hit},
          {"columns_hit", d.columns_hit},
          {"heads_hit", d.heads_hit},
          {"sample", optional_index(d.sample)},
          {"batch_row", optional_index(d.batch_row)},
          {"position", optional_index(d.position)},
          {"column", optional_index(d.column)},
          {"head", optional_index(d.head)},
          {"block", positive(d.block)},
          {"period", positive(d.period)},
          {"blocks", positive(d.blocks)},
          {"map",
           {{"rows", d.tensor_rows},
            {"columns", d.tensor_columns},
            {"rows_are", d.rows_are},
            {"columns_are", d.columns_are},
            {"cell_rows", d.cell_rows},
            {"cell_columns", d.cell_columns},
            {"cells", d.map}}}};
}

ShownDamage shown_damage(const ReplayReport& report) {
  auto at = [](const std::string& site, int64_t step) { return site + " at step " + std::to_string(step); };
  if (report.first_nonfinite && report.first_nonfinite->damage) {
    return {report.first_nonfinite->damage.get(), at(report.first_nonfinite->name(), report.first_nonfinite->step)};
  }
  if (!report.spike) return {};
  const SpikeReport& spike = *report.spike;
  if (spike.reproduced && spike.origin && spike.origin->damage) {
    return {spike.origin->damage.get(), at(spike.origin->name(), spike.origin->step)};
  }
  if (spike.first_departure && spike.first_departure->damage) {
    return {spike.first_departure->damage.get(), at(spike.first_departure->name(), spike.first_departure->step)};
  }
  return {};
}

std::string damage_sentence(const ShownDamage& shown) {
  if (shown.damage == nullptr) return "";
  return "Damage at " + shown.where + ": " + shown.damage->summary() + " (" + shown.damage->meaning() + ")";
}

std::vector<std::string> damage_map_lines(const DamageShape& d) {
  std::vector<std::string> lines;
  lines.push_back("rows: " + d.rows_are + " (" + std::to_string(d.tensor_rows) + ", " + std::to_string(d.cell_rows) +
                  " a cell), columns: " + d.columns_are + " (" + std::to_string(d.tensor_columns) + ", " +
                  std::to_string(d.cell_columns) + " a cell), # holds a bad element" +
                  (d.sampled ? " (from an even sample of them)" : ""));
  for (const std::string& row : d.map) lines.push_back(row);
  return lines;
}

std::string damage_markdown(const ReplayReport& report) {
  const ShownDamage shown = shown_damage(report);
  if (shown.damage == nullptr) return "";
  std::ostringstream out;
  out << "\n**Shape of the damage** at `" << shown.where << "`: `" << shown.damage->summary() << "`. "
      << shown.damage->meaning() << " (context, not evidence).\n\n```\n";
  for (const std::string& line : damage_map_lines(*shown.damage)) out << line << "\n";
  out << "```\n";
  return out.str();
}

std::string damage_html(const ReplayReport& report) {
  const ShownDamage shown = shown_damage(report);
  if (shown.damage == nullptr) return "";
  std::ostringstream out;
  out << "<section class=\"damage\" id=\"damage\"><div><b>Shape of the damage</b> at <code>"
      << escape_html(shown.where) << "</code>: " << escape_html(shown.damage->summary()) << "</div><div class=\"meta\">"
      << escape_html(shown.damage->meaning()) << " (context, not evidence)</div><pre class=\"mono\">";
  for (const std::string& line : damage_map_lines(*shown.damage)) out << escape_html(line) << "\n";
  out << "</pre></section>";
  return out.str();
}

}  // namespace nanreplay
