// The one glob of names: optimizer groups' `params` (loaders/bundle/optimizer_manifest.h),
// gradient clipping's exclusions and `nanreplay trace --site`.
#pragma once

#include <string>

namespace nanreplay {

// True when `name` matches the fnmatch-style `pattern`: `*` any run, `?` one character
// (Python's fnmatch without character classes). Backtracks to the last `*` only: linear
// in practice, quadratic at worst, never exponential.
inline bool glob_match(const std::string& pattern, const std::string& name) {
  size_t p = 0, n = 0, star = std::string::npos, mark = 0;
  while (n < name.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == name[n])) {
      ++p;
      ++n;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = n;
    } else if (star != std::string::npos) {
      p = star + 1;
      n = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

}  // namespace nanreplay
