// y = x @ W^T (+ bias) on weights kept in a checkpoint's own form: GGUF blocks (Q4_0, Q4_1, Q5_0,
// Q5_1, Q8_0 and the K-quants Q2_K to Q6_K) or 16-bit floats (F16, BF16), laid out in the panels
// of panel_gemm.cpp: 0.56-2 bytes a weight stream from memory against fp32's 4.
//
// A weight is expanded to fp32 as one fmadd(q, s, o) of its unsigned code q, a scale s and an
// offset o (Q8_0: q * d). s and o are the fp32 values gguf's dequantiser computes first (d, m,
// d * sc, dmin * m, -8 d ...: all exact products of an fp16 and a small integer), q * s is exact
// (at most 24 significant bits), so the one rounding of the fmadd is the one rounding of gguf's
// `s * q + m` / `s * q - dm`, and where gguf computes s * (q - bias) the result is exact both ways:
// every weight equals the fp32 weight the loader dequantises. The tiles then sum in the same order
// as the fp32 panel kernel's, so the results are bit-identical to it; only the bytes read per step
// shrink. Few rows expand each panel in registers; more rows expand it once into an L2 buffer.
// (An infinite fp16 scale would give NaN where gguf gives inf: no quantiser writes one.) A 16-bit
// float is expanded exactly (F16C's conversion; a bf16 is the top half of its fp32), so products on
// F16 / BF16 weights are bit-identical to the fp32 panels of the same values, at half their bytes.
#include "array.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "panel_tile.h"

#if !defined(__F16C__)
#error "quant_gemm needs F16C"  // the loader then keeps fp32 panels
#endif

using namespace conveyor_array;
using namespace conveyor_panels;

namespace {

// GGML's type numbers (gguf.GGMLQuantizationType), which is also quant_gemm's qtype argument.
enum class QType : int64_t { kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kBF16 = 30 };

// A quantised panel is a run of units, one per GGUF block of the panel's 16 columns (32 k, or 256
// for the K-quants): the unit's scale bytes column by column (fp16 d, fp16 minimums, 6-bit K-quant
// scales as bytes), then its codes k by k, in chunks of 32 k. 4-6 bit codes: per k, 8 bytes of low
// nibbles (byte c: column c in the low nibble, column c + 8 in the high one), then per k of the
// chunk, for 5-bit codes a uint16 of bit 4 (bit c: column c), for 6-bit codes two uint16 of bits
// 4-5 (bits 2c, 2c + 1: column c, then column c + 8). The byte sizes match the file's, give or take the K-quants' 6-bit scales
// stored as bytes (Q4_K 2368 bytes a unit against 2304, Q5_K 2880 against 2816); Q3_K's and Q2_K's 3-
// and 2-bit codes take nibbles (2336 against 1760, 2624 against 1344: still a sixth of fp32's bytes).
struct Scales {
  __m256 s_lo, s_hi, o_lo, o_hi;  // columns 0-7 / 8-15
};

inline __m256 half8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256i load8_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m256i load8_i8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m256 negate(__m256 v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.0f)); }
inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// The codes of 32 k steps: 8 bytes of nibbles per k, then the high bits per k (2 bytes for 5-bit
// codes, 4 for 6-bit). A K-quant unit holds 8 such chunks in a row: the panel stays one sequential
// stream (with nibbles and high bits in two streams 2 KiB apart, Q5_K took 2.2x Q5_0's time at 1 row).
constexpr int64_t kChunkK = 32;
template <int kBits>
constexpr int64_t kHighBytes = kBits == 4 ? 0 : kBits == 5 ? 2 : 4;  // per k
template <int kBits>
constexpr int64_t kChunkBytes = kChunkK * (8 + kHighBytes<kBits>);

// Code k of a unit's 4/5/6-bit codes as two vectors of int32, columns 0-7 and 8-15.
template <int kBits>
inline void unsigned_codes(const uint8_t* codes, int64_t k, __m256i& lo, __m256i& hi) {
  const uint8_t* chunk = codes + k / kChunkK * kChunkBytes<kBits>;
  const int64_t kk = k % kChunkK;
  const __m256i q = load8_u8(chunk + kk * 8);
  lo = _mm256_and_si256(q, _mm256_set1_epi32(0xF));
  hi = _mm256_srli_epi32(q, 4);
  const uint8_t* high = chunk + kChunkK * 8 + kk * kHighBytes<kBits>;
  if constexpr (kBits == 5) {
    // Each 32-bit lane holds the uint16 twice; shifting lane c right by c + 12 (c + 20) brings
    // column c's (c + 8's) bit from the upper copy to bit 4.
    const __m256i h = _mm256_set1_epi16(static_cast<int16_t>(load_u16(high)));
    const __m256i bit4 = _mm256_set1_epi32(0x10);
    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_srlv_epi32(h, _mm256_setr_epi32(12, 13, 14, 15, 16, 17, 18, 19)), bit4));
    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srlv_epi32(h, _mm256_setr_epi32(20, 21, 22, 23, 24, 25, 26, 27)), bit4));
  } else if constexpr (kBits == 6) {
    const __m256i h_lo = _mm256_set1_epi16(static_cast<int16_t>(load_u16(high)));
    const __m256i h_hi = _mm256_set1_epi16(static_cast<int16_t>(load_u16(high + 2)));
    const __m256i shifts = _mm256_setr_epi32(12, 14, 16, 18, 20, 22, 24, 26), bits45 = _mm256_set1_epi32(0x30);
    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_srlv_epi32(h_lo, shifts), bits45));
    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srlv_epi32(h_hi, shifts), bits45));
  }
}

#if defined(__AVX512F__)
// The same expansion 16 columns at a time, in one zmm register: the same fp32 operations on the
// same values lane by lane, so the same weights bit for bit, in about half the instructions.
struct Scales16 {
  __m512 s, o;
};

inline __m512 half16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512i load16_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m512i load16_i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// unsigned_codes for all 16 columns: lanes 0-7 and 8-15 both read the step's 8 nibble bytes (the
// load duplicates them), lanes 8-15 shifted right by 4 to their high nibbles.
template <int kBits>
inline __m512i unsigned_codes16(const uint8_t* codes, int64_t k) {
  const uint8_t* chunk = codes + k / kChunkK * kChunkBytes<kBits>;
  const int64_t kk = k % kChunkK;
  const __m512i q = _mm512_cvtepu8_epi32(_mm_castpd_si128(_mm_loaddup_pd(reinterpret_cast<const double*>(chunk + kk * 8))));
  const __m512i nibble_shift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
  __m512i code = _mm512_and_si512(_mm512_srlv_epi32(q, nibble_shift), _mm512_set1_epi32(0xF));
  const uint8_t* high = chunk + kChunkK * 8 + kk * kHighBytes<kBits>;
  if constexpr (kBits == 5) {
    // As unsigned_codes: lane c holds the uint16 twice and shifts bit c of the upper copy to bit 4.
    const __m512i h = _mm512_set1_epi16(static_cast<int16_t>(load_u16(high)));
    const __m512i shifts = _mm512_setr_epi32(12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27);
    code = _mm512_or_si512(code, _mm512_and_si512(_mm512_srlv_epi32(h, shifts), _mm512_set1_epi32(0x10)));
  } else if constexpr (kBits == 6) {
    // Every lane holds both uint16 (columns 0-7's bits in 0-15, columns 8-15's in 16-31); rotating
    // lane c right by 2c - 4 (mod 32), lane 8 + c by 12 + 2c, brings its two bits to bits 4-5.
    const __m512i h = _mm512_set1_epi32(static_cast<int32_t>(load_u32(high)));
    const __m512i rotations = _mm512_setr_epi32(28, 30, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26);
    code = _mm512_or_si512(code, _mm512_and_si512(_mm512_rorv_epi32(h, rotations), _mm512_set1_epi32(0x30)));
  }
  return code;
}

