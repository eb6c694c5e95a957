// Inline SVG charts of report.html (reports/outputs/html_charts.h). Every chart is a
// fixed viewBox scaled by CSS to its column, so it fits a phone as well as a
// desktop without a script.
#include "reports/outputs/html_charts.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <vector>

#include "loaders/base/error.h"
#include "reports/results/number_text.h"

namespace nanreplay {

std::string escape_html(const std::string& text) {
  std::string out;
  for (char c : printable(text)) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

namespace {

constexpr double kWidth = 560, kLeft = 66, kRight = 18, kTop = 26, kBottom = 28;
constexpr size_t kStripCells = 400;  // long windows: at most this many strip cells
const char* kAxisText = "font-size=\"11\" fill=\"#5c6373\"";

std::string coord(double value) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.1f", value);
  return buffer;
}

std::string number(double value) { return escape_html(format_number(value)); }

// A round tick spacing (1, 2 or 5 times a power of ten) giving about `ticks` intervals.
double nice_tick(double range, int ticks) {
  const double raw = range / ticks;
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0}) {
    if (m * power >= raw) return m * power;
  }
  return 10.0 * power;
}

// A value off the scale: a red marker on the top edge at x, and its label on
// the side with room (left of the marker in the right half, else right).
std::string top_marker(double x, const std::string& label) {
  const bool left = x > kWidth / 2;
  std::ostringstream out;
  out << "<path class=\"nonfinite\" d=\"M" << coord(x - 5) << " " << kTop - 9 << "h10l-5 8z\" fill=\"#e03131\"/>";
  if (!label.empty()) {
    out << "<text class=\"nonfinite-label\" x=\"" << coord(left ? x - 8 : x + 8) << "\" y=\"" << kTop - 2 << "\" text-anchor=\""
        << (left ? "end" : "start") << "\" font-size=\"11\" font-weight=\"700\" fill=\"#e03131\">"
        << (left ? label + " &#8594;" : "&#8592; " + label) << "</text>";
  }
  return out.str();
}

// The step axis shared by every chart: index i of report.steps to x.
struct StepAxis {
  size_t n = 0;
  double x(size_t i) const {
    return kLeft + (n <= 1 ? 0.5 : static_cast<double>(i) / static_cast<double>(n - 1)) * (kWidth - kLeft - kRight);
  }
};

std::string step_ticks(const ReplayReport& report, const StepAxis& axis, double baseline) {
  std::ostringstream out;
  const size_t every = std::max<size_t>(1, (axis.n + 7) / 8);
  for (size_t i = 0; i < axis.n; i += every) {
    out << "<line x1=\"" << coord(axis.x(i)) << "\" y1=\"" << baseline << "\" x2=\"" << coord(axis.x(i)) << "\" y2=\""
        << baseline + 4 << "\" stroke=\"#adb5bd\"/><text x=\"" << coord(axis.x(i)) << "\" y=\"" << baseline + 16
        << "\" text-anchor=\"middle\" " << kAxisText << ">" << report.steps[i].step << "</text>";
  }
  out << "<text x=\"" << kLeft - 22 << "\" y=\"" << baseline + 16 << "\" text-anchor=\"end\" " << kAxisText
      << " class=\"axis-name\">step</text>";
  return out.str();
}

struct Series {
  std::string label;
  const char* colour;
  bool dashed;
  std::vector<std::optional<double>> values;  // one per step; none: not available
};

