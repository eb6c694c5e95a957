// The shape-of-the-damage classifier (probes/damage_shape.h) on hand-made
// sets of bad elements: one element, one token row, a few token rows, one
// feature, one head (fused and per-head layouts), weight rows and columns,
// aligned blocks with a period, scattered, the whole tensor, and its map.
#include <catch2/catch.hpp>

#include <algorithm>

#include "probes/damage_shape.h"

using nanreplay::classify_damage;
using nanreplay::DamageInput;
using nanreplay::DamageLayout;
using nanreplay::DamagePattern;
using nanreplay::DamageShape;

namespace {

DamageShape damage_of(std::vector<int64_t> shape, DamageLayout layout, std::vector<int64_t> indices,
                      int64_t head_dim = 0) {
  std::sort(indices.begin(), indices.end());
  DamageInput in;
  in.shape = std::move(shape);
  in.layout = layout;
  in.head_dim = head_dim;
  in.count = static_cast<int64_t>(indices.size());
  in.indices = std::move(indices);
  in.criterion = "non-finite";
  return classify_damage(in);
}

// Flat index of [b, t, c] in a (B, T, C) tensor.
int64_t at3(int64_t b, int64_t t, int64_t c, int64_t T, int64_t C) { return (b * T + t) * C + c; }

}  // namespace

TEST_CASE("damage: one element, one token row, a few token rows", "[damage][unit]") {
  const DamageShape one = damage_of({2, 8, 64}, DamageLayout::kTokens, {at3(1, 5, 9, 8, 64)});
  CHECK(one.pattern == DamagePattern::kSingleElement);
  CHECK(one.batch_row == 1);
  CHECK(one.position == 5);
  CHECK(one.column == 9);
  CHECK(std::string(one.name()) == "single_element");

  std::vector<int64_t> row;
  for (int64_t c = 0; c < 64; c += 3) row.push_back(at3(1, 3, c, 8, 64));
  const DamageShape token = damage_of({2, 8, 64}, DamageLayout::kTokens, row);
  CHECK(token.pattern == DamagePattern::kTokenRow);
  CHECK(token.batch_row == 1);
  CHECK(token.position == 3);
  CHECK(token.rows_hit == 1);

  std::vector<int64_t> rows;
  for (int64_t t : {1, 3}) {
    for (int64_t c = 0; c < 64; ++c) rows.push_back(at3(0, t, c, 8, 64));
  }
  const DamageShape few = damage_of({2, 8, 64}, DamageLayout::kTokens, rows);
  CHECK(few.pattern == DamagePattern::kTokenRows);
  CHECK(few.rows_hit == 2);
}

TEST_CASE("damage: one feature, one head fused or per head", "[damage][unit]") {
  std::vector<int64_t> column;
  for (int64_t r = 0; r < 16; ++r) column.push_back(r * 64 + 7);
  const DamageShape feature = damage_of({2, 8, 64}, DamageLayout::kFusedHeads, column, 16);
  CHECK(feature.pattern == DamagePattern::kFeature);
  CHECK(feature.column == 7);
  CHECK(feature.head == 0);  // the feature lies in head 0's slice
  // The same feature in a few tokens only: those tokens, not a weight every token reads.
  const DamageShape few_tokens = damage_of({2, 8, 64}, DamageLayout::kTokens, {3 * 64 + 7, 5 * 64 + 7, 9 * 64 + 7});
  CHECK(few_tokens.pattern == DamagePattern::kTokenFeature);
  CHECK(few_tokens.rows_hit == 3);

  std::vector<int64_t> fused;  // head 1's columns 16..31, several tokens and features
  for (int64_t r : {0, 5, 9}) {
    for (int64_t c : {17, 20, 31}) fused.push_back(r * 64 + c);
  }
  const DamageShape head = damage_of({2, 8, 64}, DamageLayout::kFusedHeads, fused, 16);
  CHECK(head.pattern == DamagePattern::kHead);
  CHECK(head.head == 1);
  CHECK(head.heads_hit == 1);

  std::vector<int64_t> scores;  // (B, H, T, T) = (2, 4, 8, 8): head 2, several queries and keys
  for (int64_t b : {0, 1}) {
    for (int64_t q : {4, 6}) {
      for (int64_t k = 0; k <= q; k += 2) scores.push_back(((b * 4 + 2) * 8 + q) * 8 + k);
    }
  }
  const DamageShape per_head = damage_of({2, 4, 8, 8}, DamageLayout::kHeads, scores);
  CHECK(per_head.pattern == DamagePattern::kHead);
  CHECK(per_head.head == 2);
  CHECK(per_head.rows_are == "sample x head x position");
  CHECK(per_head.columns_are == "key position");
  // One query row of one head: a token row (the head is named beside it).
  const DamageShape query = damage_of({2, 4, 8, 8}, DamageLayout::kHeads, {((1 * 4 + 3) * 8 + 5) * 8 + 1,
                                                                           ((1 * 4 + 3) * 8 + 5) * 8 + 4});
  CHECK(query.pattern == DamagePattern::kTokenRow);
  CHECK(query.batch_row == 1);
  CHECK(query.position == 5);
  CHECK(query.head == 3);
  CHECK(query.summary().find("all in head 3") != std::string::npos);
}

