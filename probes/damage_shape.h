// The shape of the damage in one tensor (docs/triage.md, "The shape of the
// damage"): given the coordinates of its bad elements (non-finite, or far
// beyond the tensor's bulk for a spike), whether they are one element, one
// token row, one feature, one head, blocks aligned to 16..128 elements, or
// scattered, plus a small map of where they lie. Pure and plain: no LibTorch;
// the replay hands it flat indices while the tensor is at hand
// (replay/probing/damage_mask.h) and keeps only the result.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace nanreplay {

// How a tensor's dimensions read.
enum class DamageLayout : uint8_t {
  kFlat,        // no named dimensions
  kTokens,      // [batch, position, features]
  kFusedHeads,  // [batch, position, heads * head_dim] (attn.q, attn.k, attn.v)
  kHeads,       // [batch, head, position, key position or head_dim]
  kWeight,      // [out, in]
};

enum class DamagePattern : uint8_t {
  kSingleElement,
  kTokenRow,       // every bad element in one (sample, position)
  kTokenRows,      // a few token rows, each mostly bad: the same token in several places
  kFeature,        // every bad element in one feature (last-dimension index), over most tokens
  kTokenFeature,   // one feature, in a few tokens (at most half the token rows)
  kHead,           // every bad element within one head's slice
  kWeightRow,      // a weight: one output row
  kWeightColumn,   // a weight: one input column
  kAlignedBlocks,  // runs of 16/32/64/128 elements at multiples of that size
  kWholeTensor,    // nearly every element
  kScattered,      // none of the above
};

const char* damage_pattern_name(DamagePattern pattern);     // "single_element", "token_row", ...
const char* damage_pattern_meaning(DamagePattern pattern);  // what it usually means: context, hedged

struct DamageInput {
  std::vector<int64_t> shape;
  DamageLayout layout = DamageLayout::kFlat;
  int64_t head_dim = 0;       // kFusedHeads: the width of one head's slice
  int64_t considered = 0;     // elements looked at (a causal site's visible ones); 0: every element
  int64_t count = 0;          // bad elements in all
  std::vector<int64_t> indices;  // row-major flat indices, ascending: all of them, or an even sample
  std::string criterion;      // "non-finite", or the outlier rule
};

// A coarse picture: the tensor as rows x columns (the last dimension), each
// cell '#' where it holds a bad element, '.' elsewhere.
constexpr int64_t kDamageMapRows = 16;
constexpr int64_t kDamageMapColumns = 64;
// At most this many indices are handed over; beyond it an even sample.
constexpr int64_t kDamageIndexCap = int64_t{1} << 16;

struct DamageShape {
  DamagePattern pattern = DamagePattern::kScattered;
  std::string criterion;
  int64_t count = 0, considered = 0;
  bool sampled = false;  // the indices were a sample of `count`: blocks are not judged
  int64_t rows_hit = 0, columns_hit = 0, heads_hit = 0;  // distinct token rows (weight rows), columns, heads
  int64_t batch_row = -1, position = -1;  // the one token row, when there is one
  int64_t sample = -1;                    // its dataset index (the replay fills it), -1: n/a
  int64_t column = -1;                    // the one feature / weight column
  int head = -1;                          // the one head
  int64_t block = 0, period = 0, blocks = 0;  // kAlignedBlocks: size, common stride (0: none), how many
  // The map: each cell covers cell_rows x cell_columns of the tensor's rows x columns.
  int64_t tensor_rows = 0, tensor_columns = 0, cell_rows = 1, cell_columns = 1;
  std::string rows_are, columns_are;  // "sample x position", "feature", ...
  std::vector<std::string> map;

  const char* name() const { return damage_pattern_name(pattern); }
  const char* meaning() const { return damage_pattern_meaning(pattern); }
  // One line for the terminal: "one head (head 2): 37 of 4096 non-finite elements".
  std::string summary() const;
};

DamageShape classify_damage(const DamageInput& input);

}  // namespace nanreplay
