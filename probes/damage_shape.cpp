// See damage_shape.h. Every rule reads the bad elements' coordinates only;
// the order of the checks is the order of specificity (one element before one
// row before one feature or head), so each tensor gets the narrowest pattern
// that holds all of its bad elements.
#include "probes/damage_shape.h"

#include <algorithm>
#include <map>
#include <set>

namespace nanreplay {

namespace {

struct DamageCoords {
  int64_t numel = 1, columns = 1, rows = 1;  // the tensor as rows x columns (its last dimension)
  int64_t token_rows = 0, heads = 0;         // distinct token (weight) rows and heads the layout has
  int64_t row_width = 0;                     // elements of one token row (kTokens, kFusedHeads)
};

DamageCoords damage_coords(const DamageInput& in) {
  DamageCoords c;
  for (int64_t d : in.shape) c.numel *= d;
  if (in.shape.empty() || c.numel == 0) return c;
  c.columns = in.shape.back();
  c.rows = c.numel / c.columns;
  c.token_rows = c.rows;
  if ((in.layout == DamageLayout::kTokens || in.layout == DamageLayout::kFusedHeads) && in.shape.size() == 3) {
    c.row_width = c.columns;
    if (in.layout == DamageLayout::kFusedHeads && in.head_dim > 0 && c.columns % in.head_dim == 0) {
      c.heads = c.columns / in.head_dim;
    }
  } else if (in.layout == DamageLayout::kHeads && in.shape.size() == 4) {
    c.token_rows = in.shape[0] * in.shape[2];
    c.heads = in.shape[1];
  }
  return c;
}

// The (sample, position) row, weight row or plain row of a flat index.
int64_t token_row_of(int64_t flat, const DamageInput& in, const DamageCoords& c) {
  if (in.layout == DamageLayout::kHeads && in.shape.size() == 4) {
    const int64_t H = in.shape[1], T = in.shape[2], X = in.shape[3];
    return (flat / (H * T * X)) * T + (flat / X) % T;
  }
  return flat / c.columns;
}

int head_of(int64_t flat, const DamageInput& in, const DamageCoords& c) {
  if (c.heads == 0) return -1;
  if (in.layout == DamageLayout::kHeads) return static_cast<int>((flat / (in.shape[2] * in.shape[3])) % in.shape[1]);
  return static_cast<int>((flat % c.columns) / in.head_dim);
}

// Runs of consecutive indices that all start and end on multiples of one of
// 128, 64, 32, 16 (the largest that fits): the block size, 0 when none does.
void find_aligned_blocks(const std::vector<int64_t>& indices, DamageShape& out) {
  std::vector<std::pair<int64_t, int64_t>> runs;  // start, length
  for (int64_t i : indices) {
    if (!runs.empty() && runs.back().first + runs.back().second == i) {
      ++runs.back().second;
    } else {
      runs.push_back({i, 1});
    }
  }
  for (int64_t block : {128, 64, 32, 16}) {
    const bool aligned = std::all_of(runs.begin(), runs.end(), [&](const auto& r) {
      return r.first % block == 0 && r.second % block == 0;
    });
    if (!aligned) continue;
    std::vector<int64_t> starts;
    for (const auto& [start, length] : runs) {
      for (int64_t s = start; s < start + length; s += block) starts.push_back(s);
    }
    out.block = block;
    out.blocks = static_cast<int64_t>(starts.size());
    out.period = 0;
    if (starts.size() >= 2) {
      const int64_t stride = starts[1] - starts[0];
      bool even = stride > block;
      for (size_t k = 2; k < starts.size() && even; ++k) even = starts[k] - starts[k - 1] == stride;
      if (even) out.period = stride;
    }
    return;
  }
}

void draw_damage_map(const DamageInput& in, const DamageCoords& c, DamageShape& out) {
  out.tensor_rows = c.rows;
  out.tensor_columns = c.columns;
  out.cell_rows = (c.rows + kDamageMapRows - 1) / kDamageMapRows;
  out.cell_columns = (c.columns + kDamageMapColumns - 1) / kDamageMapColumns;
  const int64_t grid_rows = (c.rows + out.cell_rows - 1) / out.cell_rows;
  const int64_t grid_columns = (c.columns + out.cell_columns - 1) / out.cell_columns;
  out.map.assign(static_cast<size_t>(grid_rows), std::string(static_cast<size_t>(grid_columns), '.'));
  for (int64_t flat : in.indices) {
    const int64_t r = (flat / c.columns) / out.cell_rows, col = (flat % c.columns) / out.cell_columns;
    if (r < grid_rows && col < grid_columns) out.map[static_cast<size_t>(r)][static_cast<size_t>(col)] = '#';
  }
  switch (in.layout) {
    case DamageLayout::kTokens: out.rows_are = "sample x position"; out.columns_are = "feature"; break;
    case DamageLayout::kFusedHeads: out.rows_are = "sample x position"; out.columns_are = "head x head dim"; break;
    case DamageLayout::kHeads:
      out.rows_are = "sample x head x position";
      out.columns_are = in.shape.size() == 4 && in.shape[2] == in.shape[3] ? "key position" : "head dim";
      break;
    case DamageLayout::kWeight: out.rows_are = "output"; out.columns_are = "input"; break;
    case DamageLayout::kFlat: out.rows_are = "row"; out.columns_are = "column"; break;
  }
}

// Few token rows, each mostly bad (the sample's scale applied to each row's count).
bool mostly_bad_rows(const std::map<int64_t, int64_t>& per_row, double scale, const DamageCoords& c) {
  if (c.row_width == 0 || per_row.size() < 2 || static_cast<int64_t>(per_row.size()) * 4 > c.token_rows) return false;
  return std::all_of(per_row.begin(), per_row.end(),
                     [&](const auto& kv) { return kv.second * scale * 2 >= static_cast<double>(c.row_width); });
}

DamagePattern pick_pattern(const DamageInput& in, const DamageCoords& c, const std::map<int64_t, int64_t>& per_row,
                           double scale, DamageShape& out) {
  const bool weight = in.layout == DamageLayout::kWeight;
  if (out.count == 1) return DamagePattern::kSingleElement;
  if (out.rows_hit == 1 && c.token_rows > 1) return weight ? DamagePattern::kWeightRow : DamagePattern::kTokenRow;
  const bool one_column = out.columns_hit == 1 && c.columns > 1 && in.layout != DamageLayout::kHeads;
  if (one_column && weight) return DamagePattern::kWeightColumn;
  if (one_column) return out.rows_hit * 2 > c.token_rows ? DamagePattern::kFeature : DamagePattern::kTokenFeature;
  if (out.heads_hit == 1 && c.heads > 1) return DamagePattern::kHead;
  if (out.count * 10 >= out.considered * 9) return DamagePattern::kWholeTensor;
  if (mostly_bad_rows(per_row, scale, c)) return DamagePattern::kTokenRows;
  if (!out.sampled) {
    find_aligned_blocks(in.indices, out);
    if (out.block > 0) return DamagePattern::kAlignedBlocks;
  }
  return DamagePattern::kScattered;
}

}  // namespace

const char* damage_pattern_name(DamagePattern pattern) {
  switch (pattern) {
    case DamagePattern::kSingleElement: return "single_element";
    case DamagePattern::kTokenRow: return "token_row";
    case DamagePattern::kTokenRows: return "token_rows";
    case DamagePattern::kFeature: return "feature";
    case DamagePattern::kTokenFeature: return "token_feature";
    case DamagePattern::kHead: return "head";
    case DamagePattern::kWeightRow: return "weight_row";
    case DamagePattern::kWeightColumn: return "weight_column";
    case DamagePattern::kAlignedBlocks: return "aligned_blocks";
    case DamagePattern::kWholeTensor: return "whole_tensor";
    case DamagePattern::kScattered: return "scattered";
  }
  return "scattered";
}

const char* damage_pattern_meaning(DamagePattern pattern) {
  switch (pattern) {
    case DamagePattern::kSingleElement:
      return "one value alone: one extreme pair of inputs (a rare token's query against one key overflows alone at "
             "first) or a flipped bit (in memory or a checkpoint); the numeric and system findings say which";
    case DamagePattern::kTokenRow:
      return "one token: often the data (a rare, corrupt or unusual token and its embedding), or a position the "
             "model treats specially";
    case DamagePattern::kTokenRows:
      return "a few whole token rows: often the same token or sample recurring in the batch, that is the data";
    case DamagePattern::kFeature:
      return "one feature over many tokens: often a weight (the row of the projection that writes it, or a norm's "
             "gain), sometimes an outlier channel the model grew";
    case DamagePattern::kTokenFeature:
      return "one feature of a few tokens: often the data (those tokens' embedding rows carry an outlier "
             "feature), or an outlier channel that fires on them; a weight fault would reach most tokens";
    case DamagePattern::kHead:
      return "one attention head: often numeric (that head's query-key products outgrow the compute type), or "
             "that head's projection weights";
    case DamagePattern::kWeightRow:
      return "one output row of a weight: often one update or write that touched a row (an embedding row of one "
             "token), or a corrupted row in memory";
    case DamagePattern::kWeightColumn:
      return "one input column of a weight: often an update driven by one extreme input feature, or a corrupted "
             "column in memory";
    case DamagePattern::kAlignedBlocks:
      return "blocks aligned to a power-of-two size: seldom data or numerics; often a kernel, memory or "
             "communication fault that writes whole tiles";
    case DamagePattern::kWholeTensor:
      return "nearly every element: the damage probably arrived from upstream or from a global scale (loss "
             "scale, learning rate, a non-finite input); look at what this tensor reads";
    case DamagePattern::kScattered:
      return "no structure: many unrelated elements, as a range overflow over many tokens does; no single token, "
             "feature or head stands out";
  }
  return "";
}

std::string DamageShape::summary() const {
  std::string where;
  switch (pattern) {
    case DamagePattern::kTokenRow:
      where = sample >= 0 ? " (sample " + std::to_string(sample) + ", position " + std::to_string(position) + ")"
                          : " (batch row " + std::to_string(batch_row) + ", position " + std::to_string(position) + ")";
      break;
    case DamagePattern::kTokenRows: where = " (" + std::to_string(rows_hit) + " rows)"; break;
    case DamagePattern::kFeature:
    case DamagePattern::kWeightColumn: where = " (column " + std::to_string(column) + ")"; break;
    case DamagePattern::kTokenFeature:
      where = " (column " + std::to_string(column) + ", " + std::to_string(rows_hit) + " token rows)";
      break;
    case DamagePattern::kHead: where = " (head " + std::to_string(head) + ")"; break;
    case DamagePattern::kAlignedBlocks:
      where = " (" + std::to_string(blocks) + " of " + std::to_string(block) + " elements" +
              (period > 0 ? ", every " + std::to_string(period) : std::string()) + ")";
      break;
    default: break;
  }
  std::string text = std::string(name()) + where + ": " + std::to_string(count) + " of " +
                     std::to_string(considered) + " elements " + criterion;
  if (head >= 0 && pattern != DamagePattern::kHead) text += ", all in head " + std::to_string(head);
  return text;
}

DamageShape classify_damage(const DamageInput& in) {
  const DamageCoords c = damage_coords(in);
  DamageShape out;
  out.criterion = in.criterion;
  out.count = in.count;
  out.considered = in.considered > 0 ? in.considered : c.numel;
  out.sampled = static_cast<int64_t>(in.indices.size()) < in.count;
  std::map<int64_t, int64_t> per_row;
  std::set<int64_t> columns;
  std::set<int> heads;
  for (int64_t flat : in.indices) {
    ++per_row[token_row_of(flat, in, c)];
    columns.insert(flat % c.columns);
    if (c.heads > 0) heads.insert(head_of(flat, in, c));
  }
  out.rows_hit = static_cast<int64_t>(per_row.size());
  out.columns_hit = static_cast<int64_t>(columns.size());
  out.heads_hit = static_cast<int64_t>(heads.size());
  if (per_row.size() == 1 && in.layout != DamageLayout::kWeight && in.layout != DamageLayout::kFlat) {
    const int64_t T = in.shape.size() >= 3 ? in.shape[in.layout == DamageLayout::kHeads ? 2 : 1] : 1;
    out.batch_row = per_row.begin()->first / T;
    out.position = per_row.begin()->first % T;
  }
  if (columns.size() == 1) out.column = *columns.begin();
  if (heads.size() == 1) out.head = *heads.begin();
  const double scale = in.indices.empty() ? 1.0 : static_cast<double>(in.count) / double(in.indices.size());
  if (!in.indices.empty()) out.pattern = pick_pattern(in, c, per_row, scale, out);
  draw_damage_map(in, c, out);
  return out;
}

}  // namespace nanreplay
