// --what-if specs: what parses, and the one-line UsageError every malformed
// spec gets before anything is replayed (unknown kind, bad numbers, negative
// eps, layers out of range, damping a bundle that has no fp8 scales).
#include <catch2/catch.hpp>

#include "loaders/base/error.h"
#include "replay/workflows/what_if.h"

using nanreplay::Compute;
using nanreplay::Manifest;
using nanreplay::parse_what_if;
using nanreplay::UsageError;
using nanreplay::WhatIf;
using Catch::Matchers::Contains;

namespace {

Manifest two_layers(Compute compute) {
  Manifest m;
  m.model.num_layers = 2;
  m.precision.compute = compute;
  return m;
}

}  // namespace

TEST_CASE("what-if specs parse into their kind and values", "[what-if]") {
  const WhatIf drop = parse_what_if("drop-samples=12,40");
  CHECK(drop.kind == WhatIf::Kind::kDropSamples);
  CHECK(drop.samples == std::vector<int64_t>{12, 40});
  CHECK(drop.text == "drop-samples=12,40");
  CHECK(parse_what_if("fp32-layers=3,1").layers == std::vector<int>{3, 1});
  CHECK(parse_what_if("fp32-layers=all").all_layers);
  CHECK(parse_what_if("norm-eps=1e-5").value == 1e-5);
  CHECK(parse_what_if("norm-eps=0").value == 0.0);
  CHECK(parse_what_if("damp-fp8-scale").value == 3.0);
  CHECK(parse_what_if("damp-fp8-scale=1.5").value == 1.5);
  CHECK(parse_what_if("stable-softmax").kind == WhatIf::Kind::kStableSoftmax);
  CHECK(parse_what_if("router-fp32").kind == WhatIf::Kind::kRouterFp32);
  CHECK(parse_what_if("z-loss=1e-3").kind == WhatIf::Kind::kZLoss);
  CHECK(parse_what_if("z-loss=1e-3").value == 1e-3);
  CHECK(parse_what_if("z-loss=0").value == 0.0);
}

TEST_CASE("malformed what-if specs are usage errors naming the spec", "[what-if]") {
  CHECK_THROWS_WITH(parse_what_if("fp16-layers=1"), Contains("unknown kind 'fp16-layers'") && Contains("stable-softmax"));
  CHECK_THROWS_WITH(parse_what_if("norm-eps=-1e-5"), Contains("'norm-eps=-1e-5'") && Contains(">= 0"));
  CHECK_THROWS_WITH(parse_what_if("norm-eps=tiny"), Contains("not a number"));
  CHECK_THROWS_WITH(parse_what_if("norm-eps=nan"), Contains("not a number"));
  CHECK_THROWS_WITH(parse_what_if("norm-eps"), Contains("needs a value"));
  CHECK_THROWS_WITH(parse_what_if("drop-samples=3,-4"), Contains("'-4' is not a sample"));
  CHECK_THROWS_WITH(parse_what_if("drop-samples=3,3"), Contains("listed twice"));
  CHECK_THROWS_WITH(parse_what_if("drop-samples="), Contains("needs a value"));
  CHECK_THROWS_WITH(parse_what_if("drop-samples=3,"), Contains("list of samples"));
  CHECK_THROWS_WITH(parse_what_if("fp32-layers=one"), Contains("'one' is not a layer"));
  CHECK_THROWS_WITH(parse_what_if("damp-fp8-scale=0.5"), Contains(">= 1"));
  CHECK_THROWS_WITH(parse_what_if("stable-softmax=yes"), Contains("takes no value"));
  CHECK_THROWS_WITH(parse_what_if("router-fp32=yes"), Contains("takes no value"));
  CHECK_THROWS_WITH(parse_what_if("z-loss"), Contains("needs a value"));
  CHECK_THROWS_WITH(parse_what_if("z-loss=-0.1"), Contains(">= 0"));
  CHECK_THROWS_AS(parse_what_if("bogus"), UsageError);
}

TEST_CASE("what-ifs are checked against the bundle before replaying", "[what-if]") {
  const Manifest fp16 = two_layers(Compute::kFp16);
  CHECK_NOTHROW(check_what_if(parse_what_if("fp32-layers=0,1"), fp16));
  CHECK_THROWS_WITH(check_what_if(parse_what_if("fp32-layers=2"), fp16),
                    Contains("layer 2 is out of range") && Contains("2 layers (0-1)"));
  CHECK_THROWS_WITH(check_what_if(parse_what_if("damp-fp8-scale"), fp16), Contains("no fp8 scales"));
  CHECK_NOTHROW(check_what_if(parse_what_if("damp-fp8-scale"), two_layers(Compute::kFp8)));
  // The router what-ifs need a mixture of experts.
  CHECK_THROWS_WITH(check_what_if(parse_what_if("router-fp32"), fp16), Contains("no model.moe"));
  CHECK_THROWS_WITH(check_what_if(parse_what_if("z-loss=0.1"), fp16), Contains("no model.moe"));
  Manifest moe = fp16;
  moe.model.moe = nanreplay::MoeConfig{4, 2, 16, true, 0.0, 0.0};
  CHECK_NOTHROW(check_what_if(parse_what_if("router-fp32"), moe));
  CHECK_NOTHROW(check_what_if(parse_what_if("z-loss=0.1"), moe));
}

TEST_CASE("what_if_help shows every kind with an example", "[what-if]") {
  const std::string help = nanreplay::what_if_help();
  for (const char* example : {"drop-samples=12,40", "fp32-layers=2,3", "norm-eps=1e-5", "damp-fp8-scale=3",
                              "stable-softmax", "router-fp32", "z-loss=1e-3"}) {
    CHECK_THAT(help, Contains(example));
  }
}