#endif

// One unit's layout and expansion. kGroupK: the k steps that share one scale (and offset).
// group(g) -> the fp32 scales and offsets of group g; weights(s, k) -> the 16 weights of step k.
template <int kBits, bool kHasMin>  // Q4_0 (4, false), Q4_1 (4, true), Q5_0, Q5_1
struct LegacyUnit {
  static constexpr int64_t kUnitK = 32, kGroupK = 32;
  static constexpr int64_t kHeader = kHasMin ? 64 : 32;
  static constexpr int64_t kBytes = kHeader + kChunkBytes<kBits>;
  const uint8_t* src;

  inline Scales group(int64_t) const {
    const __m256 d_lo = half8(src), d_hi = half8(src + 16);
    if constexpr (kHasMin) return {d_lo, d_hi, half8(src + 32), half8(src + 48)};
    // gguf: d * (q - 8) / d * (q - 16), exact; q * d + (-8 d) is that exact value too.
    const __m256 bias = _mm256_set1_ps(kBits == 4 ? -8.0f : -16.0f);
    return {d_lo, d_hi, _mm256_mul_ps(d_lo, bias), _mm256_mul_ps(d_hi, bias)};
  }

  inline void weights(const Scales& s, int64_t k, __m256& w_lo, __m256& w_hi) const {
    __m256i lo, hi;
    unsigned_codes<kBits>(src + kHeader, k, lo, hi);
    w_lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), s.s_lo, s.o_lo);
    w_hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), s.s_hi, s.o_hi);
  }
#if defined(__AVX512F__)
  inline Scales16 group16(int64_t) const {
    const __m512 d = half16(src);
    if constexpr (kHasMin) return {d, half16(src + 32)};
    return {d, _mm512_mul_ps(d, _mm512_set1_ps(kBits == 4 ? -8.0f : -16.0f))};
  }
  inline __m512 weights16(const Scales16& s, int64_t k) const {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(unsigned_codes16<kBits>(src + kHeader, k)), s.s, s.o);
  }
#endif
};

struct Q8_0Unit {  // 16 fp16 scales, then 16 int8 codes per k
  static constexpr int64_t kUnitK = 32, kGroupK = 32, kBytes = 32 + kUnitK * 16;
  const uint8_t* src;

  inline Scales group(int64_t) const { return {half8(src), half8(src + 16), _mm256_setzero_ps(), _mm256_setzero_ps()}; }

  inline void weights(const Scales& s, int64_t k, __m256& w_lo, __m256& w_hi) const {
    const uint8_t* codes = src + 32 + k * 16;
    w_lo = _mm256_mul_ps(_mm256_cvtepi32_ps(load8_i8(codes)), s.s_lo);
    w_hi = _mm256_mul_ps(_mm256_cvtepi32_ps(load8_i8(codes + 8)), s.s_hi);
  }
#if defined(__AVX512F__)
  inline Scales16 group16(int64_t) const { return {half16(src), _mm512_setzero_ps()}; }
  inline __m512 weights16(const Scales16& s, int64_t k) const {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(load16_i8(src + 32 + k * 16)), s.s);
  }
#endif
};

// Q4_K / Q5_K: fp16 d and dmin, then per 32 k the 6-bit scale and minimum of each column as bytes;
// Q2_K the same per 16 k with 4-bit ones, its 2-bit codes kept as nibbles (the 4-bit unpacking).
// gguf: (d * sc) * q - (dmin * m), each product in fp32 (exact) and one rounding at the end.
template <int kBits, int64_t kScaleK>
struct KQuantUnit {
  static constexpr int64_t kUnitK = 256, kGroupK = kScaleK, kGroups = kUnitK / kGroupK;
  static constexpr int64_t kHeader = 64 + 2 * kGroups * 16;
  static constexpr int64_t kBytes = kHeader + kUnitK / kChunkK * kChunkBytes<kBits>;
  const uint8_t* src;

  inline Scales group(int64_t g) const {
    const uint8_t* sc = src + 64 + g * 16;
    const uint8_t* mins = src + 64 + kGroups * 16 + g * 16;
    const __m256 d_lo = half8(src), d_hi = half8(src + 16), dmin_lo = half8(src + 32), dmin_hi = half8(src + 48);
    return {_mm256_mul_ps(d_lo, _mm256_cvtepi32_ps(load8_u8(sc))), _mm256_mul_ps(d_hi, _mm256_cvtepi32_ps(load8_u8(sc + 8))),
            negate(_mm256_mul_ps(dmin_lo, _mm256_cvtepi32_ps(load8_u8(mins)))),
            negate(_mm256_mul_ps(dmin_hi, _mm256_cvtepi32_ps(load8_u8(mins + 8))))};
  }

  inline void weights(const Scales& s, int64_t k, __m256& w_lo, __m256& w_hi) const {
    __m256i lo, hi;
    unsigned_codes<kBits>(src + kHeader, k, lo, hi);
    w_lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), s.s_lo, s.o_lo);
    w_hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), s.s_hi, s.o_hi);
  }
#if defined(__AVX512F__)
  inline Scales16 group16(int64_t g) const {
    const uint8_t* sc = src + 64 + g * 16;
    const uint8_t* mins = src + 64 + kGroups * 16 + g * 16;
    return {_mm512_mul_ps(half16(src), _mm512_cvtepi32_ps(load16_u8(sc))),
            _mm512_xor_ps(_mm512_mul_ps(half16(src + 32), _mm512_cvtepi32_ps(load16_u8(mins))), _mm512_set1_ps(-0.0f))};
  }
  inline __m512 weights16(const Scales16& s, int64_t k) const {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(unsigned_codes16<kBits>(src + kHeader, k)), s.s, s.o);
  }
#endif
};

// Q6_K / Q3_K: fp16 d, then per 16 k the signed scale of each column (Q3_K's 6-bit scale minus 32)
// as a byte; Q3_K's 3-bit codes are kept as nibbles (the 4-bit unpacking). gguf: (d * sc) *
// (q - kBias), exact (at most 11 + 7 + 5 significant bits), as is q * (d * sc) + (-kBias * d * sc).
template <int kBits, int kBias>
struct SignedScaleUnit {
  static constexpr int64_t kUnitK = 256, kGroupK = 16, kHeader = 32 + 16 * 16;
  static constexpr int64_t kBytes = kHeader + kUnitK / kChunkK * kChunkBytes<kBits>;
  const uint8_t* src;

  inline Scales group(int64_t g) const {
    const uint8_t* sc = src + 32 + g * 16;
    const __m256 s_lo = _mm256_mul_ps(half8(src), _mm256_cvtepi32_ps(load8_i8(sc)));
    const __m256 s_hi = _mm256_mul_ps(half8(src + 16), _mm256_cvtepi32_ps(load8_i8(sc + 8)));
    const __m256 bias = _mm256_set1_ps(-static_cast<float>(kBias));
    return {s_lo, s_hi, _mm256_mul_ps(s_lo, bias), _mm256_mul_ps(s_hi, bias)};
  }

  inline void weights(const Scales& s, int64_t k, __m256& w_lo, __m256& w_hi) const {
    __m256i lo, hi;
    unsigned_codes<kBits>(src + kHeader, k, lo, hi);
    w_lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), s.s_lo, s.o_lo);
    w_hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), s.s_hi, s.o_hi);
  }
#if defined(__AVX512F__)
  inline Scales16 group16(int64_t g) const {
    const __m512 scale = _mm512_mul_ps(half16(src), _mm512_cvtepi32_ps(load16_i8(src + 32 + g * 16)));
    return {scale, _mm512_mul_ps(scale, _mm512_set1_ps(-static_cast<float>(kBias)))};
  }
  inline __m512 weights16(const Scales16& s, int64_t k) const {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(unsigned_codes16<kBits>(src + kHeader, k)), s.s, s.o);
  }