TEST_CASE("damage: a weight's element, row and column", "[damage][unit]") {
  CHECK(damage_of({16, 32}, DamageLayout::kWeight, {5 * 32 + 3}).pattern == DamagePattern::kSingleElement);
  std::vector<int64_t> row, column;
  for (int64_t i = 0; i < 32; ++i) row.push_back(5 * 32 + i);
  for (int64_t o = 0; o < 16; ++o) column.push_back(o * 32 + 3);
  const DamageShape r = damage_of({16, 32}, DamageLayout::kWeight, row);
  CHECK(r.pattern == DamagePattern::kWeightRow);
  CHECK(r.batch_row == -1);  // a weight has no token
  const DamageShape c = damage_of({16, 32}, DamageLayout::kWeight, column);
  CHECK(c.pattern == DamagePattern::kWeightColumn);
  CHECK(c.column == 3);
  CHECK(c.rows_are == "output");
}

TEST_CASE("damage: aligned blocks with a period, scattered, the whole tensor", "[damage][unit]") {
  std::vector<int64_t> blocks;  // runs of 16 every 80 elements
  for (int64_t start = 0; start < 1024; start += 80) {
    for (int64_t i = 0; i < 16 && start + i < 1024; ++i) blocks.push_back(start + i);
  }
  const DamageShape b = damage_of({2, 8, 64}, DamageLayout::kTokens, blocks);
  CHECK(b.pattern == DamagePattern::kAlignedBlocks);
  CHECK(b.block == 16);
  CHECK(b.period == 80);
  CHECK(b.blocks == 13);
  // Runs of 64 at multiples of 128 in a flat tensor: the largest size that fits.
  std::vector<int64_t> tiles;
  for (int64_t start : {0, 256, 768}) {
    for (int64_t i = 0; i < 128; ++i) tiles.push_back(start + i);
  }
  const DamageShape t = damage_of({4096}, DamageLayout::kFlat, tiles);
  CHECK(t.pattern == DamagePattern::kAlignedBlocks);
  CHECK(t.block == 128);
  CHECK(t.period == 0);  // 0, 256, 768: no common stride
  // Misaligned runs are not blocks.
  std::vector<int64_t> shifted;
  for (int64_t start : {3, 259, 515}) {
    for (int64_t i = 0; i < 16; ++i) shifted.push_back(start + i);
  }
  CHECK(damage_of({4096}, DamageLayout::kFlat, shifted).pattern == DamagePattern::kScattered);

  const DamageShape s = damage_of({2, 8, 64}, DamageLayout::kTokens, {3, 77, 200, 513, 901});
  CHECK(s.pattern == DamagePattern::kScattered);
  CHECK(s.rows_hit == 5);

  std::vector<int64_t> all(1024);
  for (int64_t i = 0; i < 1024; ++i) all[static_cast<size_t>(i)] = i;
  CHECK(damage_of({2, 8, 64}, DamageLayout::kTokens, all).pattern == DamagePattern::kWholeTensor);
}

TEST_CASE("damage: the map is at most 16 x 64 cells and marks the bad cell; a sample is said", "[damage][unit]") {
  const DamageShape d = damage_of({4, 128, 512}, DamageLayout::kTokens, {at3(2, 70, 300, 128, 512)});
  REQUIRE(d.map.size() == 16);
  CHECK(d.map[0].size() == 64);
  CHECK(d.cell_rows == 32);
  CHECK(d.cell_columns == 8);
  const size_t cell_row = (2 * 128 + 70) / 32, cell_column = 300 / 8;
  CHECK(d.map[cell_row][cell_column] == '#');
  CHECK(std::count(d.map[cell_row].begin(), d.map[cell_row].end(), '#') == 1);
  // A small tensor keeps one cell per element.
  const DamageShape small = damage_of({1, 3, 5}, DamageLayout::kTokens, {7});
  REQUIRE(small.map.size() == 3);
  CHECK(small.map[1] == "..#..");

  DamageInput in;
  in.shape = {2, 8, 64};
  in.layout = DamageLayout::kTokens;
  in.count = 400;
  for (int64_t i = 0; i < 200; ++i) in.indices.push_back(i * 5);  // every other one of 400
  const DamageShape sampled = classify_damage(in);
  CHECK(sampled.sampled);
  CHECK(sampled.block == 0);
  CHECK(sampled.count == 400);
}
