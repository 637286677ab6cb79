// y = x @ W^T (+ bias) on the quantised panels of quant_gemm.cpp (pack_quantized: Q4_0, Q4_1, Q5_0,
// Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) in integer arithmetic: x is quantised per 32 features to int8 with
// an fp32 scale, as ggml's Q8_0 (dx = max|x| / 127, q = round(x * 127 / max|x|)), each 32 k of a
// column are an integer dot product of those codes with the weight's unsigned codes (vpdpbusd with
// AVX-512 VNNI; vpmaddubsw / vpmaddwd with AVX2), and the blocks' scales, offsets and minimums are
// applied per group in fp32, which sums across groups:
//   y = sum_g dx_g * (s_g * (sum_k q_w q_x - o * sum_k q_x)) + sum_g m_g * dx_g * sum_k q_x
// (o: the code offset of Q4_0 8, Q5_0 16, Q6_K 32, Q8_0 128 as its codes are read unsigned, taken
// into the integer sum; m_g: a minimum, Q4_1 / Q5_1 m, Q4_K / Q5_K -dmin * m). The result is the
// product of the dequantised codes of x with the dequantised weights, up to fp32 rounding; it differs
// from the fp32 product by x's quantisation error (at most about dx / 2 a feature), as llama.cpp's.
// One departure from Q8_0: where a group's largest |x| is over kOutlierRatio times the next largest,
// that feature is carried exactly (its code 0, the group's scale set by the next largest) and added
// after the groups as its value times its column's dequantised weights (Outlier): a lone large
// feature, common in small models' activations, would otherwise leave the group's other features
// only a few codes each.
//
// The weights are the same bytes quantized_matmul reads (one copy of a weight): each thread unpacks a
// panel's codes once into a buffer of bytes in the order the dot products take them (per 4 k, 16
// columns x 4 codes: column c's codes for k .. k + 3 in bytes 4c .. 4c + 3, so one vpdpbusd of a
// broadcast 4 bytes of x gives 16 columns 4 multiply-adds each) beside the groups' fp32 scales, and
// tiles of up to 12 rows (AVX2: 4 rows, 8 columns at a time) read it from L1/L2. x is quantised
// once a call, laid out tile by tile ([K / 4][rows][4 bytes]) so that a tile reads it through one
// pointer. Up to kFusedRows rows skip the buffer: each group's codes are unpacked into registers and
// multiplied there (rows_times_panel), in the tiles' order.
//
// Non-finite x: a group holding inf or NaN gets a NaN scale, so the row's outputs are NaN. A group
// whose max |x| is below 1e-30 quantises to zero (its share of any output is below 32e-30 |w|).
#include "array.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

#include "panel_tile.h"

#if !defined(__F16C__)
#error "quant_int8 needs F16C"
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define CONVEYOR_INT8_512 1
#endif

using namespace conveyor_array;
using namespace conveyor_panels;

namespace {

// GGML's type numbers (gguf.GGMLQuantizationType), as quant_gemm's qtype argument.
enum class QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

// --- quant_gemm.cpp's panel layout (its header comment): a panel is `units` units of 16 columns,
// one per GGUF block; a unit is its scale bytes column by column, then its codes in chunks of 32 k.
constexpr int64_t kChunkK = 32;
constexpr int64_t kChunkBytes(int bits) { return kChunkK * (8 + (bits == 4 ? 0 : bits == 5 ? 2 : 4)); }

struct Layout {
  int bits;            // 4, 5, 6, or 8 (Q8_0: 16 int8 codes per k)
  int64_t unit_k;      // 32 or 256
  int64_t header;      // bytes before the codes
  int64_t unit_bytes;  // quant_gemm's panel_bytes
};

constexpr Layout layout_of(QType t) {
  switch (t) {
    case QType::kQ4_0: return {4, 32, 32, 32 + kChunkBytes(4)};
    case QType::kQ4_1: return {4, 32, 64, 64 + kChunkBytes(4)};
    case QType::kQ5_0: return {5, 32, 32, 32 + kChunkBytes(5)};
    case QType::kQ5_1: return {5, 32, 64, 64 + kChunkBytes(5)};
    case QType::kQ8_0: return {8, 32, 32, 32 + 32 * 16};
    case QType::kQ4_K: return {4, 256, 320, 320 + 8 * kChunkBytes(4)};
    case QType::kQ5_K: return {5, 256, 320, 320 + 8 * kChunkBytes(5)};
    case QType::kQ6_K: return {6, 256, 288, 288 + 8 * kChunkBytes(6)};
  }
  return {0, 0, 0, 0};
}

bool known(int64_t qtype) {
  switch (static_cast<QType>(qtype)) {
    case QType::kQ4_0: case QType::kQ4_1: case QType::kQ5_0: case QType::kQ5_1: case QType::kQ8_0:
    case QType::kQ4_K: case QType::kQ5_K: case QType::kQ6_K: return true;
  }
  return false;
}

// The offset subtracted from a type's unsigned codes in the integer sum (see the top). With AVX2 a
// Q8_0 code stays signed (vpmaddubsw takes its absolute value and moves its sign onto x's code).
#if defined(CONVEYOR_INT8_512)
constexpr int32_t kQ8Offset = 128;
#else
constexpr int32_t kQ8Offset = 0;
#endif
constexpr int32_t code_offset(QType t) {
  switch (t) {
    case QType::kQ4_0: return 8;
    case QType::kQ5_0: return 16;
    case QType::kQ6_K: return 32;
    case QType::kQ8_0: return kQ8Offset;
    default: return 0;
  }
}
bool has_min(QType t) { return t == QType::kQ4_1 || t == QType::kQ5_1 || t == QType::kQ4_K || t == QType::kQ5_K; }

// --- Quantised x, tile by tile.
// Per row and group of 32 k: dx; cmin = dx * sum q (the dequantised codes' sum, for the minimums);
// the integer sums' start, -offset * sum q over the group (init_a), or for Q6_K, whose scales cover
// 16 k, over its first and second 16 k (init_a, init_b).
struct Meta {
  float dx, cmin;
  int32_t init_a, init_b;
};

// A feature multiplied exactly, in fp32, beside the integer sums: a group's largest |x| where it is
// over kOutlierRatio times the group's next largest (the group's other codes then take the next
// largest's scale, and this feature's code is 0). Such lone large features are what the int8 codes
// lose most to (docs/PERF.md, "Lone large features, carried exactly", and why 2).
struct Outlier {
  int32_t k;  // the feature's index in the row
  float value;
};
constexpr float kOutlierRatio = 2.0f;

#if defined(CONVEYOR_INT8_512)
constexpr int kTileRows = 12;  // 12 sums + 12 integer sums + a weight beside them in 32 zmm registers
#else
constexpr int kTileRows = 4;
#endif
// Up to this many rows multiply each panel's codes as they are unpacked, in registers, instead of
// unpacking them into the thread's buffer and reading them back (rows_times_panel).
constexpr int kFusedRows = 4;
// A block of rows stays in L2 while a thread's panels pass: its codes, rows x K bytes, up to this
// many (a quarter of the smallest L2 the kernel meets, 512 KiB on AVX2-only EPYCs). Each panel's
// codes are unpacked once a block, so short K (most of a small model's products) takes long blocks.
constexpr int64_t kBlockCodeBytes = 128 * 1024;

int64_t row_block(int64_t k_dim) {
  return std::max<int64_t>(8 * kTileRows, kBlockCodeBytes / k_dim / kTileRows * kTileRows);
}

// Calls f(b0, rows) for balanced blocks of at most `most` rows over [0, m).
template <class F>
void for_blocks(int64_t m, int64_t most, F&& f) {
  const int64_t blocks = (m + most - 1) / most;
  for (int64_t b0 = 0, b = 0; b < blocks; ++b) {
    const int64_t rows = (m - b0) / (blocks - b);
    f(b0, rows);
    b0 += rows;
  }
}

// Calls f(r0, rows) for the tiles of m rows: balanced blocks of at most row_block(k_dim) rows, each
// in balanced tiles of at most kTileRows. The quantiser and the product walk the same tiles.
template <class F>
void for_tiles(int64_t m, int64_t k_dim, F&& f) {
  for_blocks(m, row_block(k_dim), [&](int64_t b0, int64_t block_rows) {
    for_balanced_tiles<kTileRows>(block_rows, [&](int64_t t0, int64_t rows) { f(b0 + t0, rows); });
  });
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

constexpr float kTinyAmax = 1e-30f;  // 127 / max|x| stays finite, max|x| / 127 normal

// Row r of a tile of `rows` rows: its codes as 4-byte words at xt + (step * rows + r) * 4, its
// groups' Meta at meta[g * rows + r], its outliers (in k order) at outliers[0 .. the count returned).
int32_t quantize_row(const float* x, int64_t k_dim, int32_t offset, bool halves, int64_t rows, int64_t r, uint8_t* xt,
                     Meta* meta, Outlier* outliers) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  int32_t count = 0;
  for (int64_t g = 0; g < k_dim / 32; ++g) {
    const float* xg = x + g * 32;
    __m256 v[4], a[4];
    __m256 amax = _mm256_setzero_ps(), finite = _mm256_setzero_ps();
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xg + 8 * i);
      a[i] = _mm256_and_ps(v[i], abs_mask);
      amax = _mm256_max_ps(amax, a[i]);
      finite = _mm256_or_ps(finite, _mm256_cmp_ps(_mm256_sub_ps(v[i], v[i]), _mm256_setzero_ps(), _CMP_NEQ_UQ));
    }
    float max_abs = hmax8(amax);
    const bool all_finite = !_mm256_movemask_ps(finite);
    // The largest |x| (its first lane), and the largest of the others.
    int j = 0;
    __m256i not_j[4];
    bool carried = false;
    if (all_finite && max_abs > 0.f) {
      const __m256 top = _mm256_set1_ps(max_abs);
      for (int i = 3; i >= 0; --i) {
        const int hits = _mm256_movemask_ps(_mm256_cmp_ps(a[i], top, _CMP_EQ_OQ));
        if (hits) j = 8 * i + __builtin_ctz(static_cast<unsigned>(hits));
      }
      __m256 rest = _mm256_setzero_ps();
      _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {
        not_j[i] = _mm256_xor_si256(_mm256_cmpeq_epi32(_mm256_add_epi32(lanes, _mm256_set1_epi32(8 * i)), _mm256_set1_epi32(j)),
                                    _mm256_set1_epi32(-1));
        rest = _mm256_max_ps(rest, _mm256_and_ps(a[i], _mm256_castsi256_ps(not_j[i])));
      }
      const float next = hmax8(rest);
      if (max_abs > kOutlierRatio * next) carried = true, max_abs = next;
    }
    float dx = max_abs / 127.f, id = max_abs >= kTinyAmax ? 127.f / max_abs : 0.f;
    if (!all_finite) dx = std::numeric_limits<float>::quiet_NaN(), id = 0.f;
    else if (max_abs < kTinyAmax) dx = 0.f;
    const __m256 mul = _mm256_set1_ps(id);
    __m256i q[4];
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {
      // round to nearest, ties to even (the default rounding mode); |x| id <= 127 (up to rounding)
      q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], mul));
      q[i] = _mm256_max_epi32(_mm256_min_epi32(q[i], _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
      if (carried) q[i] = _mm256_and_si256(q[i], not_j[i]);
    }
    const int32_t sum_a = hsum8(_mm256_add_epi32(q[0], q[1])), sum_b = hsum8(_mm256_add_epi32(q[2], q[3]));
    const __m256i packed = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    alignas(32) int32_t words[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(words), packed);
    _Pragma("GCC unroll 8") for (int s = 0; s < 8; ++s) std::memcpy(xt + ((g * 8 + s) * rows + r) * 4, &words[s], 4);
    Meta& mg = meta[g * rows + r];
    mg.dx = dx;
    mg.cmin = dx * static_cast<float>(sum_a + sum_b);
    if (carried) {
      mg.cmin += xg[j];
      outliers[count++] = {static_cast<int32_t>(g * 32 + j), xg[j]};
    }
    mg.init_a = -offset * (halves ? sum_a : sum_a + sum_b);
    mg.init_b = halves ? -offset * sum_b : 0;
  }
  return count;
}

