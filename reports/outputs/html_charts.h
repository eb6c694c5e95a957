// The pictures of report.html as inline SVG (no script, no network): loss
// and gradient norm over the window as two small charts sharing the step
// axis, the origin site's max|x| per step on a log axis against the limit of
// the type it is held in, and the per-step strip. Axes are honest: norms and
// losses start at 0 so a flat curve stays flat, every axis has labelled
// ticks, and a non-finite value is a labelled marker on the top edge, never
// a point on the scale. Pure: each returns markup, or "" when it has nothing
// to draw.
#pragma once

#include <set>
#include <utility>
#include <string>

#include "reports/results/report.h"

namespace nanreplay {

// Every string put on the page goes through this (also for html_report.cpp).
std::string escape_html(const std::string& text);

// Loss (replayed and logged) above gradient norm (replayed and logged).
std::string svg_loss_and_grad_norm(const ReplayReport& report);

// The origin site's whole-tensor max|x| per step with probe records, against
// the held type's limit; "" without an origin.
std::string svg_origin_max_abs(const ReplayReport& report);

// One cell per step (or group of steps): the largest forward max|x|, red
// where something went non-finite, the steps with heatmaps outlined, and a
// labelled step axis. `detailed`: steps whose heatmaps the page shows.
// Its colour key (drawn beside it in HTML): the largest forward max|x| the
// lightest and darkest colours stand for, and the colour of t in [0, 1].
std::string svg_step_strip(const ReplayReport& report, const std::set<int64_t>& detailed);
std::pair<double, double> step_strip_range(const ReplayReport& report);
std::string step_strip_colour(double t);

}  // namespace nanreplay
