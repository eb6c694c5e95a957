// fp8 quantize-dequantize emulation: round to nearest even on the e4m3 / e5m2
// grids, subnormals, saturation, and non-finite pass-through.
#include <catch2/catch.hpp>

#include <torch/torch.h>

#include "replay/probing/numerics.h"

using nanreplay::fp8_quantize_dequantize;

namespace {
float qdq(float x, double scale, const std::string& format) {
  return fp8_quantize_dequantize(torch::tensor({x}), scale, format).item<float>();
}
}  // namespace

TEST_CASE("e4m3 rounds to its 3-bit mantissa grid and saturates at 448", "[torch][fp8]") {
  CHECK(qdq(0.3f, 1.0, "e4m3") == 0.3125f);       // spacing 2^-5 in [0.25, 0.5)
  CHECK(qdq(1.0f, 1.0, "e4m3") == 1.0f);
  CHECK(qdq(1.0625f, 1.0, "e4m3") == 1.0f);       // a tie rounds to even
  CHECK(qdq(1.1875f, 1.0, "e4m3") == 1.25f);      // a tie rounds to even (up)
  CHECK(qdq(1000.0f, 1.0, "e4m3") == 448.0f);
  CHECK(qdq(-1000.0f, 1.0, "e4m3") == -448.0f);
  CHECK(qdq(0.001f, 1.0, "e4m3") == 0.001953125f);  // subnormal spacing 2^-9
  CHECK(qdq(0.0f, 1.0, "e4m3") == 0.0f);
}

TEST_CASE("e5m2 rounds to its 2-bit mantissa grid and saturates at 57344", "[torch][fp8]") {
  CHECK(qdq(1000.0f, 1.0, "e5m2") == 1024.0f);
  CHECK(qdq(1e6f, 1.0, "e5m2") == 57344.0f);
  CHECK(qdq(3.0f, 1.0, "e5m2") == 3.0f);
  CHECK(qdq(3.4f, 1.0, "e5m2") == 3.5f);
}

TEST_CASE("the scale multiplies before and divides after, and non-finite passes through", "[torch][fp8]") {
  CHECK(qdq(0.3f, 16.0, "e4m3") == 0.3125f);  // 4.8 -> 5 / 16
  CHECK(qdq(100.0f, 16.0, "e4m3") == 28.0f);    // 1600 saturates to 448 / 16
  CHECK(std::isinf(qdq(INFINITY, 1.0, "e4m3")));
  CHECK(std::isnan(qdq(NAN, 1.0, "e5m2")));
  CHECK(std::isnan(qdq(1.0f, INFINITY, "e4m3")));  // a non-finite scale propagates
}