// One panel of the small multiples: a linear axis from 0 (or below, for a
// negative value) to a round value above the largest finite one.
std::string linear_chart(const ReplayReport& report, const std::string& title, const std::vector<Series>& series) {
  const StepAxis axis{report.steps.size()};
  double low = 0, high = 0;
  bool any = false;
  for (const Series& s : series) {
    for (const auto& v : s.values) {
      if (v && std::isfinite(*v)) low = std::min(low, *v), high = std::max(high, *v), any = true;
    }
  }
  if (!any) return "";
  if (!(high / 2 - low / 2 > 1e-300)) high = low + 1;  // all equal (or denormal): a unit range
  // Halves throughout: finite even for a range from -max to max of a double.
  const double tick = nice_tick(high / 2 - low / 2, 2);
  const double rounded_low = std::floor(low / tick) * tick, rounded_high = std::ceil(high * 1.02 / tick) * tick;
  if (std::isfinite(rounded_low)) low = rounded_low;  // else values near the double's limit: keep them as they are
  if (std::isfinite(rounded_high)) high = rounded_high;
  const double height = 170, bottom_y = height - kBottom;
  auto y_of = [&](double v) { return kTop + (1.0 - (v / 2 - low / 2) / (high / 2 - low / 2)) * (bottom_y - kTop); };
  std::ostringstream out;
  out << "<svg class=\"chart\" viewBox=\"0 0 " << kWidth << " " << height << "\" role=\"img\" aria-label=\""
      << escape_html(title) << " per step\">";
  for (int k = 0; k <= 12; ++k) {  // bounded whatever the values
    const double v = low + k * tick;
    if (!std::isfinite(v) || v - tick / 2 > high) break;
    out << "<line x1=\"" << kLeft << "\" y1=\"" << coord(y_of(v)) << "\" x2=\"" << kWidth - kRight << "\" y2=\""
        << coord(y_of(v)) << "\" stroke=\"#eef0f3\"/><text x=\"" << kLeft - 6 << "\" y=\"" << coord(y_of(v) + 4)
        << "\" text-anchor=\"end\" " << kAxisText << " class=\"tick\">" << number(std::abs(v) < tick / 1e6 ? 0 : v)
        << "</text>";
  }
  out << "<line x1=\"" << kLeft << "\" y1=\"" << bottom_y << "\" x2=\"" << kWidth - kRight << "\" y2=\"" << bottom_y
      << "\" stroke=\"#868e96\"/>" << step_ticks(report, axis, bottom_y);
  std::ostringstream legend;
  bool labelled_gap = false;  // one label per chart: the series' markers would overlap
  for (const Series& s : series) {
    std::string points;
    auto flush = [&] {  // a run of finite points; a non-finite one leaves a gap
      if (!points.empty()) {
        out << "<polyline fill=\"none\" stroke=\"" << s.colour << "\" stroke-width=\"" << (s.dashed ? 1.5 : 2.5) << "\""
            << (s.dashed ? " stroke-dasharray=\"5,4\"" : "") << " points=\"" << points << "\"/>";
      }
      points.clear();
    };
    for (size_t i = 0; i < axis.n; ++i) {
      if (!s.values[i]) continue;
      const double v = *s.values[i];
      if (std::isfinite(v)) {
        points += coord(axis.x(i)) + "," + coord(y_of(v)) + " ";
        if (axis.n <= 60) out << "<circle cx=\"" << coord(axis.x(i)) << "\" cy=\"" << coord(y_of(v)) << "\" r=\"2.5\" fill=\"" << s.colour << "\"/>";
        continue;
      }
      flush();
      // Off the scale: a red marker on the top edge, named once per chart.
      out << top_marker(axis.x(i), labelled_gap ? "" : number(v) + " at step " + std::to_string(report.steps[i].step));
      labelled_gap = true;
    }
    flush();
    legend << " <span style=\"color:" << s.colour << "\">" << (s.dashed ? "- - " : "&#9644; ") << escape_html(s.label)
           << "</span>";
  }
  out << "</svg>";
  // The title and key above the picture, in the page's text: the top edge is the markers'.
  return "<div class=\"chart-title\">" + escape_html(title) + legend.str() + "</div>" + out.str();
}

}  // namespace

std::string svg_loss_and_grad_norm(const ReplayReport& report) {
  if (report.steps.empty()) return "";
  Series loss{"replayed", "#1c7ed6", false, {}}, logged_loss{"logged", "#f08c00", true, {}};
  Series norm{"replayed", "#1c7ed6", false, {}}, logged_norm{"logged", "#f08c00", true, {}};
  for (const StepOutcome& s : report.steps) {
    loss.values.push_back(s.replayed ? std::optional<double>(s.loss) : std::nullopt);
    logged_loss.values.push_back(s.logged_loss);
    norm.values.push_back(s.replayed ? std::optional<double>(s.grad_norm) : std::nullopt);
    logged_norm.values.push_back(s.logged_grad_norm);
  }
  const std::string top = linear_chart(report, "loss", {loss, logged_loss});
  const std::string below = linear_chart(report, "gradient norm", {norm, logged_norm});
  if (top.empty() && below.empty()) return "";
  return "<div class=\"charts\" id=\"loss-charts\">" + top + below + "</div>";
}

