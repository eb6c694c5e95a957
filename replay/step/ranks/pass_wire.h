// What a replay split across processes (replay/step/ranks/distributed.h) sends about a
// pass: tensors of any type and one process's probes (ProbeHarvest), as
// bytes for ProcessWorld::all_gather, on top of probes/record_wire.h.
#pragma once

#include <vector>

#include <torch/types.h>

#include "probes/record_wire.h"
#include "replay/probing/probe_session.h"

namespace nanreplay {

void write_tensor(WireWriter& out, const torch::Tensor& tensor);  // undefined included
torch::Tensor read_tensor(WireReader& in);                         // a new host tensor
// A list of them, its length first (model.mtp's depth losses).
void write_tensors(WireWriter& out, const std::vector<torch::Tensor>& tensors);
std::vector<torch::Tensor> read_tensors(WireReader& in);
void write_harvest(WireWriter& out, const ProbeHarvest& harvest);
ProbeHarvest read_harvest(WireReader& in);

}  // namespace nanreplay
