// Test data for the statistics kernels, shared by the CPU kernel's tests and
// the CUDA kernel's comparison with it: buffers of f32/bf16/f16 values with
// NaN, +-inf, zeros, subnormals and extremes planted at random positions, and
// decoders written from the format definitions rather than bit tricks.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/tensor_stats.h"

namespace nanreplay::test {

// Every element type the statistics kernels take.
inline constexpr ElemType kAllTypes[] = {ElemType::kF32, ElemType::kBF16, ElemType::kF16};

// --- Reference decoders.

inline float reference_f16(uint16_t bits) {
  const int exponent = (bits >> 10) & 0x1F;
  const int mantissa = bits & 0x3FF;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(float(mantissa), -24);
  } else if (exponent == 31) {
    magnitude = mantissa == 0 ? std::numeric_limits<float>::infinity()
                              : std::numeric_limits<float>::quiet_NaN();
  } else {
    magnitude = std::ldexp(float(1024 + mantissa), exponent - 25);
  }
  return (bits & 0x8000) ? -magnitude : magnitude;
}

inline float reference_bf16(uint16_t bits) {
  const int exponent = (bits >> 7) & 0xFF;
  const int mantissa = bits & 0x7F;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(float(mantissa), -133);
  } else if (exponent == 255) {
    magnitude = mantissa == 0 ? std::numeric_limits<float>::infinity()
                              : std::numeric_limits<float>::quiet_NaN();
  } else {
    magnitude = std::ldexp(float(128 + mantissa), exponent - 134);
  }
  return (bits & 0x8000) ? -magnitude : magnitude;
}

inline uint32_t float_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

inline float float_from_bits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

inline const char* type_name(ElemType type) {
  switch (type) {
    case ElemType::kF32: return "f32";
    case ElemType::kBF16: return "bf16";
    case ElemType::kF16: return "f16";
  }
  return "?";
}

// --- Test buffers.

enum class Special { kNan, kPosInf, kNegInf, kZero, kNegZero, kSubnormal, kMaxFinite };

// A buffer in one element type; value(i) decodes through the reference decoders.
struct TestBuffer {
  ElemType type;
  std::vector<float> f32;
  std::vector<uint16_t> half;  // bf16 or f16 bits

  TestBuffer(ElemType elem_type, int64_t n) : type(elem_type) {
    if (type == ElemType::kF32) {
      f32.resize(size_t(n));
    } else {
      half.resize(size_t(n));
    }
  }
  int64_t size() const { return int64_t(type == ElemType::kF32 ? f32.size() : half.size()); }
  const void* data() const {
    return type == ElemType::kF32 ? static_cast<const void*>(f32.data()) : half.data();
  }
  float value(int64_t i) const {
    switch (type) {
      case ElemType::kF32: return f32[size_t(i)];
      case ElemType::kBF16: return reference_bf16(half[size_t(i)]);
      case ElemType::kF16: return reference_f16(half[size_t(i)]);
    }
    return 0.0f;
  }
  void set_bits(int64_t i, uint32_t bits) {
    if (type == ElemType::kF32) {
      f32[size_t(i)] = float_from_bits(bits);
    } else {
      half[size_t(i)] = uint16_t(bits);
    }
  }

  // An ordinary value of typical magnitude (exponents spread over +-2^10).
  void set_random(int64_t i, std::mt19937& rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_int_distribution<int> exponent(-10, 10);
    if (type == ElemType::kF16) {
      const uint32_t bits = rng();
      set_bits(i, (bits & 0x8000u) | uint32_t(5 + (bits >> 16) % 21) << 10 | (bits & 0x3FFu));
      return;
    }
    const float x = std::ldexp(normal(rng), exponent(rng));
    set_bits(i, type == ElemType::kF32 ? float_bits(x) : float_bits(x) >> 16);
  }

  void set_special(int64_t i, Special special, std::mt19937& rng) {
    const bool f32_type = type == ElemType::kF32, f16_type = type == ElemType::kF16;
    const uint32_t sign = f32_type ? 0x80000000u : 0x8000u;
    const uint32_t inf = f32_type ? 0x7F800000u : f16_type ? 0x7C00u : 0x7F80u;
    const uint32_t mantissa_mask = f32_type ? 0x7FFFFFu : f16_type ? 0x3FFu : 0x7Fu;
    const uint32_t mantissa = 1 + rng() % mantissa_mask;  // nonzero
    const uint32_t random_sign = (rng() & 1) ? sign : 0;
    switch (special) {
      case Special::kNan: set_bits(i, random_sign | inf | mantissa); break;
      case Special::kPosInf: set_bits(i, inf); break;
      case Special::kNegInf: set_bits(i, sign | inf); break;
      case Special::kZero: set_bits(i, 0); break;
      case Special::kNegZero: set_bits(i, sign); break;
      case Special::kSubnormal: set_bits(i, random_sign | mantissa); break;
      case Special::kMaxFinite: set_bits(i, random_sign | (inf - 1)); break;
    }
  }
};

// How many special values go in, and which kinds.
struct Injection {
  double rate = 0.0;
  bool nonfinite = true;  // false: only zeros, subnormals and max-finite values
};

inline TestBuffer make_buffer(ElemType type, int64_t n, uint32_t seed, Injection injection) {
  std::mt19937 rng(seed);
  TestBuffer buffer(type, n);
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  const Special finite_kinds[] = {Special::kZero, Special::kNegZero, Special::kSubnormal,
                                  Special::kMaxFinite};
  const Special all_kinds[] = {Special::kNan,  Special::kPosInf,    Special::kNegInf,
                               Special::kZero, Special::kSubnormal, Special::kMaxFinite};
  for (int64_t i = 0; i < n; ++i) {
    if (coin(rng) < injection.rate) {
      buffer.set_special(i, injection.nonfinite ? all_kinds[rng() % 6] : finite_kinds[rng() % 4],
                         rng);
    } else {
      buffer.set_random(i, rng);
    }
  }
  return buffer;
}

}  // namespace nanreplay::test
