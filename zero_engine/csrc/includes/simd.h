// A thin vector layer over the instruction set chosen at build time.
//
// The op builder (zero_engine/ops/builder.py) reads the CPU's flags and defines exactly one of
// ZE_SIMD_AVX512 / ZE_SIMD_AVX2 (with the matching -m flags); neither means portable scalar code.
// Kernels are written once against `Vec` and the load/store overloads below; `kWidth` is the number
// of fp32 lanes, and callers handle the last `n % kWidth` elements with the scalar functions of
// dtype_convert.h.
#pragma once

#include <cmath>
#include <cstdint>

#include "dtype_convert.h"

#if defined(ZE_SIMD_AVX512) || defined(ZE_SIMD_AVX2)
#include <immintrin.h>
#endif

namespace zero_engine {
namespace simd {

#if defined(ZE_SIMD_AVX512)

constexpr int kWidth = 16;
constexpr const char* kName = "avx512";
using Vec = __m512;

inline Vec set1(float value) { return _mm512_set1_ps(value); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec sqrt(Vec a) { return _mm512_sqrt_ps(a); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c

inline Vec load(const float* src) { return _mm512_loadu_ps(src); }
inline Vec load(const BF16* src) {
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}
inline Vec load(const FP16* src) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}

inline void store(float* dst, Vec value) { _mm512_storeu_ps(dst, value); }
inline void store(BF16* dst, Vec value) {
  // Same integer rounding as float_to_bf16, sixteen lanes at a time.
  const __m512i bits = _mm512_castps_si512(value);
  const __m512i lowest_kept = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lowest_kept, _mm512_set1_epi32(0x7FFF));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 is_nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
  rounded = _mm512_mask_blend_epi32(is_nan, rounded, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(rounded));
}
inline void store(FP16* dst, Vec value) {
  const __m256i halves = _mm512_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), halves);
}

#elif defined(ZE_SIMD_AVX2)

constexpr int kWidth = 8;
constexpr const char* kName = "avx2";
using Vec = __m256;

inline Vec set1(float value) { return _mm256_set1_ps(value); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec sqrt(Vec a) { return _mm256_sqrt_ps(a); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }

inline Vec load(const float* src) { return _mm256_loadu_ps(src); }
inline Vec load(const BF16* src) {
  const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}
inline Vec load(const FP16* src) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}

inline void store(float* dst, Vec value) { _mm256_storeu_ps(dst, value); }
inline void store(BF16* dst, Vec value) {
  const __m256i bits = _mm256_castps_si256(value);
  const __m256i lowest_kept = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(lowest_kept, _mm256_set1_epi32(0x7FFF));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(value, value, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), is_nan);
  // packus works per 128-bit lane: [r0..r3 r0..r3 | r4..r7 r4..r7]; gather qwords 0 and 2.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(packed));
}
inline void store(FP16* dst, Vec value) {
  const __m128i halves = _mm256_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), halves);
}

#else

constexpr int kWidth = 1;
constexpr const char* kName = "scalar";

#endif

// Scalar versions for the tail of each range (and for the whole range in a scalar build). fp16
// goes through F16C where the build has it, so the tail rounds exactly like the vector body.
inline float load_scalar(const float* src) { return *src; }
inline float load_scalar(const BF16* src) { return to_float(*src); }
inline float load_scalar(const FP16* src) {
#if defined(__F16C__)
  return _cvtsh_ss(src->bits);
#else
  return to_float(*src);
#endif
}

inline void store_scalar(float* dst, float value) { *dst = value; }
inline void store_scalar(BF16* dst, float value) { *dst = float_to_bf16(value); }
inline void store_scalar(FP16* dst, float value) {
#if defined(__F16C__)
  dst->bits = _cvtss_sh(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  *dst = float_to_fp16(value);
#endif
}

}  // namespace simd
}  // namespace zero_engine