#endif
};
using Q6_KUnit = SignedScaleUnit<6, 32>;
using Q3_KUnit = SignedScaleUnit<4, 4>;

// F16 / BF16: no scales; a unit is 32 k steps of the 16 columns' 16-bit floats, k by k (a
// "block" of the file is 32 consecutive weights of a row). The expansion is exact.
template <bool kBrain>
struct HalfUnit {
  static constexpr int64_t kUnitK = 32, kGroupK = 32, kBytes = kUnitK * kPanel * 2;
  const uint8_t* src;

  static inline __m256 expand8(const uint8_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (kBrain) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    else return _mm256_cvtph_ps(h);
  }
  inline Scales group(int64_t) const {
    const __m256 none = _mm256_setzero_ps();
    return {none, none, none, none};
  }
  inline void weights(const Scales&, int64_t k, __m256& w_lo, __m256& w_hi) const {
    const uint8_t* step = src + k * kPanel * 2;
    w_lo = expand8(step);
    w_hi = expand8(step + 16);
  }
#if defined(__AVX512F__)
  inline Scales16 group16(int64_t) const { return {_mm512_setzero_ps(), _mm512_setzero_ps()}; }
  inline __m512 weights16(const Scales16&, int64_t k) const {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k * kPanel * 2));
    if constexpr (kBrain) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    else return _mm512_cvtph_ps(h);
  }
#endif
};
using F16Unit = HalfUnit<false>;
using BF16Unit = HalfUnit<true>;

// One panel of quantised units -> [K][16] fp32 in `out`, for the tiles to read from L2. In ymm
// halves on AVX-512 builds too: a zmm expansion here measured slower (docs/PERF.md, zmm tiles).
template <class U>
void expand_panel(const uint8_t* src, int64_t units, float* out) {
  for (int64_t u = 0; u < units; ++u, src += U::kBytes) {
    const U unit{src};
    for (int64_t g = 0; g < U::kUnitK / U::kGroupK; ++g) {
      const Scales s = unit.group(g);
      _Pragma("GCC unroll 4") for (int64_t k = g * U::kGroupK; k < (g + 1) * U::kGroupK; ++k, out += kPanel) {
        __m256 w_lo, w_hi;
        unit.weights(s, k, w_lo, w_hi);
        _mm256_storeu_ps(out, w_lo);
        _mm256_storeu_ps(out + 8, w_hi);
      }
    }
  }
}

// A few rows run against a quantised panel in fused tiles of up to kFusedRows rows, each expanding
// the panel in registers (again, from L1, for each tile); more rows expand each panel once into an
// L2 buffer that fp32 tiles read back. Two fused tiles beat the buffer everywhere measured; three
// to six (25-64 rows) only where a panel's buffer (K x 64 bytes) is large, from K = 2048 (128 KB),
// and lose to it on smaller K (docs/PERF.md, "Linear layers"). With AVX2's 16 ymm registers a
// 6-row tile spills (2 sums a row); with AVX-512 a row's 16 sums are one zmm register, so a tile
// holds 12 rows beside the weights, their scales and offsets, and each panel step is half the
// instructions. Same sums in the same order as tile<R>, so the same results.
#if defined(__AVX512F__)
constexpr int kFusedRows = 12;
constexpr int64_t kFusedRowsLargeK = 64, kLargeK = 2048;
#else
constexpr int kFusedRows = 5;
constexpr int64_t kFusedRowsLargeK = 2 * kFusedRows, kLargeK = 0;
#endif

inline bool fuses(int64_t m, int64_t k_dim) { return m <= 2 * kFusedRows || (k_dim >= kLargeK && m <= kFusedRowsLargeK); }

// A fused tile reads its R rows interleaved k by k ([K][R], see interleave_rows in panel_tile.h).
template <class U, int R>
void fused_tile(const float* xt, const uint8_t* src, int64_t units, const float* bias, float* y, int64_t y_stride,
                int64_t cols, NextPanel& ahead) {
#if defined(__AVX512F__)
  __m512 sums[R];
  _Pragma("GCC unroll 32") for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_ps();
  for (int64_t u = 0; u < units; ++u, src += U::kBytes) {
    const U unit{src};
    for (int64_t g = 0; g < U::kUnitK / U::kGroupK; ++g) {
      const Scales16 s = unit.group16(g);
      const float* xg = xt + (u * U::kUnitK + g * U::kGroupK) * R;
      _Pragma("GCC unroll 2") for (int64_t k = 0; k < U::kGroupK; ++k) {
        const __m512 w = unit.weights16(s, g * U::kGroupK + k);
        _Pragma("GCC unroll 32") for (int r = 0; r < R; ++r)
          sums[r] = _mm512_fmadd_ps(_mm512_set1_ps(xg[k * R + r]), w, sums[r]);
      }
    }
  }
  store_sums512<R>(sums, bias, y, y_stride, cols);
#else
  __m256 lo[R], hi[R];
  zero_sums<R>(lo, hi);
  for (int64_t u = 0; u < units; ++u, src += U::kBytes) {
    ahead.step();  // AVX2 builds only: measured there (docs/PERF.md), not on AVX-512 CPUs
    const U unit{src};
    for (int64_t g = 0; g < U::kUnitK / U::kGroupK; ++g) {
      const Scales s = unit.group(g);
      const float* xg = xt + (u * U::kUnitK + g * U::kGroupK) * R;
      _Pragma("GCC unroll 2") for (int64_t k = 0; k < U::kGroupK; ++k) {
        __m256 w_lo, w_hi;
        unit.weights(s, g * U::kGroupK + k, w_lo, w_hi);
        _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
          const __m256 xv = _mm256_broadcast_ss(xg + k * R + r);
          lo[r] = _mm256_fmadd_ps(xv, w_lo, lo[r]);
          hi[r] = _mm256_fmadd_ps(xv, w_hi, hi[r]);
        }
      }
    }
  }
  store_sums<R>(lo, hi, bias, y, y_stride, cols);
#endif
}

// m rows (interleaved) against one quantised panel in fused tiles, each expanding it.
template <class U>
void fused_rows(const float* interleaved, int64_t m, const uint8_t* src, int64_t units, const float* bias, float* y,
                int64_t y_stride, int64_t cols, NextPanel& ahead) {
  for_balanced_tiles<kFusedRows>(m, [&](int64_t r0, int64_t rows) {
    const float* xt = interleaved + r0 * units * U::kUnitK;
    float* yr = y + r0 * y_stride;
    with_rows<kFusedRows>(rows, [&](auto tile_rows) {
      fused_tile<U, decltype(tile_rows)::value>(xt, src, units, bias, yr, y_stride, cols, ahead);
    });
  });
}

