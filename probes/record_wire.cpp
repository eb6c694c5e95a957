// Probe records as bytes; see record_wire.h.
#include "probes/record_wire.h"

#include <cstring>
#include <memory>
#include <stdexcept>

namespace nanreplay {

void WireWriter::text(const std::string& value) {
  pod<uint64_t>(value.size());
  bytes_ += value;
}

void WireWriter::ints(const std::vector<int64_t>& values) {
  pod<uint64_t>(values.size());
  for (int64_t v : values) pod(v);
}

void WireWriter::record(const ProbeRecord& r) {
  pod(r.step), pod(r.micro_batch), pod(r.rank), pod(r.phase), pod(r.order), pod(r.site);
  text(r.param);
  pod(r.layer), pod(r.head), pod(r.expert), pod(r.routed_tokens);
  ints(r.shape);
  pod(r.stats);
  ints(r.first_index);
  pod(r.sample), pod(r.position), pod(r.first_head), pod(r.first_expert), pod(r.headroom_bits);
  pod(r.largest_sample), pod(r.largest_position);  // a spike origin's element
  pod(r.damage != nullptr);
  if (r.damage) damage(*r.damage);
  pod(r.masked_score != nullptr);
  if (r.masked_score) masked_score(*r.masked_score);
}

void WireWriter::masked_score(const MaskedScore& m) {
  pod(m.batch_row), pod(m.sample), pod(m.head), pod(m.query);
  ints(m.keys);
  pod(m.key_count), pod(m.raw_score), pod(m.mask), pod(m.soft_capped);
}

void WireWriter::damage(const DamageShape& d) {
  pod(d.pattern);
  text(d.criterion);
  pod(d.count), pod(d.considered), pod(d.sampled), pod(d.rows_hit), pod(d.columns_hit), pod(d.heads_hit);
  pod(d.batch_row), pod(d.position), pod(d.sample), pod(d.column), pod(d.head);
  pod(d.block), pod(d.period), pod(d.blocks);
  pod(d.tensor_rows), pod(d.tensor_columns), pod(d.cell_rows), pod(d.cell_columns);
  text(d.rows_are), text(d.columns_are);
  pod<uint64_t>(d.map.size());
  for (const std::string& line : d.map) text(line);
}

void WireWriter::norm_check(const NormCheck& c) {
  pod(c.step), pod(c.micro_batch), pod(c.rank), pod(c.site), pod(c.layer);
  text(c.moment);
  pod(c.eps), pod(c.min_moment), pod(c.rows_below_eps), pod(c.zero_denominator), pod(c.sample), pod(c.position);
}

void WireReader::take(void* out, size_t n) {
  if (bytes_.size() - at_ < n) throw std::runtime_error("a peer's probe records ended early");
  std::memcpy(out, bytes_.data() + at_, n);
  at_ += n;
}

std::string WireReader::text() {
  const auto n = pod<uint64_t>();
  std::string out(n, '\0');
  take(out.data(), n);
  return out;
}

std::vector<int64_t> WireReader::ints() {
  std::vector<int64_t> out(pod<uint64_t>());
  for (int64_t& v : out) v = pod<int64_t>();
  return out;
}

ProbeRecord WireReader::record() {
  ProbeRecord r;
  r.step = pod<int64_t>(), r.micro_batch = pod<int>(), r.rank = pod<int>(), r.phase = pod<Phase>();
  r.order = pod<int>(), r.site = pod<SiteRef>();
  r.param = text();
  r.layer = pod<int>(), r.head = pod<int>(), r.expert = pod<int>(), r.routed_tokens = pod<int64_t>();
  r.shape = ints();
  r.stats = pod<TensorStats>();
  r.first_index = ints();
  r.sample = pod<int64_t>(), r.position = pod<int64_t>(), r.first_head = pod<int>(), r.first_expert = pod<int>();
  r.headroom_bits = pod<double>();
  r.largest_sample = pod<int64_t>(), r.largest_position = pod<int64_t>();
  if (pod<bool>()) r.damage = std::make_shared<const DamageShape>(damage());
  if (pod<bool>()) r.masked_score = std::make_shared<const MaskedScore>(masked_score());
  return r;
}

MaskedScore WireReader::masked_score() {
  MaskedScore m;
  m.batch_row = pod<int64_t>(), m.sample = pod<int64_t>(), m.head = pod<int>(), m.query = pod<int64_t>();
  m.keys = ints();
  if (m.keys.size() > kMaskedKeysListed) throw std::runtime_error("a peer's masked score lists too many keys");
  m.key_count = pod<int64_t>(), m.raw_score = pod<double>(), m.mask = pod<AttentionMask>();
  m.soft_capped = pod<bool>();
  return m;
}

DamageShape WireReader::damage() {
  DamageShape d;
  d.pattern = pod<DamagePattern>();
  d.criterion = text();
  d.count = pod<int64_t>(), d.considered = pod<int64_t>(), d.sampled = pod<bool>();
  d.rows_hit = pod<int64_t>(), d.columns_hit = pod<int64_t>(), d.heads_hit = pod<int64_t>();
  d.batch_row = pod<int64_t>(), d.position = pod<int64_t>(), d.sample = pod<int64_t>(), d.column = pod<int64_t>();
  d.head = pod<int>();
  d.block = pod<int64_t>(), d.period = pod<int64_t>(), d.blocks = pod<int64_t>();
  d.tensor_rows = pod<int64_t>(), d.tensor_columns = pod<int64_t>();
  d.cell_rows = pod<int64_t>(), d.cell_columns = pod<int64_t>();
  d.rows_are = text(), d.columns_are = text();
  const auto lines = pod<uint64_t>();
  if (lines > static_cast<uint64_t>(kDamageMapRows) + 1) throw std::runtime_error("a peer's damage map is too tall");
  for (uint64_t i = 0; i < lines; ++i) d.map.push_back(text());
  return d;
}

NormCheck WireReader::norm_check() {
  NormCheck c;
  c.step = pod<int64_t>(), c.micro_batch = pod<int>(), c.rank = pod<int>(), c.site = pod<SiteRef>();
  c.layer = pod<int>();
  // The norm's moment names are string literals (replay/arch/model.cpp): the two there are.
  c.moment = text() == "variance" ? "variance" : "mean square";
  c.eps = pod<double>(), c.min_moment = pod<double>(), c.rows_below_eps = pod<int64_t>();
  c.zero_denominator = pod<bool>(), c.sample = pod<int64_t>(), c.position = pod<int64_t>();
  return c;
}

}  // namespace nanreplay
