// The float vector the attention kernels compute in, and its operations: a zmm register where the
// build has AVX-512, else a ymm one (AVX2 + FMA), so each kernel is written once for both widths.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "kv_half.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the vector kernels need AVX2 and FMA"
#endif

namespace conveyor_simd {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kWidth = 16;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load(const conveyor_kv::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec splat(float x) { return _mm512_set1_ps(x); }
// Lanes where lo <= j <= hi keep v, the others take `other`.
inline Vec keep_between(Vec v, Vec j, Vec lo, Vec hi, Vec other) {
  const __mmask16 in = _mm512_cmp_ps_mask(lo, j, _CMP_LE_OQ) & _mm512_cmp_ps_mask(j, hi, _CMP_LE_OQ);
  return _mm512_mask_blend_ps(in, other, v);
}
inline Vec minus_inf_to_zero(Vec v) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, splat(-INFINITY), _CMP_EQ_OQ), v, zero());
}
inline Vec vfloor(Vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline Vec pow2i(Vec n) {  // 2^n for integral n in [-127, 128]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#else
using Vec = __m256;
constexpr int64_t kWidth = 8;
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load(const conveyor_kv::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec splat(float x) { return _mm256_set1_ps(x); }
inline Vec keep_between(Vec v, Vec j, Vec lo, Vec hi, Vec other) {
  const Vec in = _mm256_and_ps(_mm256_cmp_ps(lo, j, _CMP_LE_OQ), _mm256_cmp_ps(j, hi, _CMP_LE_OQ));
  return _mm256_blendv_ps(other, v, in);
}
inline Vec minus_inf_to_zero(Vec v) { return _mm256_blendv_ps(v, zero(), _mm256_cmp_ps(v, splat(-INFINITY), _CMP_EQ_OQ)); }
inline Vec vfloor(Vec x) { return _mm256_floor_ps(x); }
inline Vec pow2i(Vec n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
#endif

// conveyor::fast_exp (fast_math.h) lane by lane: x clamped to [-87, 88], 2^n * 2^f, 2^f by its
// degree-7 Taylor polynomial.
inline Vec vexp(Vec x) {
#if defined(__AVX512F__)
  const Vec t = mul(_mm512_min_ps(vmax(x, splat(-87.f)), splat(88.f)), splat(1.4426950408889634f));
#else
  const Vec t = mul(_mm256_min_ps(vmax(x, splat(-87.f)), splat(88.f)), splat(1.4426950408889634f));
#endif
  const Vec n = vfloor(add(t, splat(0.5f)));
  const Vec f = mul(sub(t, n), splat(0.6931471805599453f));
  Vec p = splat(1.f / 5040.f);
  p = fma(p, f, splat(1.f / 720.f));
  p = fma(p, f, splat(1.f / 120.f));
  p = fma(p, f, splat(1.f / 24.f));
  p = fma(p, f, splat(1.f / 6.f));
  p = fma(p, f, splat(0.5f));
  p = fma(p, f, splat(1.f));
  p = fma(p, f, splat(1.f));
  return mul(p, pow2i(n));
}

}  // namespace conveyor_simd