namespace {

// The origin site at one step: the largest finite max|x| over micro-batches
// and ranks, whether anything was non-finite, and the held type's limit
// (max|x| * 2^headroom, as the probe measured it: never assumed).
struct SiteAtStep {
  double max_abs = 0;
  int64_t nan_count = 0, inf_count = 0;
};

struct OriginSeries {
  std::map<int64_t, SiteAtStep> steps;
  double limit = 0;  // 0: unknown
};

OriginSeries origin_series(const ReplayReport& report) {
  OriginSeries series;
  const FirstNonfinite& f = *report.first_nonfinite;
  for (const ProbeRecord& r : report.probes) {
    if (!is_whole(r) || r.phase != f.phase || probe_name(r) != f.name()) continue;
    SiteAtStep& at = series.steps[r.step];
    if (std::isfinite(r.stats.max_abs)) at.max_abs = std::max(at.max_abs, r.stats.max_abs);
    at.nan_count += r.stats.nan_count;
    at.inf_count += r.stats.inf_count;
    const double limit = r.stats.max_abs * std::exp2(r.headroom_bits);
    if (series.limit == 0 && r.stats.max_abs > 0 && std::isfinite(limit)) series.limit = limit;
  }
  return series;
}

}  // namespace

std::string svg_origin_max_abs(const ReplayReport& report) {
  if (!report.first_nonfinite) return "";
  const OriginSeries series = origin_series(report);
  double low = std::numeric_limits<double>::infinity(), high = series.limit;
  for (const auto& [step, at] : series.steps) {
    if (at.max_abs > 0) low = std::min(low, at.max_abs), high = std::max(high, at.max_abs);
  }
  if (!std::isfinite(low)) return "";
  const double low_decade = std::floor(std::log10(low)), high_decade = std::max(low_decade + 1, std::ceil(std::log10(high)));
  const double decades_per_tick = std::max(1.0, std::ceil((high_decade - low_decade) / 6));
  const double height = 190, bottom_y = height - kBottom;
  auto y_of_log = [&](double l) { return kTop + (1.0 - (l - low_decade) / (high_decade - low_decade)) * (bottom_y - kTop); };
  auto y_of = [&](double v) { return y_of_log(std::log10(v)); };
  const StepAxis axis{report.steps.size()};
  std::map<int64_t, size_t> index_of;
  for (size_t i = 0; i < report.steps.size(); ++i) index_of[report.steps[i].step] = i;
  const std::string site = report.first_nonfinite->name();
  std::ostringstream out;
  out << "<div class=\"chart-title\">max|x| of <code>" << escape_html(site) << "</code> (log scale)</div>"
      << "<svg class=\"chart\" id=\"origin-chart\" viewBox=\"0 0 " << kWidth << " " << height << "\" role=\"img\" aria-label=\"max|x| of "
      << escape_html(site) << " per step, log scale\">";
  for (double d = low_decade; d <= high_decade + 1e-9; d += decades_per_tick) {
    const double y = y_of_log(d);  // not via 10^d: below 1e-308 that is 0
    out << "<line x1=\"" << kLeft << "\" y1=\"" << coord(y) << "\" x2=\"" << kWidth - kRight << "\" y2=\"" << coord(y)
        << "\" stroke=\"#eef0f3\"/><text x=\"" << kLeft - 6 << "\" y=\"" << coord(y + 4) << "\" text-anchor=\"end\" "
        << kAxisText << " class=\"tick\">1e" << static_cast<int>(d) << "</text>";
  }
  out << "<line x1=\"" << kLeft << "\" y1=\"" << bottom_y << "\" x2=\"" << kWidth - kRight << "\" y2=\"" << bottom_y
      << "\" stroke=\"#868e96\"/>" << step_ticks(report, axis, bottom_y);
  if (series.limit > 0) {
    out << "<line class=\"limit\" x1=\"" << kLeft << "\" y1=\"" << coord(y_of(series.limit)) << "\" x2=\"" << kWidth - kRight
        << "\" y2=\"" << coord(y_of(series.limit)) << "\" stroke=\"#e03131\" stroke-dasharray=\"6,3\"/><text x=\""
        << kLeft + 6 << "\" y=\"" << coord(y_of(series.limit) + 14) << "\" font-size=\"11\" fill=\"#e03131\">"
        << "limit of the type it is held in: " << number(series.limit) << "</text>";
  }
  std::string points;
  for (const auto& [step, at] : series.steps) {
    const auto i = index_of.find(step);
    if (i == index_of.end()) continue;
    const double x = axis.x(i->second);
    if (at.max_abs > 0) {
      points += coord(x) + "," + coord(y_of(at.max_abs)) + " ";
      out << "<circle cx=\"" << coord(x) << "\" cy=\"" << coord(y_of(at.max_abs)) << "\" r=\"3\" fill=\"#1c7ed6\"><title>step "
          << step << ": max|x| " << number(at.max_abs) << "</title></circle>";
    }
    if (at.nan_count + at.inf_count > 0) {
      out << top_marker(x, std::string(at.inf_count > 0 ? "inf" : "nan") + " at step " + std::to_string(step));
    }
  }
  out << "<polyline fill=\"none\" stroke=\"#1c7ed6\" stroke-width=\"2\" points=\"" << points << "\"/></svg>";
  return out.str();
}

