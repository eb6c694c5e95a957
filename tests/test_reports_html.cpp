// report.html's pictures on hand-built reports: a flat loss stays flat on an
// axis from 0, a non-finite value is a labelled marker rather than a point,
// the origin's max|x| is drawn against the limit its probe measured, the
// consequence entries are folded into a closed <details>, evidence is a
// table, and values near the double's limit still give a bounded page.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <regex>
#include <string>

#include "reports/outputs/html_charts.h"
#include "reports/outputs/html_report.h"

using namespace nanreplay;
using K = EvidenceKey;

namespace {

StepOutcome flat_step(int64_t number, double loss) {
  StepOutcome s;
  s.step = number;
  s.replayed = true;
  s.loss = loss;
  s.logged_loss = loss;
  s.grad_norm = std::isfinite(loss) ? 1.25 : loss;
  s.finite = std::isfinite(loss);
  s.probe_summary.probed = true;
  s.probe_summary.forward_max_abs = 3.0;
  s.probe_summary.nonfinite_records = s.finite ? 0 : 1;
  return s;
}

ProbeRecord scores(int64_t step, double max_abs, int64_t inf_count) {
  ProbeRecord r;
  r.step = step;
  r.micro_batch = 0;
  r.rank = 0;
  r.site = {SiteId::kAttnScores, 1};
  r.layer = 1;
  r.stats.max_abs = max_abs;
  r.stats.inf_count = inf_count;
  r.headroom_bits = std::log2(65504.0 / max_abs);
  return r;
}

// Four steps at a flat loss of 2.30, the fourth non-finite at layers.1.attn.scores.
ReplayReport flat_then_inf() {
  ReplayReport report;
  report.precision = Compute::kFp16;
  for (int64_t step = 100; step < 103; ++step) report.steps.push_back(flat_step(step, 2.30));
  report.steps.push_back(flat_step(103, std::numeric_limits<double>::quiet_NaN()));
  for (int64_t step = 100; step < 104; ++step) report.probes.push_back(scores(step, 0.5 + step - 100, step == 103));
  FirstNonfinite first;
  first.step = 103;
  first.site = {SiteId::kAttnScores, 1};
  first.layer = 1;
  first.head = 2;
  first.kind = NonfiniteKind::kPosInf;
  report.first_nonfinite = first;
  report.reproduced = true;
  report.findings.push_back(make_finding(FindingCode::kNumericOverflow, Severity::kError, "overflowed",
                                         {{K::kSite, "layers.1.attn.scores"}, {K::kSteps, std::vector<int64_t>{103, 104}}}));
  report.findings.push_back(make_finding(FindingCode::kDataLossOutlier, Severity::kInfo,
                                         "consequences, not properties of those samples",
                                         {{K::kConsequence, true}, {K::kStep, 103}}));
  return report;
}

// The text of every <text class="tick"> of the SVG whose aria-label is `label`.
std::vector<std::string> ticks_of(const std::string& html, const std::string& label) {
  const size_t begin = html.find("aria-label=\"" + label + "\"");
  REQUIRE(begin != std::string::npos);
  const std::string svg = html.substr(begin, html.find("</svg>", begin) - begin);
  std::vector<std::string> ticks;
  const std::regex tick("class=\"tick\">([^<]*)<");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), tick); it != std::sregex_iterator(); ++it) {
    ticks.push_back((*it)[1]);
  }
  return ticks;
}

}  // namespace

TEST_CASE("report.html draws a flat loss flat, marks non-finite values and folds consequences away",
          "[reports][html]") {
  const std::string html = render_html(flat_then_inf());
  const std::vector<std::string> loss = ticks_of(html, "loss per step");
  REQUIRE(loss.size() >= 3);
  CHECK(loss.front() == "0");  // from 0: 2.30 +- nothing is not stretched over the chart
  CHECK(std::stod(loss.back()) >= 2.3);
  CHECK(std::stod(loss.back()) <= 3.0);
  CHECK(ticks_of(html, "gradient norm per step").front() == "0");
  CHECK(html.find("nan at step 103") != std::string::npos);  // off the scale, labelled

  // The origin's max|x| on a log axis, the limit its probes measured drawn and named.
  const std::vector<std::string> origin = ticks_of(html, "max|x| of layers.1.attn.scores per step, log scale");
  REQUIRE(!origin.empty());
  CHECK(origin.front() == "1e-1");
  CHECK(origin.back() == "1e5");
  CHECK(html.find("limit of the type it is held in: 65504") != std::string::npos);
  CHECK(html.find("inf at step 103") != std::string::npos);
  CHECK(html.find("id=\"step-strip\"") != std::string::npos);

  // Evidence as a table, lists readable; the consequence entry folded and closed.
  CHECK(html.find("<tr><th>steps</th><td>103, 104</td></tr>") != std::string::npos);
  const size_t folded = html.find("<details class=\"consequences\">");
  REQUIRE(folded != std::string::npos);
  const size_t consequence = html.find("consequences, not properties");
  CHECK(consequence > folded);
  CHECK(consequence < html.find("</details>", folded));
  CHECK(html.find("key=value") == std::string::npos);
}

TEST_CASE("report.html stays bounded and well-formed for values near the double's limit", "[reports][html]") {
  ReplayReport report = flat_then_inf();
  report.steps[0].loss = std::numeric_limits<double>::max();
  report.steps[1].logged_loss = -std::numeric_limits<double>::max();
  report.steps[2].grad_norm = std::numeric_limits<double>::denorm_min();
  report.probes[0].stats.max_abs = std::numeric_limits<double>::denorm_min();
  const std::string html = render_html(report);
  CHECK(html.size() < 200000);
  for (const char* bad : {"=\"nan", "=\"-nan", ",nan", ",-nan", "=\"inf", "=\"-inf", ",inf", ",-inf"}) {
    INFO(bad);
    CHECK(html.find(bad) == std::string::npos);  // no coordinate is NaN or infinite
  }
  CHECK(ticks_of(html, "loss per step").size() <= 13);
}
