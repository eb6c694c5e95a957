// The one comparison of a number the job logged with the number the replay
// computed (losses, gradient norms, per-rank values): finite values agree
// within a relative tolerance, non-finite ones when they are of the same kind
// (NaN, +inf, -inf). A tolerance test alone is false for any non-finite
// value, which made a NaN logged where the replay gives NaN look like a
// disagreement; exact equality alone makes NaN never equal itself.
#pragma once

namespace nanreplay {

enum class ValueKind { kFinite, kNan, kPositiveInf, kNegativeInf };

ValueKind value_kind(double value);

// |replayed - logged| / |logged| (|logged| floored at 1e-12); +inf when the
// two are of different kinds, 0 when both are the same non-finite kind.
double logged_gap(double logged, double replayed);

// Whether the logged value is what the replay computed: see the header comment.
bool logged_agrees(double logged, double replayed, double relative_tolerance);

}  // namespace nanreplay