// --- A panel unpacked: per group of 32 k, 8 x 64 bytes of codes (see the top) and 2 x 16 fp32
// values: the scale and the minimum (Q4_1, Q5_1, Q4_K, Q5_K), the scale alone (Q4_0, Q5_0, Q8_0),
// or the scales of the first and the second 16 k (Q6_K).
constexpr int64_t kGroupCodeBytes = 8 * 64, kGroupScales = 32;

inline __m256 half8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 u8_ps(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 i8_ps(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Group g (of 32 k) of a unit's scales into out[32]; the same fp32 values gguf's dequantiser forms
// (d, m, d * sc, dmin * m: exact products), per half of 8 columns.
void unpack_scales(QType t, const uint8_t* unit, int64_t g, float* out) {
  _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {
    const uint8_t* u = unit + 16 * h;  // column 8h's fp16 field (2 bytes a column)
    const int64_t c = 8 * h;           // column 8h's byte in a K-quant scale row
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    switch (t) {
      case QType::kQ4_0: case QType::kQ5_0: case QType::kQ8_0: a = half8(u); break;
      case QType::kQ4_1: case QType::kQ5_1: a = half8(u), b = half8(u + 32); break;
      case QType::kQ4_K: case QType::kQ5_K:
        a = _mm256_mul_ps(half8(u), u8_ps(unit + 64 + g * 16 + c));
        b = _mm256_xor_ps(_mm256_mul_ps(half8(u + 32), u8_ps(unit + 64 + 128 + g * 16 + c)), _mm256_set1_ps(-0.0f));
        break;
      case QType::kQ6_K:
        a = _mm256_mul_ps(half8(u), i8_ps(unit + 32 + 2 * g * 16 + c));
        b = _mm256_mul_ps(half8(u), i8_ps(unit + 32 + (2 * g + 1) * 16 + c));
        break;
    }
    _mm256_storeu_ps(out + c, a);
    _mm256_storeu_ps(out + 16 + c, b);
  }
}

// --- Outliers, added after the integer products, a row block at a time: the features any of the
// block's rows carries (ascending) have their weights dequantised once a panel into a table, and
// each row sums its own outliers' terms from it.
struct Carried {
  std::vector<int32_t> features;
  std::vector<int32_t> starts;  // the block's row i's outliers at slots / values[starts[i], starts[i + 1])
  std::vector<int32_t> slots;   // an outlier's feature's place in `features` (the table's row)
  std::vector<float> values;
};

// Rows [b0, b0 + block_rows)'s outliers (row r's at outliers[r * groups ..], counts[r] of them).
Carried carried_by_rows(const Outlier* outliers, const int32_t* counts, int64_t b0, int64_t block_rows, int64_t groups,
                        int64_t k_dim) {
  Carried c;
  int32_t total = 0;
  for (int64_t r = b0; r < b0 + block_rows; ++r) total += counts[r];
  if (total == 0) return c;
  std::vector<int32_t> slot(static_cast<size_t>(k_dim), -1);
  for (int64_t r = b0; r < b0 + block_rows; ++r)
    for (int32_t i = 0; i < counts[r]; ++i) slot[outliers[r * groups + i].k] = 0;
  for (int64_t k = 0; k < k_dim; ++k)
    if (slot[k] == 0) slot[k] = static_cast<int32_t>(c.features.size()), c.features.push_back(static_cast<int32_t>(k));
  c.slots.reserve(static_cast<size_t>(total));
  c.values.reserve(static_cast<size_t>(total));
  for (int64_t r = b0; r < b0 + block_rows; ++r) {
    c.starts.push_back(static_cast<int32_t>(c.slots.size()));
    for (int32_t i = 0; i < counts[r]; ++i) {
      c.slots.push_back(slot[outliers[r * groups + i].k]);
      c.values.push_back(outliers[r * groups + i].value);
    }
  }
  c.starts.push_back(total);
  return c;
}

// 8 columns' weights at one feature, (code - offset) * scale: `word` holds each column's 4 codes for
// the feature's 4 k in a dword (the unpacked buffer's layout and codes_step's), kk the feature's k
// within its group.
template <bool kSigned>
inline __m256 column_values(__m256i word, int64_t kk, int32_t offset, __m256 scale) {
  const __m256i code =
      kSigned ? _mm256_srai_epi32(_mm256_sllv_epi32(word, _mm256_set1_epi32(static_cast<int>(24 - 8 * (kk % 4)))), 24)
              : _mm256_and_si256(_mm256_srlv_epi32(word, _mm256_set1_epi32(static_cast<int>(8 * (kk % 4)))),
                                 _mm256_set1_epi32(0xFF));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(code, _mm256_set1_epi32(offset))), scale);
}

// A panel's 16 weights at feature k from its unpacked codes and scales (both builds lay them out
// alike: a group's 8 steps of 4 k x 16 columns x 4 codes, then its 32 scales).
template <bool kHalves, bool kSigned>
inline void buffered_column(const uint8_t* codes, const float* scales, int64_t k, int32_t offset, float* out) {
  const int64_t g = k / 32, kk = k % 32;
  _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {
    const __m256i word = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + g * kGroupCodeBytes + kk / 4 * 64 + 32 * h));
    const __m256 scale = _mm256_loadu_ps(scales + g * kGroupScales + (kHalves && kk >= 16 ? 16 : 0) + 8 * h);
    _mm256_storeu_ps(out + 8 * h, column_values<kSigned>(word, kk, offset, scale));
  }
}

// y[b0 + i, 0 .. cols) += the sum of row i's outliers' values times the panel's weights at their
// features (in k order, from 0), for each row of the block: whatever rows share the block, a row
// gets the same bits. column(k, w) puts the panel's 16 weights at feature k into w; `table`: the
// thread's buffer for them.
template <class Column>
void add_carried(const Carried& c, Column&& column, std::vector<float>& table, float* y, int64_t y_stride, int64_t b0,
                 int64_t cols) {
  if (c.features.empty()) return;
  table.resize(c.features.size() * 16);
  for (size_t i = 0; i < c.features.size(); ++i) column(c.features[i], table.data() + 16 * i);
  for (size_t i = 0; i + 1 < c.starts.size(); ++i) {
    if (c.starts[i] == c.starts[i + 1]) continue;
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int32_t j = c.starts[i]; j < c.starts[i + 1]; ++j) {
      const float* w = table.data() + 16 * c.slots[j];
      const __m256 e = _mm256_set1_ps(c.values[j]);
      lo = _mm256_fmadd_ps(_mm256_loadu_ps(w), e, lo);
      hi = _mm256_fmadd_ps(_mm256_loadu_ps(w + 8), e, hi);
    }
    float* out = y + (b0 + static_cast<int64_t>(i)) * y_stride;
    if (cols == 16) {
      _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), lo));
      _mm256_storeu_ps(out + 8, _mm256_add_ps(_mm256_loadu_ps(out + 8), hi));
    } else {
      alignas(32) float sum[16];
      _mm256_store_ps(sum, lo);
      _mm256_store_ps(sum + 8, hi);
      for (int64_t col = 0; col < cols; ++col) out[col] += sum[col];
    }
  }
}

