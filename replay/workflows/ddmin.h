// Delta debugging (Zeller and Hildebrandt, "Simplifying and Isolating
// Failure-Inducing Input", 2002): ddmin shrinks a failing input to a
// 1-minimal one, from which removing any single element makes the failure go.
// Generic and torch-free: the bisection's test is one replay of a subset of a
// step's samples. Each distinct subset is tested at most once, so the number
// of calls to `fails` is the number of replays.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <set>
#include <vector>

namespace nanreplay {

template <typename T>
struct DdminResult {
  std::vector<T> minimal;
  int64_t tests = 0;  // calls to `fails`
};

// `failing` must fail (the caller knows it does); order is kept throughout.
template <typename T>
DdminResult<T> ddmin(const std::vector<T>& failing, const std::function<bool(const std::vector<T>&)>& fails) {
  DdminResult<T> result;
  std::set<std::vector<T>> passed;  // subsets already seen to pass
  auto test = [&](const std::vector<T>& subset) {
    if (passed.count(subset)) return false;
    ++result.tests;
    if (fails(subset)) return true;
    passed.insert(subset);
    return false;
  };
  // Splits `c` into `n` contiguous chunks whose sizes differ by at most one.
  auto split = [](const std::vector<T>& c, size_t n) {
    std::vector<std::vector<T>> parts;
    size_t begin = 0;
    for (size_t i = 0; i < n; ++i) {
      const size_t end = begin + (c.size() - begin) / (n - i);
      parts.emplace_back(c.begin() + static_cast<std::ptrdiff_t>(begin), c.begin() + static_cast<std::ptrdiff_t>(end));
      begin = end;
    }
    return parts;
  };
  std::vector<T> c = failing;
  size_t n = 2;
  while (c.size() >= 2) {
    const std::vector<std::vector<T>> parts = split(c, n);
    bool reduced = false;
    for (const std::vector<T>& part : parts) {  // reduce to a subset
      if (test(part)) {
        c = part;
        n = 2;
        reduced = true;
        break;
      }
    }
    // Reduce to a complement; with two parts the complements are the parts themselves.
    for (size_t i = 0; !reduced && n > 2 && i < parts.size(); ++i) {
      std::vector<T> complement;
      for (size_t j = 0; j < parts.size(); ++j) {
        if (j != i) complement.insert(complement.end(), parts[j].begin(), parts[j].end());
      }
      if (test(complement)) {
        c = complement;
        n = std::max<size_t>(n - 1, 2);
        reduced = true;
      }
    }
    if (reduced) continue;
    if (n >= c.size()) break;  // every single element removed once: 1-minimal
    n = std::min(c.size(), 2 * n);
  }
  result.minimal = c;
  return result;
}

}  // namespace nanreplay
