// Scalar conversions between fp32 and the two 16-bit float formats, bit-exact with torch's
// c10::BFloat16 / c10::Half casts (round to nearest even, subnormals kept, NaN stays NaN).
//
// Torch-free on purpose: the CPU Adam kernels include this, and so can a standalone test.
#pragma once

#include <cstdint>
#include <cstring>

namespace zero_engine {

// Layout-compatible with c10::BFloat16 / c10::Half (one uint16_t), but distinct types so that
// templates can tell bf16 from fp16 apart.
struct BF16 {
  uint16_t bits;
};
struct FP16 {
  uint16_t bits;
};

inline uint32_t float_to_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

inline float bits_to_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline float to_float(float value) { return value; }

inline float to_float(BF16 value) { return bits_to_float(static_cast<uint32_t>(value.bits) << 16); }

inline BF16 float_to_bf16(float value) {
  if (value != value) {
    return BF16{0x7FC0};  // the canonical quiet NaN torch produces
  }
  const uint32_t bits = float_to_bits(value);
  // Adding 0x7FFF plus the lowest kept bit rounds to nearest, ties to even, in integer arithmetic.
  const uint32_t rounding_bias = ((bits >> 16) & 1u) + 0x7FFFu;
  return BF16{static_cast<uint16_t>((bits + rounding_bias) >> 16)};
}

inline float to_float(FP16 value) {
  const uint32_t h = value.bits;
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24 is exact in fp32.
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return bits_to_float(sign | float_to_bits(magnitude));
  }
  if (exponent == 0x1Fu) {
    return bits_to_float(sign | 0x7F800000u | (mantissa << 13));  // inf / NaN, payload kept
  }
  return bits_to_float(sign | ((exponent + (127 - 15)) << 23) | (mantissa << 13));
}

// [Note: fp16 rounding through the FPU]
// Rather than rounding mantissa bits by hand (three cases: normal, subnormal, overflow), scale the
// magnitude so that the FPU's own round-to-nearest-even drops exactly the bits fp16 cannot hold:
// adding a power of two whose ulp equals the fp16 ulp of the value leaves the rounded fp16
// mantissa and exponent in the low bits of the sum. Needs IEEE fp32 arithmetic (no -ffast-math).
inline FP16 float_to_fp16(float value) {
  const float scale_to_inf = 5.192296858534828e+33f;   // 2^112: overflows exactly the values fp16 cannot hold
  const float scale_to_zero = 7.703719777548943e-34f;  // 2^-110
  const uint32_t bits = float_to_bits(value);
  const uint32_t bits_shl1 = bits + bits;  // drops the sign
  const uint32_t sign = bits & 0x80000000u;
  float magnitude = ((value < 0 ? -value : value) * scale_to_inf) * scale_to_zero;
  uint32_t bias = bits_shl1 & 0xFF000000u;
  if (bias < 0x71000000u) {
    bias = 0x71000000u;  // values below fp16's normal range share the subnormal ulp
  }
  magnitude = bits_to_float((bias >> 1) + 0x07800000u) + magnitude;
  const uint32_t rounded = float_to_bits(magnitude);
  const uint32_t exponent_bits = (rounded >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = rounded & 0x00000FFFu;
  const uint32_t nonsign = exponent_bits + mantissa_bits;
  const uint32_t result = (sign >> 16) | (bits_shl1 > 0xFF000000u ? 0x7E00u : nonsign);
  return FP16{static_cast<uint16_t>(result)};
}

inline void from_float(float value, float* out) { *out = value; }
inline void from_float(float value, BF16* out) { *out = float_to_bf16(value); }
inline void from_float(float value, FP16* out) { *out = float_to_fp16(value); }

}  // namespace zero_engine