#if defined(CONVEYOR_INT8_512)
// Byte tables for the unpacking (VBMI permutes and multishifts), built once.
struct Tables {
  alignas(64) uint8_t nibble_a[64], nibble_b[64];  // from (low nibbles, high nibbles) of 8 k
  alignas(64) uint8_t bit5_src[64], bit5_a[64], bit5_b[64];
  alignas(64) uint8_t bit6_src[64], bit6_a[64], bit6_b[64];
  alignas(64) uint8_t q8[64];
  Tables() {
    for (int c = 0; c < 16; ++c)
      for (int j = 0; j < 4; ++j) {
        const int o = 4 * c + j;
        // 8 bytes of nibbles a k: column c < 8 in byte c's low nibble, c >= 8 in byte c - 8's high one
        nibble_a[o] = static_cast<uint8_t>((c < 8 ? 0 : 64) + j * 8 + c % 8);
        nibble_b[o] = static_cast<uint8_t>((c < 8 ? 0 : 64) + (j + 4) * 8 + c % 8);
        // multishift: the 8 bits from bit p - 4 of the byte's qword put bit p at bit 4
        bit5_a[o] = static_cast<uint8_t>((8 * j + c % 8 - 4) & 63);
        bit5_b[o] = static_cast<uint8_t>((8 * (j + 4) + c % 8 - 4) & 63);
        bit6_a[o] = static_cast<uint8_t>((8 * j + 2 * (c % 4) - 4) & 63);
        bit6_b[o] = static_cast<uint8_t>((8 * (j + 4) + 2 * (c % 4) - 4) & 63);
        q8[o] = static_cast<uint8_t>(j * 16 + c);
      }
    // qword q serves columns 2q, 2q + 1; its byte t is k t's byte that holds their high bits:
    // 5-bit codes a uint16 a k (bit c: column c), 6-bit codes a uint32 (bits 2c, 2c + 1).
    for (int q = 0; q < 8; ++q)
      for (int t = 0; t < 8; ++t) {
        bit5_src[q * 8 + t] = static_cast<uint8_t>(2 * t + q / 4);
        bit6_src[q * 8 + t] = static_cast<uint8_t>(4 * t + q / 2);
      }
  }
};
const Tables& tables() {
  static const Tables t;
  return t;
}
inline __m512i table(const uint8_t* p) { return _mm512_load_si512(p); }

// One group's codes (32 k) as 8 steps of 4 k x 16 columns x 4 codes, unsigned (Q8_0's with 128 added).
template <int kBits>
inline void group_codes(const uint8_t* codes, int64_t g, const Tables& tb, __m512i (&w)[8]) {
  if constexpr (kBits == 8) {
    const uint8_t* src = codes + g * 32 * 16;
    const __m512i perm = table(tb.q8), flip = _mm512_set1_epi8(static_cast<char>(0x80));
    _Pragma("GCC unroll 8") for (int s = 0; s < 8; ++s)
      w[s] = _mm512_xor_si512(_mm512_permutexvar_epi8(perm, _mm512_loadu_si512(src + 64 * s)), flip);
  } else {
    const uint8_t* chunk = codes + g * kChunkBytes(kBits);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    _Pragma("GCC unroll 4") for (int h = 0; h < 4; ++h) {  // 8 k a step
      const __m512i v = _mm512_loadu_si512(chunk + 64 * h);
      const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      __m512i a = _mm512_permutex2var_epi8(lo, table(tb.nibble_a), hi);
      __m512i b = _mm512_permutex2var_epi8(lo, table(tb.nibble_b), hi);
      if constexpr (kBits == 5) {
        const __m512i high = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 256 + 16 * h)));
        const __m512i src = _mm512_permutexvar_epi8(table(tb.bit5_src), high), bit = _mm512_set1_epi8(0x10);
        a = _mm512_ternarylogic_epi32(a, _mm512_multishift_epi64_epi8(table(tb.bit5_a), src), bit, 0xF8);  // a | (b & c)
        b = _mm512_ternarylogic_epi32(b, _mm512_multishift_epi64_epi8(table(tb.bit5_b), src), bit, 0xF8);
      } else if constexpr (kBits == 6) {
        const __m512i high = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 256 + 32 * h)));
        const __m512i src = _mm512_permutexvar_epi8(table(tb.bit6_src), high), bits = _mm512_set1_epi8(0x30);
        a = _mm512_ternarylogic_epi32(a, _mm512_multishift_epi64_epi8(table(tb.bit6_a), src), bits, 0xF8);
        b = _mm512_ternarylogic_epi32(b, _mm512_multishift_epi64_epi8(table(tb.bit6_b), src), bits, 0xF8);
      }
      w[2 * h] = a;
      w[2 * h + 1] = b;
    }
  }
}

// One group's codes -> out, 8 x 64 bytes.
template <int kBits>
inline void unpack_codes(const uint8_t* codes, int64_t g, uint8_t* out, const Tables& tb) {
  __m512i w[8];
  group_codes<kBits>(codes, g, tb, w);
  _Pragma("GCC unroll 8") for (int s = 0; s < 8; ++s) _mm512_storeu_si512(out + 64 * s, w[s]);
}

// One group's share of R rows' sums, its codes step by step from code(s) (step s: 4 k x 16 columns
// x 4 codes): the buffered tiles read them from the buffer, the fused rows from registers, and both
// sum in this one order, so a row's bits do not depend on which path ran it. kHalves: Q6_K (two
// scales a group, each its own integer sum); kMin: a minimum a group.
template <int R, bool kHalves, bool kMin, class Codes>
__attribute__((always_inline)) inline void add_group(Codes&& code, const float* scales, const int32_t* xw, const Meta* meta,
                                                  __m512 (&sums)[R]) {
  __m512 part[R];
  _Pragma("GCC unroll 2") for (int half = 0; half < (kHalves ? 2 : 1); ++half) {
    __m512i acc[R];
    _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)
      acc[r] = _mm512_set1_epi32(half ? meta[r].init_b : meta[r].init_a);
    constexpr int kSteps = kHalves ? 4 : 8;
    _Pragma("GCC unroll 8") for (int s = half * kSteps; s < (half + 1) * kSteps; ++s) {
      const __m512i w = code(s);
      _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)
        acc[r] = _mm512_dpbusd_epi32(acc[r], w, _mm512_set1_epi32(xw[s * R + r]));
    }
    const __m512 scale = _mm512_loadu_ps(scales + 16 * half);
    _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)
      part[r] = half ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), scale, part[r])
                     : _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r]), scale);
  }
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) sums[r] = _mm512_fmadd_ps(part[r], _mm512_set1_ps(meta[r].dx), sums[r]);
  if constexpr (kMin) {
    const __m512 minimum = _mm512_loadu_ps(scales + 16);
    _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)
      sums[r] = _mm512_fmadd_ps(_mm512_set1_ps(meta[r].cmin), minimum, sums[r]);
  }
}

// R rows x 16 columns over a panel's groups, their codes and scales from the thread's buffer.
template <int R, bool kHalves, bool kMin>
void tile(const uint8_t* codes, const float* scales, const uint8_t* xt, const Meta* meta, int64_t groups,
          const float* bias, float* y, int64_t y_stride, int64_t cols, NextPanel& ahead) {
  __m512 sums[R];
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, codes += kGroupCodeBytes, scales += kGroupScales, xt += 32 * R, meta += R) {
    ahead.step();
    add_group<R, kHalves, kMin>([codes](int s) { return _mm512_loadu_si512(codes + 64 * s); }, scales,
                                reinterpret_cast<const int32_t*>(xt), meta, sums);
  }
  store_sums512<R>(sums, bias, y, y_stride, cols);
}

// A few rows against a whole panel, each group's codes unpacked into registers and multiplied there
// (with so few rows to share them, storing them to the buffer and reading them back cost more than
// the products: docs/PERF.md). Each group's scales are left at panel_scales (the buffer's layout)
// for packed_column.
template <int R, int kBits, bool kHalves, bool kMin>
void rows_times_panel(QType t, const uint8_t* panel, int64_t units, int64_t unit_bytes, int64_t header,
                      int64_t unit_groups, const uint8_t* xt, const Meta* meta, const float* bias, float* y,
                      int64_t y_stride, int64_t cols, float* panel_scales, NextPanel& ahead) {
  const Tables& tb = tables();
  __m512 sums[R];
  _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_ps();
  for (int64_t u = 0; u < units; ++u, panel += unit_bytes)
    for (int64_t g = 0; g < unit_groups; ++g, xt += 32 * R, meta += R, panel_scales += kGroupScales) {
      ahead.step();
      unpack_scales(t, panel, g, panel_scales);
      __m512i w[8];
      group_codes<kBits>(panel + header, g, tb, w);
      add_group<R, kHalves, kMin>([&w](int s) { return w[s]; }, panel_scales, reinterpret_cast<const int32_t*>(xt),
                                  meta, sums);
    }
  store_sums512<R>(sums, bias, y, y_stride, cols);
}

