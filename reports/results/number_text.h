// Numbers as people read them in messages and pages: shared by the finding
// messages (triage), the library's errors and every renderer, so none of
// them includes another's rendering code.
#pragma once

#include <cstdint>
#include <string>

namespace nanreplay {

// "nan", "inf", "-inf", or up to 6 significant digits.
std::string format_number(double value);
// A fraction as a percentage with 3 significant digits: 0.1742 -> "17.4%".
std::string format_percent(double fraction);
// An index, or "-" where it does not apply (a negative value).
inline std::string or_dash(int64_t value) { return value >= 0 ? std::to_string(value) : "-"; }

}  // namespace nanreplay
