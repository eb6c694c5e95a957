// Probe records, norm checks and tensors as bytes, for a replay split across
// processes (replay/step/ranks/distributed.h): each process probes its own blocks and
// every process reads every record back exactly (doubles as their bits).
// Both ends are the same build of nanreplay, so the layout is this file's
// and nothing else's: not a storage format.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "probes/probe_record.h"

namespace nanreplay {

class WireWriter {
 public:
  template <typename T>
  void pod(const T& value) {
    bytes_.append(reinterpret_cast<const char*>(&value), sizeof(T));
  }
  void text(const std::string& value);
  void ints(const std::vector<int64_t>& values);
  void record(const ProbeRecord& record);
  void norm_check(const NormCheck& check);
  void damage(const DamageShape& damage);
  void masked_score(const MaskedScore& masked);
  std::string take() { return std::move(bytes_); }

 private:
  std::string bytes_;
};

// Reads what WireWriter wrote; std::runtime_error if the bytes run out.
class WireReader {
 public:
  explicit WireReader(const std::string& bytes) : bytes_(bytes) {}
  template <typename T>
  T pod() {
    T value;
    take(&value, sizeof(T));
    return value;
  }
  std::string text();
  std::vector<int64_t> ints();
  ProbeRecord record();
  NormCheck norm_check();
  DamageShape damage();
  MaskedScore masked_score();
  bool done() const { return at_ == bytes_.size(); }

 private:
  void take(void* out, size_t n);
  const std::string& bytes_;
  size_t at_ = 0;
};

}  // namespace nanreplay