// buffered_column's 16 weights with the codes read from the packed panel itself (the fused path has
// no buffer of them; `scales`: the panel's groups' scales as rows_times_panel left them).
template <int kBits, bool kHalves, bool kSigned>
inline void packed_column(const uint8_t* panel, int64_t unit_bytes, int64_t header, int64_t unit_groups,
                          const float* scales, int64_t k, int32_t offset, float* out) {
  const int64_t g = k / 32;
  alignas(64) uint8_t group[kGroupCodeBytes];
  unpack_codes<kBits>(panel + g / unit_groups * unit_bytes + header, g % unit_groups, group, tables());
  buffered_column<kHalves, kSigned>(group, scales + g * kGroupScales, k % 32, offset, out);
}

#else  // AVX2

// Byte c * 4 + j of a 16-byte lane <- byte j * 4 + c: a 4 x 4 transpose.
inline __m256i transpose4x4(__m256i v) {
  return _mm256_shuffle_epi8(v, _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                                 0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
}
// 4 k x 8 bytes (k-major) -> 8 dwords, dword c = byte c of k 0..3.
inline __m256i transpose4x8(__m256i v) {
  return transpose4x4(_mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)));
}

// Step s (4 k) of group g: columns 0-7 in `lo`, 8-15 in `hi`, dword c = the column's 4 codes.
template <int kBits>
inline void codes_step(const uint8_t* codes, int64_t g, int s, __m256i& lo, __m256i& hi) {
  if constexpr (kBits == 8) {  // 16 signed codes a k
    const uint8_t* src = codes + (g * 32 + 4 * s) * 16;
    const __m256i k01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    const __m256i k23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
    // columns 0-7 of k 0, 2 | 1, 3 (qwords), then columns 8-15
    lo = transpose4x4(_mm256_permutevar8x32_epi32(_mm256_unpacklo_epi64(k01, k23), _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7)));
    hi = transpose4x4(_mm256_permutevar8x32_epi32(_mm256_unpackhi_epi64(k01, k23), _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7)));
  } else {
    const uint8_t* chunk = codes + g * kChunkBytes(kBits);
    const __m256i v = transpose4x8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32 * s)));
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    lo = _mm256_and_si256(v, low4);
    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    if constexpr (kBits == 5) {
      // 4 uint16 (bit c: column c); dword c's byte j tests bit c of k j's byte 0 (columns 0-7) or 1
      uint64_t bits8;
      std::memcpy(&bits8, chunk + 256 + 8 * s, 8);
      const __m256i h = _mm256_set1_epi64x(static_cast<int64_t>(bits8));
      const __m256i mask = _mm256_setr_epi32(0x01010101, 0x02020202, 0x04040404, 0x08080808, 0x10101010, 0x20202020,
                                             0x40404040, static_cast<int32_t>(0x80808080));
      const __m256i bit = _mm256_set1_epi8(0x10);
      const __m256i from_lo = _mm256_shuffle_epi8(h, _mm256_set1_epi32(0x06040200));
      const __m256i from_hi = _mm256_shuffle_epi8(h, _mm256_set1_epi32(0x07050301));
      lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(from_lo, mask), mask), bit));
      hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(from_hi, mask), mask), bit));
    } else if constexpr (kBits == 6) {
      // 4 uint32 (bits 2c, 2c + 1: column c); dword c's byte j <- k j's byte (c / 4, or 2 + c / 4 for
      // columns 8-15), shifted so that bits 2 (c % 4), +1 land on bits 4-5 without leaving the byte
      const __m256i h = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 256 + 16 * s)));
      const __m256i left = _mm256_setr_epi32(4, 2, 0, 0, 4, 2, 0, 0), right = _mm256_setr_epi32(0, 0, 0, 2, 0, 0, 0, 2);
      const __m256i bits = _mm256_set1_epi8(0x30);
      const __m256i from_lo = _mm256_shuffle_epi8(h, _mm256_setr_epi8(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12,
                                                                      1, 5, 9, 13, 1, 5, 9, 13, 1, 5, 9, 13, 1, 5, 9, 13));
      const __m256i from_hi = _mm256_shuffle_epi8(h, _mm256_setr_epi8(2, 6, 10, 14, 2, 6, 10, 14, 2, 6, 10, 14, 2, 6, 10, 14,
                                                                      3, 7, 11, 15, 3, 7, 11, 15, 3, 7, 11, 15, 3, 7, 11, 15));
      lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_srlv_epi32(_mm256_sllv_epi32(from_lo, left), right), bits));
      hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srlv_epi32(_mm256_sllv_epi32(from_hi, left), right), bits));
    }
  }
}

template <int kBits>
inline void unpack_codes(const uint8_t* codes, int64_t g, uint8_t* out) {
  for (int s = 0; s < 8; ++s) {  // 4 k a step: columns 0-7 in out's first 32 bytes, 8-15 in the next
    __m256i lo, hi;
    codes_step<kBits>(codes, g, s, lo, hi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64 * s), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64 * s + 32), hi);
  }
}

// R rows x 8 columns (half `half` of the panel) over a panel's groups. vpmaddubsw's int16 pair sums
// add up over kSteps16 steps before they widen (at most 2 x 63 x 127 a pair for 6-bit codes, so
// 2 steps; 4 for 5-bit, 8 for 4-bit; Q8_0 signed, |code| <= 128: 1).
template <int R, bool kHalves, bool kMin, int kSteps16, bool kSigned>
void tile_half(const uint8_t* codes, const float* scales, const uint8_t* xt, const Meta* meta, int64_t groups,
               int half_cols, const float* bias, float* y, int64_t y_stride, int64_t cols, NextPanel& ahead) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 sums[R];
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_ps();
  codes += 32 * half_cols;
  scales += 8 * half_cols;
  for (int64_t g = 0; g < groups; ++g, codes += kGroupCodeBytes, scales += kGroupScales, xt += 32 * R, meta += R) {
    ahead.step();
    const int32_t* xw = reinterpret_cast<const int32_t*>(xt);
    __m256 part[R];
    _Pragma("GCC unroll 2") for (int half = 0; half < (kHalves ? 2 : 1); ++half) {
      __m256i acc[R];
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
        acc[r] = _mm256_set1_epi32(half ? meta[r].init_b : meta[r].init_a);
      constexpr int kSteps = kHalves ? 4 : 8;
      _Pragma("GCC unroll 8") for (int s0 = half * kSteps; s0 < (half + 1) * kSteps; s0 += kSteps16) {
        __m256i pairs[R];
        _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) pairs[r] = _mm256_setzero_si256();
        _Pragma("GCC unroll 8") for (int s = s0; s < s0 + kSteps16; ++s) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * s));
          const __m256i w_abs = kSigned ? _mm256_sign_epi8(w, w) : w;
          _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
            __m256i xv = _mm256_set1_epi32(xw[s * R + r]);
            if constexpr (kSigned) xv = _mm256_sign_epi8(xv, w);
            pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(w_abs, xv));
            // Each sum in a register as it stands: GCC otherwise regroups a row's additions over the
            // unrolled steps into a tree, whose partial sums no longer fit in the 16 ymm registers.
            __asm__("" : "+x"(pairs[r]));
          }
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
          acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(pairs[r], ones));
          __asm__("" : "+x"(acc[r]));
        }
      }
      const __m256 scale = _mm256_loadu_ps(scales + 16 * half);
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
        part[r] = half ? _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), scale, part[r])
                       : _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r]), scale);
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) sums[r] = _mm256_fmadd_ps(part[r], _mm256_set1_ps(meta[r].dx), sums[r]);
    if constexpr (kMin) {
      const __m256 minimum = _mm256_loadu_ps(scales + 16);
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
        sums[r] = _mm256_fmadd_ps(_mm256_set1_ps(meta[r].cmin), minimum, sums[r]);
    }
  }
  alignas(32) float row[8];
  const int64_t first = 8 * half_cols, n = std::min<int64_t>(8, cols - first);
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(row, sums[r]);
    float* out = y + r * y_stride + first;
    for (int64_t c = 0; c < n; ++c) out[c] = bias ? row[c] + bias[first + c] : row[c];
  }
}

template <int R, bool kHalves, bool kMin, int kSteps16, bool kSigned>
void tile(const uint8_t* codes, const float* scales, const uint8_t* xt, const Meta* meta, int64_t groups,
          const float* bias, float* y, int64_t y_stride, int64_t cols, NextPanel& ahead) {
  tile_half<R, kHalves, kMin, kSteps16, kSigned>(codes, scales, xt, meta, groups, 0, bias, y, y_stride, cols, ahead);
  if (cols > 8)
    tile_half<R, kHalves, kMin, kSteps16, kSigned>(codes, scales, xt, meta, groups, 1, bias, y, y_stride, cols, ahead);
}

// buffered_column's 16 weights with the codes read from the packed panel itself (the fused path has
// no buffer of them; `scales`: the panel's groups' scales as rows_times_panel left them).
template <int kBits, bool kHalves, bool kSigned>
inline void packed_column(const uint8_t* panel, int64_t unit_bytes, int64_t header, int64_t unit_groups,
                          const float* scales, int64_t k, int32_t offset, float* out) {
  const int64_t g = k / 32, kk = k % 32;
  __m256i word[2];
  codes_step<kBits>(panel + g / unit_groups * unit_bytes + header, g % unit_groups, static_cast<int>(kk / 4), word[0],
                    word[1]);
  _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h)
    _mm256_storeu_ps(out + 8 * h, column_values<kSigned>(word[h], kk, offset,
                                                         _mm256_loadu_ps(scales + g * kGroupScales +
                                                                         (kHalves && kk >= 16 ? 16 : 0) + 8 * h)));
}

