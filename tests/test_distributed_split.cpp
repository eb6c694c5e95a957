// The pieces of a replay split across processes that need no peers: the
// layer split by memory (replay/step/ranks/distributed.h) and probe records as bytes
// (probes/record_wire.h). The split replay itself: tests/py/test_distributed.py.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

#include "probes/record_wire.h"
#include "replay/step/ranks/distributed.h"

using namespace nanreplay;

namespace {

std::vector<int> counts(const std::vector<IndexRange>& ranges) {
  std::vector<int> out;
  int next = 0;
  for (const IndexRange& r : ranges) {
    REQUIRE(r.first == next);  // contiguous, in rank order
    out.push_back(r.end - r.first);
    next = r.end;
  }
  return out;
}

}  // namespace

TEST_CASE("layers split in proportion to each process's memory", "[distributed]") {
  CHECK(counts(split_layers(32, {64.0, 32.0})) == std::vector<int>{21, 11});
  CHECK(counts(split_layers(4, {1.0, 1.0})) == std::vector<int>{2, 2});
  CHECK(counts(split_layers(4, {1.0, 1.0, 1.0})) == std::vector<int>{2, 1, 1});
  CHECK(counts(split_layers(7, {1.0, 1.0, 1.0})) == std::vector<int>{3, 2, 2});
  // Fewer layers than processes: rank 0 starts the layers, the last holds none.
  CHECK(counts(split_layers(2, {1.0, 1.0, 1.0})) == std::vector<int>{1, 1, 0});
  // Rank 0 runs the embeddings, so it holds layer 0 even with little memory.
  CHECK(counts(split_layers(4, {0.1, 100.0})) == std::vector<int>{1, 3});
  CHECK(counts(split_layers(3, {0.0, 0.0})) == std::vector<int>{2, 1});
  CHECK(split_layers(5, {1.0, 2.0, 3.0}).back().end == 5);
}

TEST_CASE("data-parallel ranks go to the processes in contiguous blocks, the larger first", "[distributed]") {
  auto blocks = [](int ranks, int processes) {
    std::vector<IndexRange> out;
    for (int p = 0; p < processes; ++p) out.push_back(rank_block(ranks, processes, p));
    return counts(out);
  };
  CHECK(blocks(4, 2) == std::vector<int>{2, 2});
  CHECK(blocks(4, 3) == std::vector<int>{2, 1, 1});
  CHECK(blocks(5, 2) == std::vector<int>{3, 2});
  CHECK(blocks(2, 3) == std::vector<int>{1, 1, 0});
  CHECK(blocks(1, 2) == std::vector<int>{1, 0});
  CHECK(blocks(8, 4) == std::vector<int>{2, 2, 2, 2});
}

TEST_CASE("probe records and norm checks survive bytes exactly", "[distributed]") {
  ProbeRecord r;
  r.step = 104, r.micro_batch = 1, r.rank = 3, r.phase = Phase::kBackward, r.order = 17;
  r.site = SiteRef{SiteId::kInput, 2};
  r.param = "layers.2.attn.wq.weight";
  r.layer = 2, r.head = 5, r.expert = -1, r.routed_tokens = 40;
  r.shape = {2, 8, 16, 16};
  r.stats.count = 4096, r.stats.nan_count = 3, r.stats.inf_count = 1;
  r.stats.max_abs = 65504.0, r.stats.sum = -0.1, r.stats.sum_sq = std::numeric_limits<double>::denorm_min();
  r.stats.first_nonfinite = 77;
  r.first_index = {0, 5, 3, 1};
  r.sample = 4321, r.position = 3, r.first_head = 5, r.headroom_bits = std::numeric_limits<double>::infinity();
  r.largest_sample = 77, r.largest_position = 6;
  DamageShape damage;
  damage.pattern = DamagePattern::kHead, damage.criterion = "non-finite", damage.count = 37, damage.head = 5;
  damage.rows_are = "sample x position", damage.map = {"..#.", "...."};
  r.damage = std::make_shared<const DamageShape>(damage);
  NormCheck c;
  c.site = SiteRef{SiteId::kAttnNorm, 1}, c.layer = 1, c.moment = "variance", c.eps = 1e-5;
  c.min_moment = 0.0, c.rows_below_eps = 2, c.zero_denominator = true, c.sample = 9, c.position = 12;

  WireWriter out;
  out.record(r);
  out.norm_check(c);
  out.text("");
  const std::string bytes = out.take();
  WireReader in(bytes);
  const ProbeRecord back = in.record();
  CHECK(back.step == r.step);
  CHECK(back.phase == r.phase);
  CHECK(back.site == r.site);
  CHECK(back.param == r.param);
  CHECK(back.shape == r.shape);
  CHECK(back.first_index == r.first_index);
  CHECK(back.stats.sum == r.stats.sum);
  CHECK(back.stats.sum_sq == r.stats.sum_sq);
  CHECK(back.stats.first_nonfinite == 77);
  CHECK(std::isinf(back.headroom_bits));
  CHECK(back.largest_sample == 77);  // a spike origin's sample and position cross too
  CHECK(back.largest_position == 6);
  REQUIRE(back.damage);  // and where the bad elements lie
  CHECK(back.damage->pattern == DamagePattern::kHead);
  CHECK(back.damage->count == 37);
  CHECK(back.damage->head == 5);
  CHECK(back.damage->rows_are == "sample x position");
  CHECK(back.damage->map == damage.map);
  const NormCheck check = in.norm_check();
  CHECK(std::string(check.moment) == "variance");
  CHECK(check.zero_denominator);
  CHECK(check.site == c.site);
  CHECK(in.text().empty());
  CHECK(in.done());
  // Bytes that end early are an error, not a record made up.
  const std::string cut = bytes.substr(0, 20);
  WireReader short_in(cut);
  CHECK_THROWS(short_in.record());
}