#if defined(__AVX512F__)
// Two adjacent panels a fused tile, as pair_tile512 does for fp32 panels (panel_tile.h): two
// streams of blocks in flight, and each broadcast row value feeds two FMAs. Same sums, same order.
// Only for the few rows of a small decode step: from 4 rows, two panels' unpacking beside 2R sums
// runs out of registers and is slower than one panel a tile (docs/PERF.md).
constexpr int64_t kFusedPairMaxRows = 3;
template <class U, int R>
void fused_pair_tile(const float* xt, const uint8_t* left_src, const uint8_t* right_src, int64_t units,
                     const float* bias, float* y, int64_t y_stride, int64_t right_cols) {
  __m512 left[R], right[R];
  _Pragma("GCC unroll 32") for (int r = 0; r < R; ++r) left[r] = right[r] = _mm512_setzero_ps();
  for (int64_t u = 0; u < units; ++u, left_src += U::kBytes, right_src += U::kBytes) {
    const U left_unit{left_src}, right_unit{right_src};
    for (int64_t g = 0; g < U::kUnitK / U::kGroupK; ++g) {
      const Scales16 ls = left_unit.group16(g), rs = right_unit.group16(g);
      const float* xg = xt + (u * U::kUnitK + g * U::kGroupK) * R;
      _Pragma("GCC unroll 2") for (int64_t k = 0; k < U::kGroupK; ++k) {
        const __m512 wl = left_unit.weights16(ls, g * U::kGroupK + k);
        const __m512 wr = right_unit.weights16(rs, g * U::kGroupK + k);
        _Pragma("GCC unroll 32") for (int r = 0; r < R; ++r) {
          const __m512 xv = _mm512_set1_ps(xg[k * R + r]);
          left[r] = _mm512_fmadd_ps(xv, wl, left[r]);
          right[r] = _mm512_fmadd_ps(xv, wr, right[r]);
        }
      }
    }
  }
  store_sums512<R>(left, bias, y, y_stride, kPanel);
  store_sums512<R>(right, bias ? bias + kPanel : nullptr, y + kPanel, y_stride, right_cols);
}

// m <= kFusedPairMaxRows rows (interleaved: one tile) against two adjacent quantised panels (the left one full).
template <class U>
void fused_pair_rows(const float* interleaved, int64_t m, const uint8_t* left_src, const uint8_t* right_src,
                     int64_t units, const float* bias, float* y, int64_t y_stride, int64_t right_cols) {
  with_rows<kFusedPairMaxRows>(m, [&](auto tile_rows) {
    fused_pair_tile<U, decltype(tile_rows)::value>(interleaved, left_src, right_src, units, bias, y, y_stride, right_cols);
  });
}
#endif

using Q4_0Unit = LegacyUnit<4, false>;
using Q4_1Unit = LegacyUnit<4, true>;
using Q5_0Unit = LegacyUnit<5, false>;
using Q5_1Unit = LegacyUnit<5, true>;
using Q2_KUnit = KQuantUnit<4, 16>;
using Q4_KUnit = KQuantUnit<4, 32>;
using Q5_KUnit = KQuantUnit<5, 32>;

struct Format {
  int64_t unit_k, gguf_bytes, panel_bytes;
};

bool known(int64_t qtype) {
  switch (static_cast<QType>(qtype)) {
    case QType::kQ4_0: case QType::kQ4_1: case QType::kQ5_0: case QType::kQ5_1: case QType::kQ8_0:
    case QType::kQ2_K: case QType::kQ3_K: case QType::kQ4_K: case QType::kQ5_K: case QType::kQ6_K:
    case QType::kF16: case QType::kBF16: return true;
  }
  return false;
}

Format format_of(QType type) {
  switch (type) {
    case QType::kQ4_0: return {32, 18, Q4_0Unit::kBytes};
    case QType::kQ4_1: return {32, 20, Q4_1Unit::kBytes};
    case QType::kQ5_0: return {32, 22, Q5_0Unit::kBytes};
    case QType::kQ5_1: return {32, 24, Q5_1Unit::kBytes};
    case QType::kQ8_0: return {32, 34, Q8_0Unit::kBytes};
    case QType::kQ2_K: return {256, 84, Q2_KUnit::kBytes};
    case QType::kQ3_K: return {256, 110, Q3_KUnit::kBytes};
    case QType::kQ4_K: return {256, 144, Q4_KUnit::kBytes};
    case QType::kQ5_K: return {256, 176, Q5_KUnit::kBytes};
    case QType::kQ6_K: return {256, 210, Q6_KUnit::kBytes};
    case QType::kF16: return {32, 64, F16Unit::kBytes};
    case QType::kBF16: return {32, 64, BF16Unit::kBytes};
  }
  return {0, 0, 0};
}

template <class U>
struct UnitTag {
  using Unit = U;
};

// Calls f(UnitTag<U>{}) with the panel unit U of `type`: the one place a GGML type picks its unit
// for the per-type templates (the product, row lookup, column norms).
template <class F>
void with_unit(QType type, F&& f) {
  switch (type) {
#define CONVEYOR_QTYPE(T) \
  case QType::k##T: f(UnitTag<T##Unit>{}); break;
    CONVEYOR_QTYPE(Q4_0) CONVEYOR_QTYPE(Q4_1) CONVEYOR_QTYPE(Q5_0) CONVEYOR_QTYPE(Q5_1) CONVEYOR_QTYPE(Q8_0)
    CONVEYOR_QTYPE(Q2_K) CONVEYOR_QTYPE(Q3_K) CONVEYOR_QTYPE(Q4_K) CONVEYOR_QTYPE(Q5_K) CONVEYOR_QTYPE(Q6_K) CONVEYOR_QTYPE(F16) CONVEYOR_QTYPE(BF16)
#undef CONVEYOR_QTYPE
  }
}

// Writes column c's code of step k into a unit's code chunks (see unsigned_codes).
template <int kBits>
inline void put_code(uint8_t* codes, int64_t k, int64_t c, uint8_t code) {
  uint8_t* chunk = codes + k / kChunkK * kChunkBytes<kBits>;
  const int64_t kk = k % kChunkK;
  chunk[kk * 8 + c % 8] |= static_cast<uint8_t>((code & 0xF) << (c < 8 ? 0 : 4));
  uint8_t* high = chunk + kChunkK * 8 + kk * kHighBytes<kBits>;
  if constexpr (kBits == 5) high[c / 8] |= static_cast<uint8_t>(((code >> 4) & 1) << (c % 8));
  if constexpr (kBits == 6) {
    const int64_t bit = 2 * (c % 8);  // a uint16 per half: bits 2c, 2c + 1
    high[2 * (c / 8) + bit / 8] |= static_cast<uint8_t>(((code >> 4) & 3) << (bit % 8));
  }
}
inline void copy_half(const uint8_t* from, uint8_t* to, int64_t c) { std::copy(from, from + 2, to + 2 * c); }

// Column c's codes of one whole chunk (32 k steps, `chunk_codes[kk]` for step kk) into the chunk
// starting at `chunk`: put_code's layout, one chunk's offsets worked out once instead of per code.
template <int kBits>
inline void put_chunk(uint8_t* chunk, int64_t c, const uint8_t* chunk_codes) {
  const int shift = c < 8 ? 0 : 4;
  uint8_t* nibbles = chunk + c % 8;
  for (int64_t kk = 0; kk < kChunkK; ++kk) nibbles[kk * 8] |= static_cast<uint8_t>((chunk_codes[kk] & 0xF) << shift);
  uint8_t* high = chunk + kChunkK * 8;
  if constexpr (kBits == 5) {
    const int bit = static_cast<int>(c % 8);
    uint8_t* byte = high + c / 8;
    for (int64_t kk = 0; kk < kChunkK; ++kk) byte[kk * 2] |= static_cast<uint8_t>(((chunk_codes[kk] >> 4) & 1) << bit);
  }
  if constexpr (kBits == 6) {
    const int bit = static_cast<int>(2 * (c % 8));  // a uint16 per half: bits 2c, 2c + 1
    uint8_t* byte = high + 2 * (c / 8) + bit / 8;
    for (int64_t kk = 0; kk < kChunkK; ++kk) byte[kk * 4] |= static_cast<uint8_t>(((chunk_codes[kk] >> 4) & 3) << (bit % 8));
  }
}

// The 4/5/6-bit code j of a GGUF block (gguf.quants' bit layouts).
inline uint8_t legacy_code(const uint8_t* qs, uint32_t qh, int bits, int64_t j) {
  const uint8_t nibble = j < 16 ? qs[j] & 0xF : qs[j - 16] >> 4;
  return bits == 5 ? static_cast<uint8_t>(nibble | ((qh >> j) & 1) << 4) : nibble;
}