// A few rows against a whole panel, its codes unpacked a step at a time into registers and
// multiplied there: with so few rows to share them, unpacking into the buffer and reading back
// (above) costs as much as the products. The same sums in the same order as tile<R>, so the same
// results. Each group's scales are left at panel_scales (the buffer's layout) for packed_column.
template <int R, int kBits, bool kHalves, bool kMin, int kSteps16, bool kSigned>
void rows_times_panel(QType t, const uint8_t* panel, int64_t units, int64_t unit_bytes, int64_t header,
                      int64_t unit_groups, const uint8_t* xt, const Meta* meta, const float* bias, float* y,
                      int64_t y_stride, int64_t cols, float* panel_scales, NextPanel& ahead) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 sums[R][2];
  _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_ps();
  for (int64_t u = 0; u < units; ++u, panel += unit_bytes)
    for (int64_t g = 0; g < unit_groups; ++g, xt += 32 * R, meta += R, panel_scales += kGroupScales) {
      ahead.step();
      const float* scales = panel_scales;
      unpack_scales(t, panel, g, panel_scales);
      const int32_t* xw = reinterpret_cast<const int32_t*>(xt);
      __m256 part[R][2];
      _Pragma("GCC unroll 2") for (int half = 0; half < (kHalves ? 2 : 1); ++half) {
        __m256i acc[R][2];
        _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r)
          acc[r][0] = acc[r][1] = _mm256_set1_epi32(half ? meta[r].init_b : meta[r].init_a);
        constexpr int kSteps = kHalves ? 4 : 8;
        _Pragma("GCC unroll 8") for (int s0 = half * kSteps; s0 < (half + 1) * kSteps; s0 += kSteps16) {
          __m256i pairs[R][2];
          _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) pairs[r][0] = pairs[r][1] = _mm256_setzero_si256();
          _Pragma("GCC unroll 8") for (int s = s0; s < s0 + kSteps16; ++s) {
            __m256i w[2];
            codes_step<kBits>(panel + header, g, s, w[0], w[1]);
            _Pragma("GCC unroll 2") for (int c = 0; c < 2; ++c) {
              const __m256i w_abs = kSigned ? _mm256_sign_epi8(w[c], w[c]) : w[c];
              _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {
                __m256i xv = _mm256_set1_epi32(xw[s * R + r]);
                if constexpr (kSigned) xv = _mm256_sign_epi8(xv, w[c]);
                pairs[r][c] = _mm256_add_epi16(pairs[r][c], _mm256_maddubs_epi16(w_abs, xv));
              }
            }
          }
          _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r)
            _Pragma("GCC unroll 2") for (int c = 0; c < 2; ++c)
              acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(pairs[r][c], ones));
        }
        _Pragma("GCC unroll 2") for (int c = 0; c < 2; ++c) {
          const __m256 scale = _mm256_loadu_ps(scales + 16 * half + 8 * c);
          _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r)
            part[r][c] = half ? _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][c]), scale, part[r][c])
                              : _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][c]), scale);
        }
      }
      _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r)
        _Pragma("GCC unroll 2") for (int c = 0; c < 2; ++c)
          sums[r][c] = _mm256_fmadd_ps(part[r][c], _mm256_set1_ps(meta[r].dx), sums[r][c]);
      if constexpr (kMin) {
        _Pragma("GCC unroll 2") for (int c = 0; c < 2; ++c) {
          const __m256 minimum = _mm256_loadu_ps(scales + 16 + 8 * c);
          _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r)
            sums[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(meta[r].cmin), minimum, sums[r][c]);
        }
      }
    }
  alignas(32) float row[16];
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(row, sums[r][0]);
    _mm256_store_ps(row + 8, sums[r][1]);
    float* out = y + r * y_stride;
    for (int64_t c = 0; c < cols; ++c) out[c] = bias ? row[c] + bias[c] : row[c];
  }
}
#endif

// Everything the product needs for one block type, at compile time.
template <QType T>
struct Kind {
  static constexpr Layout L = layout_of(T);
  static constexpr bool kHalves = T == QType::kQ6_K;
  static constexpr bool kMin = T == QType::kQ4_1 || T == QType::kQ5_1 || T == QType::kQ4_K || T == QType::kQ5_K;
  static constexpr int32_t kOffset = code_offset(T);
#if defined(CONVEYOR_INT8_512)
  static constexpr bool kSignedCodes = false;
#else
  static constexpr bool kSignedCodes = L.bits == 8;  // AVX2 keeps Q8_0's codes signed
#endif

  // A panel's groups (codes, scales) into the thread's buffers.
  static void unpack(const uint8_t* panel, int64_t units, uint8_t* codes, float* scales) {
#if defined(CONVEYOR_INT8_512)
    const Tables& tb = tables();
#endif
    constexpr int64_t kGroups = L.unit_k / 32;
    for (int64_t u = 0; u < units; ++u, panel += L.unit_bytes)
      for (int64_t g = 0; g < kGroups; ++g, codes += kGroupCodeBytes, scales += kGroupScales) {
#if defined(CONVEYOR_INT8_512)
        unpack_codes<L.bits>(panel + L.header, g, codes, tb);
#else
        unpack_codes<L.bits>(panel + L.header, g, codes);
#endif
        unpack_scales(T, panel, g, scales);
      }
  }

  template <int R>
  static void run_tile(const uint8_t* codes, const float* scales, const uint8_t* xt, const Meta* meta, int64_t groups,
                       const float* bias, float* y, int64_t y_stride, int64_t cols, NextPanel& ahead) {
#if defined(CONVEYOR_INT8_512)
    tile<R, kHalves, kMin>(codes, scales, xt, meta, groups, bias, y, y_stride, cols, ahead);
#else
    tile<R, kHalves, kMin, kSteps16, L.bits == 8>(codes, scales, xt, meta, groups, bias, y, y_stride, cols, ahead);
#endif
  }

#if !defined(CONVEYOR_INT8_512)
  static constexpr int kSteps16 = L.bits == 4 ? 8 : L.bits == 5 ? 4 : L.bits == 6 ? 2 : 1;
#endif
  template <int R>
  static void run_rows(const uint8_t* panel, int64_t units, const uint8_t* xt, const Meta* meta, const float* bias,
                       float* y, int64_t y_stride, int64_t cols, float* panel_scales, NextPanel& ahead) {
#if defined(CONVEYOR_INT8_512)
    rows_times_panel<R, L.bits, kHalves, kMin>(T, panel, units, L.unit_bytes, L.header, L.unit_k / 32, xt, meta, bias,
                                               y, y_stride, cols, panel_scales, ahead);
#else
    rows_times_panel<R, L.bits, kHalves, kMin, kSteps16, L.bits == 8>(T, panel, units, L.unit_bytes, L.header,
                                                                      L.unit_k / 32, xt, meta, bias, y, y_stride, cols,
                                                                      panel_scales, ahead);
#endif
  }
};

template <QType T>
void matmul(const float* x, int64_t x_stride, int64_t m, const uint8_t* w, int64_t panels, int64_t units,
            const float* bias, float* y, int64_t out_features) {
  using K = Kind<T>;
  const int64_t k_dim = units * K::L.unit_k, groups = k_dim / 32;
  // x quantised, tile by tile: tile (r0, rows) holds its codes at xq + r0 * K, its Meta at meta + r0 * groups.
  std::vector<uint8_t> xq(static_cast<size_t>(m * k_dim));
  std::vector<Meta> meta(static_cast<size_t>(m * groups));
  // Row r's outliers at outliers[r * groups ..], outlier_counts[r] of them.
  std::vector<Outlier> outliers(static_cast<size_t>(m * groups));
  std::vector<int32_t> outlier_counts(static_cast<size_t>(m));
  std::vector<std::pair<int64_t, int64_t>> tiles;
  for_tiles(m, k_dim, [&](int64_t r0, int64_t rows) { tiles.emplace_back(r0, rows); });
  parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (const auto& [r0, rows] : tiles)
      for (int64_t r = std::max(begin, r0); r < std::min(end, r0 + rows); ++r)
        outlier_counts[r] = quantize_row(x + r * x_stride, k_dim, K::kOffset, K::kHalves, rows, r - r0,
                                         xq.data() + r0 * k_dim, meta.data() + r0 * groups, outliers.data() + r * groups);
  });
  std::vector<Carried> carried;  // each row block's outliers
  for_blocks(m, row_block(k_dim), [&](int64_t b0, int64_t block_rows) {
    carried.push_back(carried_by_rows(outliers.data(), outlier_counts.data(), b0, block_rows, groups, k_dim));
  });
  if (m <= kFusedRows) {  // one tile (kFusedRows <= kTileRows): its codes at xq, its Meta at meta; one block
    parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      const int64_t panel_bytes = units * K::L.unit_bytes;
      thread_local std::vector<float> table, scales;
      scales.resize(static_cast<size_t>(groups * kGroupScales));
      NextPanel ahead;  // a few lines a group
      for (int64_t p = begin; p < end; ++p) {
        const int64_t col0 = p * kPanel, cols = std::min(kPanel, out_features - col0);
        ahead.aim(p + 1 < end ? w + (p + 1) * panel_bytes : nullptr, panel_bytes, groups);
        with_rows<kFusedRows>(m, [&](auto tile_rows) {
          K::template run_rows<decltype(tile_rows)::value>(w + p * panel_bytes, units, xq.data(), meta.data(),
                                                           bias ? bias + col0 : nullptr, y + col0, out_features, cols,
                                                           scales.data(), ahead);
        });
        add_carried(carried[0], [&](int64_t k, float* column) {
          packed_column<K::L.bits, K::kHalves, K::kSignedCodes>(w + p * panel_bytes, K::L.unit_bytes, K::L.header,
                                                                K::L.unit_k / 32, scales.data(), k, K::kOffset, column);
        }, table, y + col0, out_features, 0, cols);
      }
    });
    return;
  }
  parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint8_t> codes;
    thread_local std::vector<float> scales, table;
    codes.resize(static_cast<size_t>(groups * kGroupCodeBytes));
    scales.resize(static_cast<size_t>(groups * kGroupScales));
    const int64_t panel_bytes = units * K::L.unit_bytes;
    NextPanel ahead;  // a few lines a group of each tile
    size_t block = 0;
    for_blocks(m, row_block(k_dim), [&](int64_t b0, int64_t block_rows) {
      const int64_t tiles = (block_rows + kTileRows - 1) / kTileRows;
      for (int64_t p = begin; p < end; ++p) {
        const int64_t col0 = p * kPanel, cols = std::min(kPanel, out_features - col0);
        K::unpack(w + p * panel_bytes, units, codes.data(), scales.data());
        ahead.aim(p + 1 < end ? w + (p + 1) * panel_bytes : nullptr, panel_bytes, tiles * groups);
        for_balanced_tiles<kTileRows>(block_rows, [&](int64_t t0, int64_t rows) {
          const int64_t r0 = b0 + t0;
          with_rows<kTileRows>(rows, [&](auto tile_rows) {
            K::template run_tile<decltype(tile_rows)::value>(codes.data(), scales.data(), xq.data() + r0 * k_dim,
                                                             meta.data() + r0 * groups, groups,
                                                             bias ? bias + col0 : nullptr, y + r0 * out_features + col0,
                                                             out_features, cols, ahead);
          });
        });
        add_carried(carried[block], [&](int64_t k, float* column) {
          buffered_column<K::kHalves, K::kSignedCodes>(codes.data(), scales.data(), k, K::kOffset, column);
        }, table, y + col0, out_features, b0, cols);
      }
      ++block;
    });
  });
}

