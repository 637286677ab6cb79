// Included before a kernel's source (-include) to build its AVX-512 code on a CPU without AVX-512, so
// that benchmarks/isa_check.py can check that code on an AVX2-only machine: SIMDe's portable AVX-512
// intrinsics under their Intel names, and the few SIMDe 0.7.4 lacks or gets wrong written here from AVX2 halves
// (the same lanes, rounding and saturation as the instructions). The __AVX512*__ macros, defined
// after SIMDe has looked at them (so that it does not take them for the real instructions), send
// the kernel down its AVX-512 paths. Correct, not fast: for checking results only.
#pragma once
#include <immintrin.h>

#define SIMDE_X86_AVX512F_ENABLE_NATIVE_ALIASES
#define SIMDE_X86_AVX512BW_ENABLE_NATIVE_ALIASES
#define SIMDE_X86_AVX512VL_ENABLE_NATIVE_ALIASES
#define SIMDE_X86_AVX512DQ_ENABLE_NATIVE_ALIASES
#define SIMDE_X86_AVX512VNNI_ENABLE_NATIVE_ALIASES
#define SIMDE_X86_AVX512VBMI_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <cstring>

namespace conveyor_avx512_on_avx2 {
struct Halves {
  __m256i lo, hi;
};
inline Halves split_i(simde__m512i v) {
  Halves h;
  std::memcpy(&h, &v, 64);
  return h;
}
inline simde__m512i join_i(__m256i lo, __m256i hi) {
  simde__m512i v;
  std::memcpy(&v, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
  return v;
}
inline void split_f(simde__m512 v, __m256& lo, __m256& hi) {
  std::memcpy(&lo, &v, 32);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + 32, 32);
}
inline simde__m512 join_f(__m256 lo, __m256 hi) {
  simde__m512 v;
  std::memcpy(&v, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
  return v;
}
inline simde__m512 cvtepi32_ps(simde__m512i a) {
  const Halves h = split_i(a);
  return join_f(_mm256_cvtepi32_ps(h.lo), _mm256_cvtepi32_ps(h.hi));
}
inline simde__m512i cvtps_epi32(simde__m512 a) {
  __m256 lo, hi;
  split_f(a, lo, hi);
  return join_i(_mm256_cvtps_epi32(lo), _mm256_cvtps_epi32(hi));
}
inline simde__m512 cvtph_ps(simde__m256i a) {
  __m128i h[2];
  std::memcpy(h, &a, 32);
  return join_f(_mm256_cvtph_ps(h[0]), _mm256_cvtph_ps(h[1]));
}
inline simde__m512i cvtepu8_epi32(simde__m128i a) {
  __m128i v;
  std::memcpy(&v, &a, 16);
  return join_i(_mm256_cvtepu8_epi32(v), _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
}
inline simde__m512i cvtepu16_epi32(simde__m256i a) {
  __m128i h[2];
  std::memcpy(h, &a, 32);
  return join_i(_mm256_cvtepu16_epi32(h[0]), _mm256_cvtepu16_epi32(h[1]));
}
inline simde__m512i cvtepi8_epi32(simde__m128i a) {
  __m128i v;
  std::memcpy(&v, &a, 16);
  return join_i(_mm256_cvtepi8_epi32(v), _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
}
// SIMDe 0.7.4 and 0.8.2 read imm's bit 3 (suppress exceptions) as a fraction bit: floor(2.7) = 2.5.
template <int kImm>
inline simde__m512 roundscale_ps(simde__m512 a) {
  static_assert((kImm >> 4) == 0, "only rounding to an integer is written here");
  __m256 lo, hi;
  split_f(a, lo, hi);
  return join_f(_mm256_round_ps(lo, kImm & 0x0F), _mm256_round_ps(hi, kImm & 0x0F));
}
inline float mask_reduce_max_ps(simde__mmask16 k, simde__m512 a) {
  float lanes[16], m = -__builtin_inff();
  std::memcpy(lanes, &a, 64);
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) m = lanes[i] > m ? lanes[i] : m;
  return m;
}
}  // namespace conveyor_avx512_on_avx2

#undef _mm512_cvtepi32_ps
#undef _mm512_cvtps_epi32
#undef _mm512_cvtph_ps
#undef _mm512_cvtepu8_epi32
#undef _mm512_cvtepi8_epi32
#undef _mm512_mask_reduce_max_ps
#undef _mm512_mask_cmp_ps_mask
#undef _mm512_roundscale_ps
#define _mm512_cvtepi32_ps(a) conveyor_avx512_on_avx2::cvtepi32_ps(a)
#define _mm512_cvtps_epi32(a) conveyor_avx512_on_avx2::cvtps_epi32(a)
#define _mm512_cvtph_ps(a) conveyor_avx512_on_avx2::cvtph_ps(a)
#define _mm512_cvtepu8_epi32(a) conveyor_avx512_on_avx2::cvtepu8_epi32(a)
#define _mm512_cvtepi8_epi32(a) conveyor_avx512_on_avx2::cvtepi8_epi32(a)
#define _mm512_cvtepu16_epi32(a) conveyor_avx512_on_avx2::cvtepu16_epi32(a)
#define _mm512_mask_reduce_max_ps(k, a) conveyor_avx512_on_avx2::mask_reduce_max_ps((k), (a))
#define _mm512_roundscale_ps(a, imm) conveyor_avx512_on_avx2::roundscale_ps<(imm)>(a)
#define _mm512_mask_cmp_ps_mask(k, a, b, imm) static_cast<simde__mmask16>((k) & simde_mm512_cmp_ps_mask((a), (b), (imm)))

#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512DQ__ 1
#define __AVX512VNNI__ 1
#define __AVX512VBMI__ 1
