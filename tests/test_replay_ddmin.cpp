// ddmin, the delta debugging behind bisect's samples stage: it must return a
// 1-minimal failing subset, keep the input's order, and test each distinct
// subset at most once (its test count is bisect's replay count).
#include <algorithm>
#include <set>

#include <catch2/catch.hpp>

#include "replay/workflows/ddmin.h"

using nanreplay::ddmin;

namespace {

// Fails when every element of `needed` is present.
std::function<bool(const std::vector<int>&)> needs(std::set<int> needed, std::vector<std::vector<int>>* seen) {
  return [needed, seen](const std::vector<int>& subset) {
    seen->push_back(subset);
    return std::all_of(needed.begin(), needed.end(), [&](int x) {
      return std::find(subset.begin(), subset.end(), x) != subset.end();
    });
  };
}

}  // namespace

TEST_CASE("ddmin isolates a single failing element by halving", "[ddmin]") {
  std::vector<std::vector<int>> seen;
  const auto result = ddmin<int>({10, 11, 12, 13, 14, 15, 16, 17}, needs({15}, &seen));
  CHECK(result.minimal == std::vector<int>{15});
  // {10..13} passes, {14..17} fails, {14,15} fails, {14} passes, {15} fails.
  CHECK(result.tests == 5);
  CHECK(seen.size() == 5);
}

TEST_CASE("ddmin needs one test when the first element alone fails", "[ddmin]") {
  std::vector<std::vector<int>> seen;
  CHECK(ddmin<int>({7, 8}, needs({7}, &seen)).tests == 1);
  CHECK(ddmin<int>({7}, needs({7}, &seen)).tests == 0);  // already minimal
}

TEST_CASE("ddmin keeps an interacting pair and their order", "[ddmin]") {
  std::vector<std::vector<int>> seen;
  const auto result = ddmin<int>({1, 2, 3, 4, 5, 6, 7, 8}, needs({2, 7}, &seen));
  CHECK(result.minimal == std::vector<int>{2, 7});
  // 1-minimal: removing either element makes the failure go.
  CHECK_FALSE(needs({2, 7}, &seen)({2}));
  CHECK_FALSE(needs({2, 7}, &seen)({7}));
}

TEST_CASE("ddmin tests no subset twice", "[ddmin]") {
  std::vector<std::vector<int>> seen;
  ddmin<int>({1, 2, 3, 4, 5, 6, 7, 8, 9}, needs({1, 5, 9}, &seen));
  std::set<std::vector<int>> distinct(seen.begin(), seen.end());
  CHECK(distinct.size() == seen.size());
}
