// The KV cache's 16-bit element: IEEE binary16, numpy's float16 (the cache array's dtype). The
// attention kernels read it into fp32 lanes (F16C's vcvtph2ps, on every AVX2 and AVX-512 CPU) and
// compute in fp32; the cache write rounds to nearest even, as numpy's astype(float16) does, so a
// kernel-written cache equals one the numpy path writes (attention.write_kv) bit for bit. Without
// F16C (not x86) the portable conversions below do the same, element by element.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#else
#include <cmath>
#endif

namespace conveyor_kv {

struct Half {
  uint16_t bits;
};
static_assert(sizeof(Half) == 2, "Half is a cache element, 2 bytes");

inline float to_float(float x) { return x; }
#if defined(__F16C__)
inline float to_float(Half h) { return _cvtsh_ss(h.bits); }
inline Half to_half(float x) { return Half{static_cast<uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT))}; }
#else
inline float to_float(Half h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16, exponent = (h.bits >> 10) & 0x1Fu;
  const uint32_t mantissa = h.bits & 0x3FFu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in fp32
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  // a normal number's exponent rebiased from 15 to 127; inf, and NaN quieted with its payload, as vcvtph2ps
  const uint32_t special = mantissa != 0 ? 0x7FC00000u : 0x7F800000u;
  const uint32_t bits = sign | (exponent == 0x1F ? special : (exponent + 112) << 23) | mantissa << 13;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}
inline Half to_half(float x) {  // rounded to nearest, ties to even, as vcvtps2ph
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  bits &= 0x7FFFFFFFu;
  if (bits > 0x7F800000u) return Half{static_cast<uint16_t>(sign | 0x7E00u | ((bits >> 13) & 0x3FFu))};  // NaN, quieted
  if (bits >= 0x477FF000u) return Half{static_cast<uint16_t>(sign | 0x7C00u)};  // from 65520 up: inf
  if (bits < 0x38800000u) {  // below 2^-14: a subnormal half, |x| * 2^24 rounded to an integer (exact scaling)
    float magnitude;
    std::memcpy(&magnitude, &bits, sizeof magnitude);
    return Half{static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(magnitude * 16777216.f)))};
  }
  const uint32_t rounded = bits + 0xFFFu + ((bits >> 13) & 1u) - (112u << 23);  // a carry moves up an exponent
  return Half{static_cast<uint16_t>(sign | (rounded >> 13))};
}
#endif

// n elements of a cache row into fp32, and fp32 into a float16 row (rounded to nearest even).
inline void to_floats(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void to_floats(const Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}
inline void from_floats(const float* src, Half* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; ++i) dst[i] = to_half(src[i]);
}

}  // namespace conveyor_kv