// Q4_K / Q5_K 6-bit scales and minimums of sub-block i (gguf's Q4_K.get_scale_min).
inline void kquant_scale_min(const uint8_t* s, int64_t i, uint8_t& sc, uint8_t& m) {
  if (i < 4) {
    sc = s[i] & 63;
    m = s[i + 4] & 63;
  } else {
    sc = static_cast<uint8_t>((s[i + 4] & 0xF) | ((s[i - 4] >> 2) & 0x30));
    m = static_cast<uint8_t>((s[i + 4] >> 4) | ((s[i] >> 2) & 0x30));
  }
}

// Column c of one GGUF block -> its place in the panel's unit `out`.
void pack_block(QType type, const uint8_t* block, int64_t c, uint8_t* out) {
  switch (type) {
    case QType::kQ8_0:
      copy_half(block, out, c);
      for (int64_t j = 0; j < 32; ++j) out[32 + j * kPanel + c] = block[2 + j];
      return;
    case QType::kQ4_0: case QType::kQ4_1: case QType::kQ5_0: case QType::kQ5_1: {
      const bool has_min = type == QType::kQ4_1 || type == QType::kQ5_1;
      const int bits = type == QType::kQ5_0 || type == QType::kQ5_1 ? 5 : 4;
      copy_half(block, out, c);
      if (has_min) copy_half(block + 2, out + 32, c);
      const uint8_t* rest = block + (has_min ? 4 : 2);
      uint32_t qh = 0;
      if (bits == 5) {
        std::memcpy(&qh, rest, 4);
        rest += 4;
      }
      uint8_t* nibbles = out + (has_min ? 64 : 32);
      for (int64_t j = 0; j < 32; ++j) {  // put_chunk measured slower here than code by code
        const uint8_t code = legacy_code(rest, qh, bits, j);
        if (bits == 5) put_code<5>(nibbles, j, c, code);
        else put_code<4>(nibbles, j, c, code);
      }
      return;
    }
    case QType::kQ4_K: case QType::kQ5_K: {
      const bool five = type == QType::kQ5_K;
      copy_half(block, out, c);
      copy_half(block + 2, out + 32, c);
      for (int64_t i = 0; i < 8; ++i) kquant_scale_min(block + 4, i, out[64 + i * 16 + c], out[64 + 128 + i * 16 + c]);
      const uint8_t* qh = block + 16;
      const uint8_t* qs = block + (five ? 48 : 16);
      uint8_t* nibbles = out + Q4_KUnit::kHeader;
      uint8_t codes[kChunkK];
      for (int64_t g = 0; g < 8; ++g) {  // 64 values per 32 bytes: low nibbles, then high nibbles
        const uint8_t* q = qs + g / 2 * 32;
        const int shift = static_cast<int>(g % 2 * 4);
        for (int64_t i = 0; i < 32; ++i) codes[i] = static_cast<uint8_t>((q[i] >> shift) & 0xF);
        if (five) {
          for (int64_t i = 0; i < 32; ++i) codes[i] = static_cast<uint8_t>(codes[i] | ((qh[i] >> g) & 1) << 4);
          put_chunk<5>(nibbles + g * kChunkBytes<5>, c, codes);
        } else {
          put_chunk<4>(nibbles + g * kChunkBytes<4>, c, codes);
        }
      }
      return;
    }
    case QType::kQ2_K: {  // 16 bytes of 4-bit scale | 4-bit minimum << 4, 64 of 2-bit codes, fp16 d, dmin
      const uint8_t *scales = block, *qs = block + 16;
      copy_half(block + 80, out, c);
      copy_half(block + 82, out + 32, c);
      for (int64_t g = 0; g < 16; ++g) {
        out[64 + g * 16 + c] = scales[g] & 0xF;
        out[64 + 256 + g * 16 + c] = scales[g] >> 4;
      }
      uint8_t* nibbles = out + Q2_KUnit::kHeader;
      for (int64_t j = 0; j < 256; ++j) {  // per 128 values: 32 bytes of four 2-bit codes
        const int64_t half = j / 128, r = j % 128;
        put_code<4>(nibbles, j, c, static_cast<uint8_t>((qs[half * 32 + r % 32] >> (r / 32 * 2)) & 3));
      }
      return;
    }
    case QType::kQ3_K: {  // 32 bytes of high bits, 64 of 2-bit low codes, 12 of 6-bit scales, fp16 d
      const uint8_t *hmask = block, *qs = block + 32, *scales = block + 96;
      copy_half(block + 108, out, c);
      for (int64_t i = 0; i < 16; ++i) {
        const int low = (scales[i % 8] >> (4 * (i / 8))) & 0xF, high = (scales[8 + i % 4] >> (2 * (i / 4))) & 3;
        out[32 + i * 16 + c] = static_cast<uint8_t>(static_cast<int8_t>((low | high << 4) - 32));
      }
      uint8_t* nibbles = out + Q3_KUnit::kHeader;
      for (int64_t j = 0; j < 256; ++j) {  // code = low 2 bits | high bit << 2; weight = d * sc * (code - 4)
        const int64_t half = j / 128, r = j % 128;
        const uint8_t low = (qs[half * 32 + r % 32] >> (r / 32 * 2)) & 3, high = (hmask[j % 32] >> (j / 32)) & 1;
        put_code<4>(nibbles, j, c, static_cast<uint8_t>(low | high << 2));
      }
      return;
    }
    case QType::kF16: case QType::kBF16:  // 32 weights of the row -> column c of 32 k steps
      for (int64_t j = 0; j < 32; ++j) std::copy(block + 2 * j, block + 2 * j + 2, out + 2 * (j * kPanel + c));
      return;
    case QType::kQ6_K: {
      const uint8_t *ql = block, *qh = block + 128, *scales = block + 192;
      copy_half(block + 208, out, c);
      for (int64_t g = 0; g < 16; ++g) out[32 + g * 16 + c] = scales[g];
      uint8_t* nibbles = out + Q6_KUnit::kHeader;
      uint8_t codes[kChunkK];
      for (int64_t g = 0; g < 8; ++g) {  // per 128 values: 64 bytes of nibbles, 32 of 2-bit pairs
        const int64_t half = g / 4, quarter = g % 4;
        const uint8_t* low = ql + half * 64 + quarter % 2 * 32;
        const uint8_t* top = qh + half * 32;
        const int low_shift = static_cast<int>(quarter / 2 * 4), top_shift = static_cast<int>(quarter * 2);
        for (int64_t i = 0; i < 32; ++i)
          codes[i] = static_cast<uint8_t>(((low[i] >> low_shift) & 0xF) | ((top[i] >> top_shift) & 3) << 4);
        put_chunk<6>(nibbles + g * kChunkBytes<6>, c, codes);
      }
      return;
    }
  }
}

