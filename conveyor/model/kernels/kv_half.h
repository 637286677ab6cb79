// The KV cache's 16-bit element: IEEE binary16, as torch.float16 stores it. The attention kernels
// read it into fp32 lanes (F16C's vcvtph2ps, on every AVX2 and AVX-512 CPU) and compute in fp32;
// the cache write rounds to nearest even, as tensor.to(torch.float16) does, so a kernel-written
// cache equals one written by torch bit for bit. Without F16C (not x86) c10's portable
// conversions do the same, element by element.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#else
#include <c10/util/Half.h>
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
inline float to_float(Half h) { return c10::detail::fp16_ieee_to_fp32_value(h.bits); }
inline Half to_half(float x) { return Half{c10::detail::fp16_ieee_from_fp32_value(x)}; }
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