#if defined(CONVEYOR_INT8_512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define CONVEYOR_AMX_BF16 1
// --- Prompt products on AMX tiles in bf16 (Intel CPUs with AMX-BF16). A panel's blocks are
// expanded once a call into bf16 weights laid out as the tile unit reads them (a group's 32 k as
// 16 rows of k pairs x 16 columns), x is rounded to bf16 once, and the sums stay in fp32 tiles
// over the whole of K: the products never leave the tile unit until the end, which is what the
// unit's peak needs (the int8 groups' per-32 scales cannot: docs/PERF.md). Each output is its
// row's own chain of tile products in k order, so a row's bits do not depend on the rows beside
// it; they differ from the int8 kernel's (x and the weights rounded to bf16 instead of x quantised
// to int8), so a caller picks the kernel by a row's kind (a prompt token's), never by batch size.
constexpr int64_t kAmxTileRows = 16;
constexpr int64_t kGroupTileBytes = 16 * 64;  // a group's 32 k x 16 columns of bf16

bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

// Tiles 0-3: sums of 2 x 2 (row tile, panel); 4-5: x's rows at a group's 32 k; 6-7: two panels'
// weights at that group.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = 16;
  }
};

// A panel's groups (its unpacked codes and scales) as bf16 weights: group g at out + g * 1 KiB,
// row i holding k 2i, 2i + 1 of each column as a pair.
template <QType T>
void expand_bf16(const uint8_t* codes, const float* scales, int64_t groups, uint8_t* out) {
  using K = Kind<T>;
  const __m512i byte = _mm512_set1_epi32(0xFF), offset = _mm512_set1_epi32(K::kOffset);
  alignas(64) static const uint16_t pairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_load_si512(pairs);
  for (int64_t g = 0; g < groups; ++g, codes += kGroupCodeBytes, scales += kGroupScales, out += kGroupTileBytes) {
    const __m512 minimum = K::kMin ? _mm512_loadu_ps(scales + 16) : _mm512_setzero_ps();
    _Pragma("GCC unroll 8") for (int s = 0; s < 8; ++s) {
      const __m512 scale = _mm512_loadu_ps(scales + (K::kHalves && s >= 4 ? 16 : 0));
      const __m512i v = _mm512_loadu_si512(codes + 64 * s);
      __m512 w[4];
      _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j) {
        const __m512i q = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(v, 8 * j), byte), offset);
        w[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), scale, minimum);
      }
      _mm512_storeu_si512(out + 128 * s, _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0])));
      _mm512_storeu_si512(out + 128 * s + 64, _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(w[3], w[2])));
    }
  }
}

template <QType T>
void bf16_matmul(const float* x, int64_t x_stride, int64_t m, const uint8_t* w, int64_t panels, int64_t units,
                 const float* bias, float* y, int64_t out_features) {
  using K = Kind<T>;
  const int64_t k_dim = units * K::L.unit_k, groups = k_dim / 32;
  const int64_t m_pad = (m + 2 * kAmxTileRows - 1) / (2 * kAmxTileRows) * (2 * kAmxTileRows);
  // x in bf16 as the tiles read it: row tile t's group g (16 rows x 32 k) one KiB at
  // xb + (t * groups + g) * 512; rows padded with zeros to whole pairs of row tiles.
  std::unique_ptr<uint16_t[]> xb(new uint16_t[static_cast<size_t>(m_pad * k_dim)]);
  for (int64_t r = m; r < m_pad; ++r)  // the padding rows: zeros (their sums are never stored)
    for (int64_t g = 0; g < groups; ++g)
      std::memset(xb.get() + (r / kAmxTileRows) * groups * 512 + g * 512 + (r % kAmxTileRows) * 32, 0, 64);
  parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      uint16_t* row = xb.get() + (r / kAmxTileRows) * groups * 512 + (r % kAmxTileRows) * 32;
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t h = 0; h < 2; ++h)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + g * 512 + 16 * h),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + r * x_stride + 32 * g + 16 * h)));
    }
  });
  // A thread expands a run of its panels (about 1 MiB of bf16, so in L2) once, then every row tile
  // pair passes over them: each panel's blocks are expanded once a call, and x streams once a run.
  const int64_t pairs = (panels + 1) / 2;
  const int64_t run_pairs = std::max<int64_t>(1, (1 << 20) / (2 * groups * kGroupTileBytes));
  parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint8_t> codes, expanded;
    thread_local std::vector<float> scales;
    codes.resize(static_cast<size_t>(groups * kGroupCodeBytes));
    scales.resize(static_cast<size_t>(groups * kGroupScales));
    expanded.resize(static_cast<size_t>(2 * run_pairs * groups * kGroupTileBytes));
    // Static: a configuration on the stack was seen (in an experiment, e5ec78f) not yet stored
    // when ldtilecfg read it; the compiler does not treat that read as a use of the stores.
    static const TileConfig config;
    _tile_loadconfig(&config);
    const int64_t panel_bytes = units * K::L.unit_bytes;
    alignas(64) float sums[4][256];
    for (int64_t run0 = begin; run0 < end; run0 += run_pairs) {
      const int64_t run1 = std::min(end, run0 + run_pairs), last_panel = std::min(panels, 2 * run1);
      for (int64_t p = 2 * run0; p < last_panel; ++p) {
        K::unpack(w + p * panel_bytes, units, codes.data(), scales.data());
        expand_bf16<T>(codes.data(), scales.data(), groups, expanded.data() + (p - 2 * run0) * groups * kGroupTileBytes);
      }
      for (int64_t r0 = 0; r0 < m_pad; r0 += 2 * kAmxTileRows) {
        const uint16_t* xa = xb.get() + r0 / kAmxTileRows * groups * 512;
        const uint16_t* xc = xa + groups * 512;
        for (int64_t pair = run0; pair < run1; ++pair) {
          const int64_t p0 = 2 * pair, count = std::min<int64_t>(2, panels - p0);
          const uint8_t* w0 = expanded.data() + (p0 - 2 * run0) * groups * kGroupTileBytes;
          const uint8_t* w1 = count == 2 ? w0 + groups * kGroupTileBytes : w0;
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t g = 0; g < groups; ++g) {
            _tile_loadd(4, xa + 512 * g, 64);
            _tile_loadd(6, w0 + g * kGroupTileBytes, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, w1 + g * kGroupTileBytes, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, xc + 512 * g, 64);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
          _tile_stored(0, sums[0], 64);
          _tile_stored(1, sums[1], 64);
          _tile_stored(2, sums[2], 64);
          _tile_stored(3, sums[3], 64);
          for (int t = 0; t < 4; ++t) {
            const int64_t panel = p0 + (t & 1);
            if (panel >= p0 + count) continue;
            const int64_t col0 = panel * kPanel, cols = std::min(kPanel, out_features - col0);
            const __mmask16 real = static_cast<__mmask16>((1u << cols) - 1);
            const __m512 add = bias ? _mm512_maskz_loadu_ps(real, bias + col0) : _mm512_setzero_ps();
            const int64_t first = r0 + (t >> 1) * kAmxTileRows, rows = std::min(kAmxTileRows, m - first);
            for (int64_t i = 0; i < rows; ++i)
              _mm512_mask_storeu_ps(y + (first + i) * out_features + col0, real,
                                    _mm512_add_ps(_mm512_load_ps(sums[t] + 16 * i), add));
          }
        }
      }
    }
    _tile_release();
  });
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define CONVEYOR_BF16_DOT 1
// --- 16-bit float weights (BF16 panels: an HF folder's bf16 weights served in fp32, a GGUF's BF16
// tensors; F16 panels: a GGUF's F16 tensors, an HF folder in float16) against x rounded to bf16, on
// AVX512-BF16's vdpbf16ps: 32 multiply-adds an instruction where the fp32 kernel's FMA does 16, and
// the weights' bytes as they lie. A panel is K / 2 rows of 64 bytes, each two k steps of its 16
// columns (quant_gemm.cpp's HalfUnit); one permute turns such a row into the pairs vdpbf16ps reads
// (column c's k, k + 1 in lane c). An F16 row is first widened exactly and rounded to bf16 (to
// nearest even): exact for weights that came from bf16 (most F16 files are converted from bf16
// checkpoints), else at most 2^-8 of each |w|, as vLLM's bf16 casting of float16 models. x is
// rounded to bf16 once a call (to nearest even), and each output is its row's own chain of
// vdpbf16ps over the k pairs in order, accumulated in fp32: a row's bits do not depend on the rows
// beside it or on how many there are. They differ from the exact product's by x's rounding (at most
// 2^-8 of each |x_k|) and by what the instruction flushes to zero (subnormal inputs, products and
// sums: at most 2^-126 each), as the int8 path's do by its quantisation: the same switch
// (activation_dtype) chooses.
constexpr int64_t kBf16TileRows = 12;  // 12 rows x 2 panels of sums: 24 of the 32 zmm registers
constexpr int64_t kHalfUnitK = 32, kHalfUnitBytes = kHalfUnitK * kPanel * 2;