template <class U>
void matmul_panels(const float* x, int64_t x_stride, int64_t m, const uint8_t* w, int64_t panels, int64_t units,
                   const float* bias, float* y, int64_t out_features) {
  if (fuses(m, units * U::kUnitK)) {
    thread_local std::vector<float> interleaved;  // one row is its own interleaving
    if (m > 1) {
      if (interleaved.size() < static_cast<size_t>(m * units * U::kUnitK)) interleaved.resize(m * units * U::kUnitK);
      interleave_rows<kFusedRows>(x, x_stride, m, units * U::kUnitK, interleaved.data());
    }
    const float* xt = m > 1 ? interleaved.data() : x;
    parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      const int64_t panel_bytes = units * U::kBytes;
      NextPanel ahead;  // the next panel into L2, a few lines a unit of each tile
      for (int64_t p = begin; p < end; ++p) {
        const int64_t col0 = p * kPanel;
        ahead.aim(p + 1 < end ? w + (p + 1) * panel_bytes : nullptr, panel_bytes, units * ((m + kFusedRows - 1) / kFusedRows));
#if defined(__AVX512F__)
        if (m <= kFusedPairMaxRows && p + 1 < end) {
          fused_pair_rows<U>(xt, m, w + p * units * U::kBytes, w + (p + 1) * units * U::kBytes, units,
                             bias ? bias + col0 : nullptr, y + col0, out_features,
                             std::min(kPanel, out_features - col0 - kPanel));
          ++p;
          continue;
        }
#endif
        fused_rows<U>(xt, m, w + p * units * U::kBytes, units, bias ? bias + col0 : nullptr, y + col0,
                      out_features, std::min(kPanel, out_features - col0), ahead);
      }
    });
    return;
  }
  // More rows: each panel expanded once into the L2 buffer, in blocks of rows (see for_row_blocks).
  parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> expanded;  // two panels in fp32 (K x 64 bytes each, in L2)
    const int64_t k_dim = units * U::kUnitK;
    expanded.resize(2 * k_dim * kPanel);
    for_row_blocks(m, [&](int64_t r0, int64_t rows) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t col0 = p * kPanel, cols = std::min(kPanel, out_features - col0);
        if (p + 1 < end) {
          expand_panel<U>(w + p * units * U::kBytes, units, expanded.data());
          expand_panel<U>(w + (p + 1) * units * U::kBytes, units, expanded.data() + k_dim * kPanel);
          rows_times_panel_pair(x + r0 * x_stride, x_stride, rows, expanded.data(), expanded.data() + k_dim * kPanel,
                                k_dim, bias ? bias + col0 : nullptr, y + r0 * out_features + col0, out_features,
                                std::min(kPanel, out_features - col0 - kPanel), /*from_memory=*/false);
          ++p;
          continue;
        }
        expand_panel<U>(w + p * units * U::kBytes, units, expanded.data());
        rows_times_panel(x + r0 * x_stride, x_stride, rows, expanded.data(), k_dim,
                         bias ? bias + col0 : nullptr, y + r0 * out_features + col0, out_features, cols,
                         /*from_memory=*/false);
      }
    });
  });
}

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define CONVEYOR_SCREENED_ARGMAX 1
// Greedy decoding's argmax of x @ W^T over a Q8_0 vocabulary projection, without the whole fp32
// product: an int8 pass (x quantised per 32 k, VNNI dot products on the codes as they lie in the
// panels) gives every column an approximate logit and a rigorous bound on its distance from the
// fp32 logit the kernel computes; only the columns whose upper bound reaches the largest lower
// bound can be the argmax (a tie for the maximum included), and those are computed exactly, one
// FMA a k step in k order as the tile does, so the answer is the argmax of the full product's
// logits, bit for bit. The bound, for column i with blocks b of 32 k, codes q (|q| <= 128), scale d:
//   |fp32 - approx| <= sum_b |d_b| * 128 * (E_b + g_K A_b + g_24 s_b Q_b)
// E_b = sum |x - s_b xq| (x's quantisation error), A_b = sum |x|, Q_b = sum |xq|, s_b x's scale,
// g_n = n u / (1 - n u) (u = 2^-24): the fp32 FMA chain's rounding and the approximation's own.
struct ScreenRow {
  std::vector<uint8_t> xu;      // K: xq + 128, xq in [-127, 127]
  std::vector<float> scale;     // per unit: s_b
  std::vector<float> beta;      // per unit: 128 * (E_b + ...), rounded up
};

inline double gamma_n(double n) {
  const double u = std::ldexp(1.0, -24);
  return n * u / (1.0 - n * u);
}

ScreenRow quantize_row(const float* x, int64_t k_dim) {
  ScreenRow row{std::vector<uint8_t>(k_dim), std::vector<float>(k_dim / 32), std::vector<float>(k_dim / 32)};
  const double g_k = gamma_n(static_cast<double>(k_dim)), g_approx = gamma_n(static_cast<double>(k_dim / 32 + 4));
  for (int64_t b = 0; b < k_dim / 32; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float s = amax / 127.f;
    double err = 0, abs_x = 0, abs_q = 0;
    for (int j = 0; j < 32; ++j) {
      const int q = s > 0.f ? static_cast<int>(std::clamp(std::nearbyint(xb[j] / s), -127.f, 127.f)) : 0;
      row.xu[b * 32 + j] = static_cast<uint8_t>(q + 128);
      err += std::fabs(static_cast<double>(xb[j]) - static_cast<double>(s) * q);  // exact product in double
      abs_x += std::fabs(static_cast<double>(xb[j]));
      abs_q += std::abs(q);
    }
    row.scale[b] = s;
    // times 1 + 2 g: the fp32 sum of |d_b| beta_b over the blocks, and approx +- bound, round too
    const double beta = 128.0 * (err + g_k * abs_x + g_approx * static_cast<double>(s) * abs_q) * (1.0 + 2.0 * g_approx);
    row.beta[b] = std::nextafter(static_cast<float>(beta), std::numeric_limits<float>::infinity());
  }
  return row;
}

struct Candidates {
  bool non_finite = false;  // an approximate logit overflowed: the bound says nothing, take the full product
  float lower_max = -std::numeric_limits<float>::infinity();
  std::vector<std::pair<float, int64_t>> upper_col;  // columns whose upper bound reached lower_max when seen
};

// One panel's 16 columns against R rows: approximate logits and bounds, then each row's candidates.
template <int R>
void screen_panel(const uint8_t* panel, int64_t units, const ScreenRow* rows, int64_t col0, int64_t cols,
                  Candidates* found, NextPanel& ahead) {
  const __m512i perm = [] {
    alignas(64) uint8_t idx[64];
    for (int t = 0; t < 64; ++t) idx[t] = static_cast<uint8_t>((t % 4) * 16 + t / 4);  // lane c: k0..k3 of column c
    return _mm512_load_si512(idx);
  }();
  const __m512i ones = _mm512_set1_epi8(1);
  __m512 approx[R], bound[R];
  // the per-row arrays live in registers only when these loops are unrolled: -O3 does it on its own
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) approx[r] = bound[r] = _mm512_setzero_ps();
  for (int64_t u = 0; u < units; ++u, panel += Q8_0Unit::kBytes) {
    ahead.step();
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel)));
    const __m512 abs_d = _mm512_abs_ps(d);
    __m512i acc[R], code_sum = _mm512_setzero_si512();
    _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
    const uint8_t* codes = panel + 32;
    _Pragma("GCC unroll 8") for (int g = 0; g < 8; ++g) {
      const __m512i w = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(codes + 64 * g));
      code_sum = _mm512_dpbusd_epi32(code_sum, ones, w);
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, rows[r].xu.data() + u * 32 + 4 * g, 4);
        acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_set1_epi32(x4), w);
      }
    }
    const __m512i offset = _mm512_slli_epi32(code_sum, 7);  // sum (xq + 128) q - 128 sum q = sum xq q
    _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r], offset));
      approx[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(rows[r].scale[u])), approx[r]);
      bound[r] = _mm512_fmadd_ps(abs_d, _mm512_set1_ps(rows[r].beta[u]), bound[r]);
    }
  }
  const __mmask16 real = static_cast<__mmask16>((1u << cols) - 1);
  for (int r = 0; r < R; ++r) {
    // the fp32 rounding of approx +- bound itself, covered by a relative 2^-22 of approx
    const __m512 slack = _mm512_fmadd_ps(_mm512_abs_ps(approx[r]), _mm512_set1_ps(std::ldexp(1.f, -22)), bound[r]);
    const __m512 lower = _mm512_sub_ps(approx[r], slack), upper = _mm512_add_ps(approx[r], slack);
    Candidates& c = found[r];
    const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
    c.non_finite |= _mm512_mask_cmp_ps_mask(real, _mm512_abs_ps(upper), inf, _CMP_NLT_UQ) != 0;  // inf or NaN
    c.lower_max = std::max(c.lower_max, _mm512_mask_reduce_max_ps(real, lower));
    __mmask16 keep = _mm512_mask_cmp_ps_mask(real, upper, _mm512_set1_ps(c.lower_max), _CMP_GE_OQ);
    alignas(64) float up[16];
    _mm512_store_ps(up, upper);
    for (; keep; keep &= keep - 1) {
      const int j = __builtin_ctz(keep);
      c.upper_col.emplace_back(up[j], col0 + j);
    }
  }
}