namespace {

// log10 of the largest forward max|x| over the probed steps, as a colour
// scale: [low, high], or nothing when no step was probed.
std::optional<std::pair<double, double>> strip_scale(const ReplayReport& report) {
  double low = std::numeric_limits<double>::infinity(), high = -low;
  for (const StepOutcome& s : report.steps) {
    if (s.probe_summary.probed && s.probe_summary.forward_max_abs > 0) {
      low = std::min(low, std::log10(s.probe_summary.forward_max_abs));
      high = std::max(high, std::log10(s.probe_summary.forward_max_abs));
    }
  }
  if (!std::isfinite(low)) return std::nullopt;
  return std::make_pair(low, std::max(high, low + 1.0));
}

}  // namespace

std::string step_strip_colour(double t) {  // light to dark blue: larger is darker
  t = std::clamp(t, 0.0, 1.0);
  char buffer[40];
  std::snprintf(buffer, sizeof(buffer), "rgb(%d,%d,%d)", static_cast<int>(208 - 180 * t), static_cast<int>(228 - 150 * t),
                static_cast<int>(250 - 90 * t));
  return buffer;
}

std::pair<double, double> step_strip_range(const ReplayReport& report) {
  const auto scale = strip_scale(report);
  if (!scale) return {0.0, 0.0};
  return {std::pow(10.0, scale->first), std::pow(10.0, scale->second)};
}

std::string svg_step_strip(const ReplayReport& report, const std::set<int64_t>& detailed) {
  const size_t n = report.steps.size();
  const auto scale = strip_scale(report);
  if (n < 2 || !scale) return "";
  const size_t per_cell = (n + kStripCells - 1) / kStripCells;
  const size_t cells = (n + per_cell - 1) / per_cell;
  const double height = 66, cell_top = 6, cell_height = 30, cell_width = (kWidth - kLeft - kRight) / static_cast<double>(cells);
  std::ostringstream out;
  out << "<svg class=\"chart\" id=\"step-strip\" viewBox=\"0 0 " << kWidth << " " << height << "\" role=\"img\" "
      << "aria-label=\"largest forward max|x| per step\"><text x=\"" << kLeft - 6 << "\" y=\"" << cell_top + 19
      << "\" text-anchor=\"end\" " << kAxisText << ">max|x|</text>";
  for (size_t c = 0; c < cells; ++c) {
    const size_t begin = c * per_cell, end = std::min(n, begin + per_cell);
    double largest = 0;
    bool nonfinite = false, shown_below = false;
    for (size_t i = begin; i < end; ++i) {
      const StepOutcome& s = report.steps[i];
      largest = std::max(largest, s.probe_summary.forward_max_abs);
      nonfinite = nonfinite || s.probe_summary.nonfinite_records > 0 || (s.replayed && !s.finite);
      shown_below = shown_below || detailed.count(s.step) > 0;
    }
    const std::string steps = begin + 1 == end ? "step " + std::to_string(report.steps[begin].step)
                                               : "steps " + std::to_string(report.steps[begin].step) + "-" +
                                                     std::to_string(report.steps[end - 1].step);
    const double t = largest > 0 ? (std::log10(largest) - scale->first) / (scale->second - scale->first) : 0.0;
    out << "<rect x=\"" << coord(kLeft + c * cell_width) << "\" y=\"" << cell_top << "\" width=\""
        << coord(std::max(1.0, cell_width - (cells > 100 ? 0 : 1))) << "\" height=\"" << cell_height << "\" fill=\""
        << (nonfinite ? "#e03131" : step_strip_colour(t)) << "\"" << (shown_below ? " stroke=\"#000\" stroke-width=\"2\"" : "")
        << "><title>" << steps << ": max|x| " << number(largest) << (nonfinite ? ", non-finite" : "")
        << (shown_below ? " (heatmaps below)" : "") << "</title></rect>";
  }
  const size_t every = std::max<size_t>(1, (cells + 7) / 8);
  for (size_t c = 0; c < cells; c += every) {
    const double x = kLeft + (c + 0.5) * cell_width;
    out << "<text x=\"" << coord(x) << "\" y=\"" << cell_top + cell_height + 16 << "\" text-anchor=\"middle\" "
        << kAxisText << ">" << report.steps[c * per_cell].step << "</text>";
  }
  out << "<text x=\"" << kLeft - 22 << "\" y=\"" << cell_top + cell_height + 16 << "\" text-anchor=\"end\" " << kAxisText
      << ">step</text></svg>";
  return out.str();
}

}  // namespace nanreplay