inline __m512i bf16_pair_order() {
  alignas(64) static const uint16_t pairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_load_si512(pairs);
}

// A panel's row of two k steps as vdpbf16ps's pairs.
template <bool kF16>
inline __m512bh bf16_pairs(const uint8_t* row, __m512i order) {
  const __m512i raw = _mm512_loadu_si512(row);
  if constexpr (kF16) {
    const __m512 k0 = _mm512_cvtph_ps(_mm512_castsi512_si256(raw)), k1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(raw, 1));
    return (__m512bh)_mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(k1, k0));
  } else {
    return (__m512bh)_mm512_permutexvar_epi16(order, raw);
  }
}

// Rows [r0, r0 + R) of x (bf16 pairs, xb_stride words a row) times P panels at w[0..P): y's rows,
// `cols` columns of the last panel real (the others whole).
template <int R, int P, bool kF16>
void bf16_dot_tile(const uint32_t* xb, int64_t xb_stride, const uint8_t* w, int64_t panel_bytes, int64_t k_pairs,
                   const float* bias, float* y, int64_t y_stride, int64_t cols) {
  const __m512i order = bf16_pair_order();
  __m512 sums[R][P];
  _Pragma("GCC unroll 12") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 2") for (int p = 0; p < P; ++p) sums[r][p] = _mm512_setzero_ps();
  for (int64_t j = 0; j < k_pairs; ++j) {
    __m512bh wv[P];
    _Pragma("GCC unroll 2") for (int p = 0; p < P; ++p) wv[p] = bf16_pairs<kF16>(w + p * panel_bytes + 64 * j, order);
    _Pragma("GCC unroll 12") for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xb[r * xb_stride + j]));
      _Pragma("GCC unroll 2") for (int p = 0; p < P; ++p) sums[r][p] = _mm512_dpbf16_ps(sums[r][p], xv, wv[p]);
    }
  }
  const __mmask16 last = static_cast<__mmask16>((1u << cols) - 1);
  _Pragma("GCC unroll 2") for (int p = 0; p < P; ++p) {
    const __mmask16 real = p + 1 == P ? last : static_cast<__mmask16>(0xFFFF);
    const __m512 add = bias ? _mm512_maskz_loadu_ps(real, bias + p * kPanel) : _mm512_setzero_ps();
    _Pragma("GCC unroll 12") for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(y + r * y_stride + p * kPanel, real, _mm512_add_ps(sums[r][p], add));
  }
}

template <int P, bool kF16, int R = kBf16TileRows>
void bf16_dot_rows(int64_t rows, const uint32_t* xb, int64_t xb_stride, const uint8_t* w, int64_t panel_bytes,
                   int64_t k_pairs, const float* bias, float* y, int64_t y_stride, int64_t cols) {
  if constexpr (R > 1) {
    if (rows < R) return bf16_dot_rows<P, kF16, R - 1>(rows, xb, xb_stride, w, panel_bytes, k_pairs, bias, y, y_stride, cols);
  }
  bf16_dot_tile<R, P, kF16>(xb, xb_stride, w, panel_bytes, k_pairs, bias, y, y_stride, cols);
}

template <bool kF16>
void bf16_dot_matmul_into(const float* x, int64_t x_stride, int64_t m, const uint8_t* w, int64_t panels,
                          int64_t units, const float* bias, float* y, int64_t out_features) {
  const int64_t k_pairs = units * kHalfUnitK / 2, panel_bytes = units * kHalfUnitBytes;
  std::unique_ptr<uint32_t[]> xb(new uint32_t[static_cast<size_t>(m * k_pairs)]);
  parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t k = 0; k < 2 * k_pairs; k += 32)  // cvtne2ps_pbh(hi, lo): lo's 16 first, so pair j is k 2j, 2j + 1
        _mm512_storeu_si512(xb.get() + r * k_pairs + k / 2,
                            (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + r * x_stride + k + 16),
                                                          _mm512_loadu_ps(x + r * x_stride + k)));
  });
  // A thread takes pairs of panels (two panels' sums for a tile of rows) and passes every row over
  // them, so each weight is read from memory once a call and from L2 after the first tile.
  parallel_for(0, (panels + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t p0 = 2 * pair, count = std::min<int64_t>(2, panels - p0), col0 = p0 * kPanel;
      const int64_t cols = std::min(kPanel, out_features - (p0 + count - 1) * kPanel);
      // Rows shared evenly among the fewest tiles (16 rows: 8 + 8, not 12 + 4): a tile's permutes
      // and weight loads are shared by its rows.
      const int64_t tiles = (m + kBf16TileRows - 1) / kBf16TileRows;
      // F16 weights that more than two tiles read are rounded to bf16 once, into BF16 panels (the
      // same values the in-register rounding gives, so the same bits); for one or two tiles the
      // rounding in registers measured faster than the pass over a buffer.
      const uint8_t* panel = w + p0 * panel_bytes;
      constexpr bool kRoundAhead = kF16;
      if (kRoundAhead && tiles > 2) {
        thread_local std::vector<uint8_t> rounded;
        rounded.resize(static_cast<size_t>(2 * panel_bytes));
        for (int64_t row = 0; row < count * k_pairs; ++row) {
          const __m512i raw = _mm512_loadu_si512(panel + 64 * row);
          const __m512 k0 = _mm512_cvtph_ps(_mm512_castsi512_si256(raw)), k1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(raw, 1));
          _mm512_storeu_si512(rounded.data() + 64 * row, (__m512i)_mm512_cvtne2ps_pbh(k1, k0));
        }
        panel = rounded.data();
      }
      for (int64_t t = 0, r0 = 0; t < tiles; ++t) {
        const int64_t rows = (m - r0 + tiles - t - 1) / (tiles - t);
        const uint32_t* xr = xb.get() + r0 * k_pairs;
        float* yr = y + r0 * out_features + col0;
        const float* b = bias ? bias + col0 : nullptr;
        const bool rounded_ahead = kRoundAhead && tiles > 2;
        if (count == 2 && rounded_ahead)
          bf16_dot_rows<2, false>(rows, xr, k_pairs, panel, panel_bytes, k_pairs, b, yr, out_features, cols);
        else if (count == 2)
          bf16_dot_rows<2, kF16>(rows, xr, k_pairs, panel, panel_bytes, k_pairs, b, yr, out_features, cols);
        else if (rounded_ahead)
          bf16_dot_rows<1, false>(rows, xr, k_pairs, panel, panel_bytes, k_pairs, b, yr, out_features, cols);
        else
          bf16_dot_rows<1, kF16>(rows, xr, k_pairs, panel, panel_bytes, k_pairs, b, yr, out_features, cols);
        r0 += rows;
      }
    }
  });
}
#endif

}  // namespace