// Column `col`'s fp32 logit exactly as the tiles compute it.
float exact_q8_0(const float* x, const uint8_t* w, int64_t units, int64_t col) {
  const uint8_t* panel = w + col / kPanel * units * Q8_0Unit::kBytes;
  const int64_t c = col % kPanel;
  float sum = 0.f;
  for (int64_t u = 0; u < units; ++u, panel += Q8_0Unit::kBytes) {
    const float d = _cvtsh_ss(load_u16(panel + 2 * c));
    for (int64_t k = 0; k < 32; ++k)
      sum = std::fma(x[u * 32 + k], static_cast<float>(static_cast<int8_t>(panel[32 + k * kPanel + c])) * d, sum);
  }
  return sum;
}
#endif

}  // namespace

// GGUF blocks [N, K / block * block bytes] -> `out` [ceil(N/16), K / block, unit bytes], a contiguous
// array or a run of whole panels of one (a loader packs a large matrix a run of rows at a time);
// columns past N in the last panel get zero scales and codes, so they come out as zero weights.
void pack_quantized_into(const Array& blocks, int64_t qtype, Array out) {
  CHECK(known(qtype), "pack_quantized: qtype ", qtype, " is not a GGML block type this kernel reads");
  const auto type = static_cast<QType>(qtype);
  const Format f = format_of(type);
  CHECK(blocks.dim() == 2 && blocks.dtype() == DType::kUInt8 && blocks.size(1) % f.gguf_bytes == 0,
        "pack_quantized: blocks must be uint8 [N, K/", f.unit_k, " * ", f.gguf_bytes, "]");
  const auto b = blocks.contiguous();
  const int64_t n = b.size(0), units = b.size(1) / f.gguf_bytes, panels = (n + kPanel - 1) / kPanel;
  CHECK(out.dim() == 3 && out.dtype() == DType::kUInt8 && out.is_contiguous() && out.size(0) == panels &&
        out.size(1) == units && out.size(2) == f.panel_bytes,
        "pack_quantized: out must be contiguous uint8 [", panels, ", ", units, ", ", f.panel_bytes, "]");
  CHECK(out.writeable(), "pack_quantized: out must be writeable");
  const uint8_t* src = b.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    // put_code ORs codes in: each panel starts from zeros (and a short last panel stays zero past n).
    std::memset(dst + begin * units * f.panel_bytes, 0, static_cast<size_t>((end - begin) * units * f.panel_bytes));
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < std::min(kPanel, n - p * kPanel); ++c)
        for (int64_t u = 0; u < units; ++u)
          pack_block(type, src + ((p * kPanel + c) * units + u) * f.gguf_bytes, c, dst + (p * units + u) * f.panel_bytes);
  });
}

Array pack_quantized(const Array& blocks, int64_t qtype) {
  CHECK(known(qtype), "pack_quantized: qtype ", qtype, " is not a GGML block type this kernel reads");
  const Format f = format_of(static_cast<QType>(qtype));
  CHECK(blocks.dim() == 2 && blocks.size(1) % f.gguf_bytes == 0,
        "pack_quantized: blocks must be uint8 [N, K/", f.unit_k, " * ", f.gguf_bytes, "]");
  auto packed = empty({(blocks.size(0) + kPanel - 1) / kPanel, blocks.size(1) / f.gguf_bytes, f.panel_bytes},
                             DType::kUInt8);
  pack_quantized_into(blocks, qtype, packed);
  return packed;
}

Array quantized_matmul(const Array& x, const Array& packed, int64_t out_features,
                       const std::optional<Array>& bias, int64_t qtype) {
  CHECK(x.dim() == 2 && x.dtype() == DType::kFloat32, "quantized_matmul: x must be 2-D fp32");
  CHECK(known(qtype), "quantized_matmul: qtype ", qtype, " is not a GGML block type this kernel reads");
  const auto type = static_cast<QType>(qtype);
  const Format f = format_of(type);
  CHECK(packed.dim() == 3 && packed.dtype() == DType::kUInt8 && packed.is_contiguous() &&
        packed.size(2) == f.panel_bytes, "quantized_matmul: bad packed weight");
  CHECK(packed.size(1) * f.unit_k == x.size(1), "quantized_matmul: x has ", x.size(1), " features, the weight ",
        packed.size(1) * f.unit_k);
  CHECK(out_features > (packed.size(0) - 1) * kPanel && out_features <= packed.size(0) * kPanel,
        "quantized_matmul: out_features does not match the packed weight");
  const auto xs = x.stride(1) == 1 ? x : x.contiguous();
  Array b;
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    b = bias->contiguous();
    CHECK(b.dtype() == DType::kFloat32 && b.numel() == out_features, "quantized_matmul: bad bias");
    bias_ptr = b.data_ptr<float>();
  }
  const int64_t m = xs.size(0), panels = packed.size(0), units = packed.size(1), x_stride = xs.stride(0);
  auto y = empty({m, out_features}, x.dtype());
  if (m == 0) return y;
  const float* xp = xs.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  with_unit(type, [&](auto tag) {
    matmul_panels<typename decltype(tag)::Unit>(xp, x_stride, m, wp, panels, units, bias_ptr, yp, out_features);
  });
  return y;
}

// Rows `ids` of the weight as fp32 [n, K] (an embedding lookup on the blocks): each row is its
// panel's column, so the panel is expanded (as the L2-buffer path does) and the column copied out;
// a thread keeps its last panel, so runs of ids in one panel (a full dequantisation) expand it once.
template <class U>
void rows_of_panels(const uint8_t* w, int64_t units, const int64_t* ids, int64_t n, float* out) {
  const int64_t k_dim = units * U::kUnitK;
  parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> expanded(k_dim * kPanel);
    int64_t current = -1;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t panel = ids[i] / kPanel, column = ids[i] % kPanel;
      if (panel != current) {
        expand_panel<U>(w + panel * units * U::kBytes, units, expanded.data());
        current = panel;
      }
      float* row = out + i * k_dim;
      for (int64_t k = 0; k < k_dim; ++k) row[k] = expanded[k * kPanel + column];
    }
  });
}

