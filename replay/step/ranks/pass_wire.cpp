// See pass_wire.h.
#include "replay/step/ranks/pass_wire.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include <torch/torch.h>

namespace nanreplay {

void write_tensor(WireWriter& out, const torch::Tensor& tensor) {
  out.pod<bool>(tensor.defined());
  if (!tensor.defined()) return;
  const torch::Tensor host = tensor.detach().cpu().contiguous();
  out.pod<int64_t>(static_cast<int64_t>(host.scalar_type()));
  out.ints(host.sizes().vec());
  out.text(std::string(static_cast<const char*>(host.data_ptr()), static_cast<size_t>(host.nbytes())));
}

torch::Tensor read_tensor(WireReader& in) {
  if (!in.pod<bool>()) return torch::Tensor();
  const auto type = static_cast<c10::ScalarType>(in.pod<int64_t>());
  const std::vector<int64_t> sizes = in.ints();
  const std::string bytes = in.text();
  torch::Tensor out = torch::empty(sizes, torch::TensorOptions().dtype(type));
  if (bytes.size() != static_cast<size_t>(out.nbytes())) throw std::runtime_error("a peer's tensor has the wrong size");
  std::memcpy(out.data_ptr(), bytes.data(), bytes.size());
  return out;
}

void write_tensors(WireWriter& out, const std::vector<torch::Tensor>& tensors) {
  out.pod<uint64_t>(tensors.size());
  for (const torch::Tensor& t : tensors) write_tensor(out, t);
}

std::vector<torch::Tensor> read_tensors(WireReader& in) {
  std::vector<torch::Tensor> out(in.pod<uint64_t>());
  for (torch::Tensor& t : out) t = read_tensor(in);
  return out;
}

void write_harvest(WireWriter& out, const ProbeHarvest& harvest) {
  for (const std::vector<ProbeRecord>* records : {&harvest.forward, &harvest.backward}) {
    out.pod<uint64_t>(records->size());
    for (const ProbeRecord& r : *records) out.record(r);
  }
  out.pod<uint64_t>(harvest.aliases.size());
  for (const auto& [ref, same_as] : harvest.aliases) out.pod(ref), out.pod(same_as);
  out.pod<uint64_t>(harvest.norm_checks.size());
  for (const NormCheck& c : harvest.norm_checks) out.norm_check(c);
}

ProbeHarvest read_harvest(WireReader& in) {
  ProbeHarvest harvest;
  for (std::vector<ProbeRecord>* records : {&harvest.forward, &harvest.backward}) {
    for (auto n = in.pod<uint64_t>(); n > 0; --n) records->push_back(in.record());
  }
  for (auto n = in.pod<uint64_t>(); n > 0; --n) {
    const auto ref = in.pod<SiteRef>();
    harvest.aliases.emplace_back(ref, in.pod<SiteRef>());
  }
  for (auto n = in.pod<uint64_t>(); n > 0; --n) harvest.norm_checks.push_back(in.norm_check());
  return harvest;
}

}  // namespace nanreplay