// The checks both products make and their dispatch on the block type: product(kind, x, x_stride,
// m, w, panels, units, bias, y, out_features), kind a std::integral_constant<QType, T>. `out`: where
// to write y (contiguous fp32 [M, out_features], e.g. a run of a larger result's rows), else a new
// array.
template <class Product>
Array on_blocks(const char* name, const Array& x, const Array& packed, int64_t out_features,
                const std::optional<Array>& bias, int64_t qtype, const std::optional<Array>& out,
                Product&& product) {
  CHECK(x.dim() == 2 && x.dtype() == DType::kFloat32, name, ": x must be 2-D fp32");
  CHECK(known(qtype), name, ": qtype ", qtype, " is not a GGML block type this kernel reads");
  const auto type = static_cast<QType>(qtype);
  const Layout l = layout_of(type);
  CHECK(packed.dim() == 3 && packed.dtype() == DType::kUInt8 && packed.is_contiguous() &&
        packed.size(2) == l.unit_bytes, name, ": bad packed weight (not pack_quantized's for this qtype)");
  CHECK(packed.size(1) * l.unit_k == x.size(1), name, ": x has ", x.size(1), " features, the weight ",
        packed.size(1) * l.unit_k);
  CHECK(out_features > (packed.size(0) - 1) * kPanel && out_features <= packed.size(0) * kPanel,
        name, ": out_features does not match the packed weight");
  const auto xs = x.stride(1) == 1 ? x : x.contiguous();
  Array b;
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    b = bias->contiguous();
    CHECK(b.dtype() == DType::kFloat32 && b.numel() == out_features, name, ": bad bias");
    bias_ptr = b.data_ptr<float>();
  }
  const int64_t m = xs.size(0), panels = packed.size(0), units = packed.size(1);
  if (out.has_value())
    CHECK(out->dim() == 2 && out->size(0) == m && out->size(1) == out_features &&
          out->dtype() == DType::kFloat32 && out->is_contiguous(),
          name, ": out must be a contiguous fp32 [", m, ", ", out_features, "] array");
  if (out.has_value()) CHECK(out->writeable(), name, ": out must be writeable");
  auto y = out.has_value() ? *out : empty({m, out_features}, x.dtype());
  if (m == 0) return y;
  const float* xp = xs.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  switch (type) {
#define CONVEYOR_QTYPE(T)                                                                                      \
  case QType::k##T:                                                                                            \
    product(std::integral_constant<QType, QType::k##T>{}, xp, xs.stride(0), m, wp, panels, units, bias_ptr, yp, \
            out_features);                                                                                     \
    break;
    CONVEYOR_QTYPE(Q4_0) CONVEYOR_QTYPE(Q4_1) CONVEYOR_QTYPE(Q5_0) CONVEYOR_QTYPE(Q5_1) CONVEYOR_QTYPE(Q8_0)
    CONVEYOR_QTYPE(Q4_K) CONVEYOR_QTYPE(Q5_K) CONVEYOR_QTYPE(Q6_K)
#undef CONVEYOR_QTYPE
  }
  return y;
}

Array int8_matmul(const Array& x, const Array& packed, int64_t out_features,
                  const std::optional<Array>& bias, int64_t qtype,
                  const std::optional<Array>& out) {
  return on_blocks("int8_matmul", x, packed, out_features, bias, qtype, out, [](auto kind, auto... args) {
    matmul<decltype(kind)::value>(args...);
  });
}

// The same product on AMX tiles in bf16 (see bf16_matmul); only where the CPU and the build have them.
Array bf16_tile_matmul(const Array& x, const Array& packed, int64_t out_features,
                       const std::optional<Array>& bias, int64_t qtype,
                       const std::optional<Array>& out) {
#if defined(CONVEYOR_AMX_BF16)
  CHECK(amx_permitted(), "bf16_tile_matmul: the OS does not lend this process AMX tiles");
  return on_blocks("bf16_tile_matmul", x, packed, out_features, bias, qtype, out, [](auto kind, auto... args) {
    bf16_matmul<decltype(kind)::value>(args...);
  });
#else
  (void)x, (void)packed, (void)out_features, (void)bias, (void)qtype, (void)out;
  CHECK(false, "bf16_tile_matmul: this build has no AMX-BF16 (see bf16_tiles())");
#endif
}

// Whether bf16_tile_matmul runs here: built with AMX-BF16 and lent the tiles by the OS.
bool bf16_tiles() {
#if defined(CONVEYOR_AMX_BF16)
  return amx_permitted();
#else
  return false;
#endif
}

// x [M, K] @ W^T (+ bias) for W in BF16 or F16 panels (quant_gemm.pack_quantized, qtype 30 or 1), x
// rounded to bf16 (see bf16_dot_matmul_into); only where the build has AVX512-BF16 (bf16_dot()).
Array bf16_dot_matmul(const Array& x, const Array& packed, int64_t out_features,
                      const std::optional<Array>& bias, int64_t qtype) {
#if defined(CONVEYOR_BF16_DOT)
  CHECK(qtype == static_cast<int64_t>(30) || qtype == static_cast<int64_t>(1),
        "bf16_dot_matmul: qtype ", qtype, " is not BF16 (30) or F16 (1)");
  CHECK(x.dim() == 2 && x.dtype() == DType::kFloat32, "bf16_dot_matmul: x must be 2-D fp32");
  CHECK(packed.dim() == 3 && packed.dtype() == DType::kUInt8 && packed.is_contiguous() &&
        packed.size(2) == kHalfUnitBytes, "bf16_dot_matmul: bad packed weight (not 16-bit panels)");
  CHECK(packed.size(1) * kHalfUnitK == x.size(1), "bf16_dot_matmul: x has ", x.size(1),
        " features, the weight ", packed.size(1) * kHalfUnitK);
  CHECK(out_features > (packed.size(0) - 1) * kPanel && out_features <= packed.size(0) * kPanel,
        "bf16_dot_matmul: out_features does not match the packed weight");
  const auto xs = x.stride(1) == 1 ? x : x.contiguous();
  Array b;
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    b = bias->contiguous();
    CHECK(b.dtype() == DType::kFloat32 && b.numel() == out_features, "bf16_dot_matmul: bad bias");
    bias_ptr = b.data_ptr<float>();
  }
  const int64_t m = xs.size(0);
  auto y = empty({m, out_features}, x.dtype());
  if (m == 0) return y;
  (qtype == 1 ? bf16_dot_matmul_into<true> : bf16_dot_matmul_into<false>)(
      xs.data_ptr<float>(), xs.stride(0), m, packed.data_ptr<uint8_t>(), packed.size(0), packed.size(1), bias_ptr,
      y.data_ptr<float>(), out_features);
  return y;
#else
  (void)x, (void)packed, (void)out_features, (void)bias, (void)qtype;
  CHECK(false, "bf16_dot_matmul: this build has no AVX512-BF16 (see bf16_dot())");
#endif
}

// Whether bf16_dot_matmul runs here: built for a CPU with AVX512-BF16.
bool bf16_dot() {
#if defined(CONVEYOR_BF16_DOT)
  return true;
#else
  return false;
#endif
}

// x [M, K] -> what the product multiplies: (int8 codes [M, K], fp32 dx [M, K / 32], fp32 outliers
// [M, K]: the features carried exactly, zero elsewhere), x's stand-in being codes * dx + outliers; for
// tests and for callers that bound the quantisation error.
std::vector<Array> quantize_activations(const Array& x) {
  CHECK(x.dim() == 2 && x.dtype() == DType::kFloat32 && x.size(1) % 32 == 0,
        "quantize_activations: x must be 2-D fp32 with a multiple of 32 features");
  const auto xs = x.contiguous();
  const int64_t m = xs.size(0), k_dim = xs.size(1), groups = k_dim / 32;
  auto codes = empty({m, k_dim}, DType::kInt8);
  auto scales = empty({m, groups}, DType::kFloat32);
  auto carried = zeros({m, k_dim}, DType::kFloat32);
  std::vector<uint8_t> words(static_cast<size_t>(k_dim));
  std::vector<Meta> meta(static_cast<size_t>(groups));
  std::vector<Outlier> outliers(static_cast<size_t>(groups));
  for (int64_t r = 0; r < m; ++r) {  // a tile of one row: its words in k order
    const int32_t count =
        quantize_row(xs.data_ptr<float>() + r * k_dim, k_dim, 0, false, 1, 0, words.data(), meta.data(), outliers.data());
    std::memcpy(codes.data_ptr<int8_t>() + r * k_dim, words.data(), static_cast<size_t>(k_dim));
    for (int64_t g = 0; g < groups; ++g) scales.data_ptr<float>()[r * groups + g] = meta[g].dx;
    for (int32_t i = 0; i < count; ++i) carried.data_ptr<float>()[r * k_dim + outliers[i].k] = outliers[i].value;
  }
  return {codes, scales, carried};
}

std::string isa() {
#if defined(CONVEYOR_INT8_512)
  return "avx512-vnni";
#else
  return "avx2";
#endif
}

// The ops run without the GIL, so the server's event loop streams responses while a step computes.
PYBIND11_MODULE(CONVEYOR_MODULE_NAME, m) {
  def_thread_functions(m);
  m.def("int8_matmul", &int8_matmul,
        "x [M, K] @ W^T (+ bias) on a weight packed by quant_gemm.pack_quantized, x quantised per 32 to int8; "
        "out: a contiguous [M, N] fp32 array to write it into",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("bias"), py::arg("qtype"),
        py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("quantize_activations", &quantize_activations,
        "x [M, K] -> (int8 codes [M, K], fp32 scales [M, K / 32], fp32 outliers [M, K])",
        py::call_guard<py::gil_scoped_release>());
  m.def("bf16_tile_matmul", &bf16_tile_matmul,
        "x [M, K] @ W^T (+ bias) on a weight packed by quant_gemm.pack_quantized, on AMX tiles in bf16; "
        "out: as int8_matmul's",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("bias"), py::arg("qtype"),
        py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("bf16_tiles", &bf16_tiles, "whether bf16_tile_matmul runs on this CPU and build");
  m.def("bf16_dot_matmul", &bf16_dot_matmul,
        "x [M, K] @ W^T (+ bias) on BF16 or F16 panels (quant_gemm.pack_quantized), x (and F16 weights) rounded "
        "to bf16, vdpbf16ps",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("bias"), py::arg("qtype"),
        py::call_guard<py::gil_scoped_release>());
  m.def("bf16_dot", &bf16_dot, "whether bf16_dot_matmul runs on this CPU and build (AVX512-BF16)");
  m.attr("outlier_ratio") = kOutlierRatio;
  m.def("isa", &isa, "the instruction set this build's dot products use (avx512-vnni or avx2)");
}