#if defined(CONVEYOR_SCREENED_ARGMAX)
// Each row's argmax of x @ W^T for a Q8_0-packed W (the first index of the maximum, as numpy's
// argmax on quantized_matmul's output), or -1 for a row whose candidates exceed max_candidates or
// whose approximate logits overflow (the caller then takes the full product). x must be finite.
Array q8_0_argmax(const Array& x, const Array& packed, int64_t out_features,
                  int64_t max_candidates) {
  CHECK(x.dim() == 2 && x.dtype() == DType::kFloat32, "q8_0_argmax: x must be 2-D fp32");
  const Format f = format_of(QType::kQ8_0);
  CHECK(packed.dim() == 3 && packed.dtype() == DType::kUInt8 && packed.is_contiguous() &&
        packed.size(2) == f.panel_bytes && packed.size(1) * 32 == x.size(1), "q8_0_argmax: bad packed weight");
  CHECK(out_features > (packed.size(0) - 1) * kPanel && out_features <= packed.size(0) * kPanel,
        "q8_0_argmax: out_features does not match the packed weight");
  const auto xs = x.contiguous();
  const int64_t m = xs.size(0), k_dim = xs.size(1), panels = packed.size(0), units = packed.size(1);
  const float* xp = xs.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  std::vector<ScreenRow> rows;
  rows.reserve(m);
  for (int64_t r = 0; r < m; ++r) rows.push_back(quantize_row(xp + r * k_dim, k_dim));
  constexpr int kRowTile = 8;
  // One share of the panels per thread, each with candidates of its own: the shares, not the
  // threads a region happens to get, index `found`, so a thread count changed by another caller
  // meanwhile cannot index past it.
  const int64_t shares = std::max<int64_t>(1, std::min<int64_t>(get_num_threads(), panels));
  const int64_t per_share = (panels + shares - 1) / shares;
  std::vector<std::vector<Candidates>> found(shares, std::vector<Candidates>(m));
  parallel_for(0, shares, 1, [&](int64_t first_share, int64_t last_share) {
    for (int64_t share = first_share; share < last_share; ++share) {
      std::vector<Candidates>& mine = found[share];
      const int64_t begin = share * per_share, end = std::min(panels, begin + per_share);
      const int64_t panel_bytes = units * Q8_0Unit::kBytes;
      NextPanel ahead;  // a few lines a unit of each row tile
      for (int64_t p = begin; p < end; ++p) {
        const int64_t col0 = p * kPanel, cols = std::min(kPanel, out_features - col0);
        ahead.aim(p + 1 < end ? wp + (p + 1) * panel_bytes : nullptr, panel_bytes,
                  units * ((m + kRowTile - 1) / kRowTile));
        for (int64_t r0 = 0; r0 < m; r0 += kRowTile) {
          const uint8_t* panel = wp + p * panel_bytes;
          with_rows<kRowTile>(std::min<int64_t>(kRowTile, m - r0), [&](auto tile_rows) {
            screen_panel<decltype(tile_rows)::value>(panel, units, rows.data() + r0, col0, cols, mine.data() + r0,
                                                     ahead);
          });
        }
      }
    }
  });
  auto out = empty({m}, DType::kInt64);
  int64_t* outp = out.data_ptr<int64_t>();
  parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float lower_max = -std::numeric_limits<float>::infinity();
      bool non_finite = false;
      for (const auto& t : found) {
        lower_max = std::max(lower_max, t[r].lower_max);
        non_finite = non_finite || t[r].non_finite;
      }
      if (non_finite) {
        outp[r] = -1;
        continue;
      }
      std::vector<int64_t> cols;
      for (const auto& t : found)
        for (const auto& [upper, col] : t[r].upper_col)
          if (upper >= lower_max) cols.push_back(col);
      if (static_cast<int64_t>(cols.size()) > max_candidates) {
        outp[r] = -1;
        continue;
      }
      std::sort(cols.begin(), cols.end());
      int64_t best_col = -1;
      float best = 0.f;
      for (const int64_t col : cols) {
        const float v = exact_q8_0(xp + r * k_dim, wp, units, col);
        if (best_col < 0 || v > best) best = v, best_col = col;
      }
      outp[r] = best_col;
    }
  });
  return out;
}
#endif

Array dequantize_rows(const Array& packed, int64_t out_features, const Array& ids, int64_t qtype) {
  CHECK(known(qtype), "dequantize_rows: qtype ", qtype, " is not a GGML block type this kernel reads");
  const auto type = static_cast<QType>(qtype);
  const Format f = format_of(type);
  CHECK(packed.dim() == 3 && packed.dtype() == DType::kUInt8 && packed.is_contiguous() &&
        packed.size(2) == f.panel_bytes, "dequantize_rows: bad packed weight");
  CHECK(ids.dim() == 1 && ids.dtype() == DType::kInt64, "dequantize_rows: ids must be 1-D int64");
  const auto idx = ids.contiguous();
  const int64_t n = idx.size(0), units = packed.size(1);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    CHECK(ip[i] >= 0 && ip[i] < out_features, "dequantize_rows: row ", ip[i], " out of range [0, ", out_features, ")");
  auto out = empty({n, units * f.unit_k}, DType::kFloat32);
  if (n == 0) return out;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  with_unit(type, [&](auto tag) { rows_of_panels<typename decltype(tag)::Unit>(wp, units, ip, n, op); });
  return out;
}

// Each column's L2 norm (of its dequantised weights, squares summed in double): what the int8
// screen of a vocabulary projection bounds a column's error with (conveyor.model.linear.screen_norms).
template <class U>
void norms_of_panels(const uint8_t* w, int64_t panels, int64_t units, int64_t out_features, double* out) {
  const int64_t k_dim = units * U::kUnitK;
  parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> expanded(k_dim * kPanel);
    for (int64_t p = begin; p < end; ++p) {
      expand_panel<U>(w + p * units * U::kBytes, units, expanded.data());
      double sums[kPanel] = {};
      for (int64_t k = 0; k < k_dim; ++k)
        for (int64_t c = 0; c < kPanel; ++c) {
          const double v = expanded[k * kPanel + c];
          sums[c] += v * v;
        }
      for (int64_t c = 0; c < std::min(kPanel, out_features - p * kPanel); ++c) out[p * kPanel + c] = std::sqrt(sums[c]);
    }
  });
}

Array column_norms(const Array& packed, int64_t out_features, int64_t qtype) {
  CHECK(known(qtype), "column_norms: qtype ", qtype, " is not a GGML block type this kernel reads");
  const auto type = static_cast<QType>(qtype);
  const Format f = format_of(type);
  CHECK(packed.dim() == 3 && packed.dtype() == DType::kUInt8 && packed.is_contiguous() &&
        packed.size(2) == f.panel_bytes, "column_norms: bad packed weight");
  CHECK(out_features > (packed.size(0) - 1) * kPanel && out_features <= packed.size(0) * kPanel,
        "column_norms: out_features does not match the packed weight");
  auto out = empty({out_features}, DType::kFloat64);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  double* op = out.data_ptr<double>();
  const int64_t panels = packed.size(0), units = packed.size(1);
  with_unit(type, [&](auto tag) {
    norms_of_panels<typename decltype(tag)::Unit>(wp, panels, units, out_features, op);
  });
  return out;
}

// The ops run without the GIL, so the server's event loop streams responses while a step computes.
PYBIND11_MODULE(CONVEYOR_MODULE_NAME, m) {
  def_thread_functions(m);
  m.def("pack_quantized", &pack_quantized,
        "GGUF blocks [N, K / block * bytes] of GGML type qtype (Q4_0/1, Q5_0/1, Q8_0, Q2_K-Q6_K, F16, BF16) -> panels",
        py::call_guard<py::gil_scoped_release>());
  m.def("pack_quantized_into", &pack_quantized_into, "pack_quantized into `out` (a run of whole panels of a larger weight)",
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_rows", &dequantize_rows, "rows ids of a weight packed by pack_quantized, as fp32 [n, K]",
        py::call_guard<py::gil_scoped_release>());
  m.def("column_norms", &column_norms, "each column's L2 norm (float64 [N]) of a weight packed by pack_quantized",
        py::call_guard<py::gil_scoped_release>());
  m.def("quantized_matmul", &quantized_matmul, "x [M, K] @ W^T (+ bias) on a weight packed by pack_quantized",
        py::call_guard<py::gil_scoped_release>());
#if defined(CONVEYOR_SCREENED_ARGMAX)
  m.def("q8_0_argmax", &q8_0_argmax, "each row's argmax of x @ W^T on a Q8_0-packed W, screened in int8, exact",
        py::call_guard<py::gil_scoped_release>());
#endif
}
