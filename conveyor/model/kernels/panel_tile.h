// The panel tile shared by panel_gemm.cpp (fp32 panels) and quant_gemm.cpp (GGUF blocks):
// up to 6 rows x 16 columns of y = x @ W^T in 12 AVX registers, over one panel [K][16] of W; with
// AVX-512, up to 12 rows x 16 columns in 12 zmm registers (each panel step then feeds twice the
// rows, so the panel is read from L2 half as often at prefill sizes), and up to 14 rows x 32
// columns where a thread has two panels left. Whatever the tile, each column's sum is one FMA a
// k step, in k order: the same results.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <immintrin.h>

#include "spread_prefetch.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the panel kernels need AVX2 and FMA"  // the loader then keeps plain weights for numpy's matmul
#endif

namespace conveyor_panels {

constexpr int64_t kPanel = 16;
constexpr int64_t kPrefetchAhead = 32;  // k steps: 32 cache lines of the panel stream

// The next panel's bytes into L2, a few lines at each step of the current panel's work: where a
// panel's arithmetic is short (decode batches) and its reading comes in bursts (an unpack, a
// screening pass), each panel would otherwise start by waiting on memory.
using NextPanel = conveyor_prefetch::SpreadPrefetcher<2>;

// A tile's sums: row r's 16 columns in lo[r] (columns 0-7) and hi[r] (8-15). Full unrolling
// keeps the arrays in registers.
template <int R>
inline void zero_sums(__m256 (&lo)[R], __m256 (&hi)[R]) {
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
    lo[r] = _mm256_setzero_ps();
    hi[r] = _mm256_setzero_ps();
  }
}

// Rows [0, R) of y = the sums (+ bias); only the first `cols` columns are real.
template <int R>
inline void store_sums(const __m256 (&lo)[R], const __m256 (&hi)[R], const float* bias, float* y, int64_t y_stride,
                       int64_t cols) {
  alignas(32) float row[kPanel];
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
    _mm256_store_ps(row, lo[r]);
    _mm256_store_ps(row + 8, hi[r]);
    float* out = y + r * y_stride;
    for (int64_t c = 0; c < cols; ++c) out[c] = bias ? row[c] + bias[c] : row[c];
  }
}

// Calls tile(r0, rows) for balanced tiles of at most kMax rows over [0, m) (13 rows as 7 + 6, not
// 12 + 1, so no tile is too short to keep the FMAs busy).
template <int64_t kMax, class F>
inline void for_balanced_tiles(int64_t m, F&& tile) {
  const int64_t tiles = (m + kMax - 1) / kMax;
  for (int64_t r0 = 0, t = 0; t < tiles; ++t) {
    const int64_t rows = (m - r0) / (tiles - t);
    tile(r0, rows);
    r0 += rows;
  }
}

// Calls tile(std::integral_constant<int, R>{}) for R = rows, 1 <= rows <= kMax: a tile's row count
// as a compile-time constant, so that its sums are fully unrolled into registers.
template <int kMax, class F>
inline void with_rows(int64_t rows, F&& tile) {
  if constexpr (kMax > 0) {
    if (rows == kMax) tile(std::integral_constant<int, kMax>{});
    else with_rows<kMax - 1>(rows, tile);
  }
}

// x's m rows laid out for tiles of at most kMax rows: tile by tile (for_balanced_tiles), each
// [K][rows] at out + r0 * K, so that a tile reads its rows through one pointer (quant_gemm.cpp's
// fused tiles, whose unpacking needs the general registers that R row pointers would take). Read
// k-major, so the writes are sequential.
template <int64_t kMax>
inline void interleave_rows(const float* x, int64_t x_stride, int64_t m, int64_t k_dim, float* out) {
  for_balanced_tiles<kMax>(m, [&](int64_t r0, int64_t rows) {
    float* tile = out + r0 * k_dim;
    const float* first = x + r0 * x_stride;
    for (int64_t k = 0; k < k_dim; ++k, tile += rows)
      for (int64_t r = 0; r < rows; ++r) tile[r] = first[r * x_stride + k];
  });
}

template <int R, bool kPrefetch>
inline void tile(const float* x, int64_t x_stride, const float* panel, int64_t k_dim, const float* bias,
                 float* y, int64_t y_stride, int64_t cols) {
  __m256 lo[R], hi[R];
  zero_sums<R>(lo, hi);
  for (int64_t k = 0; k < k_dim; ++k) {
    const __m256 w_lo = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 w_hi = _mm256_loadu_ps(panel + k * kPanel + 8);
    // One panel step is one 64-byte line; prefetching past the panel's end reads the next panel,
    // which this thread takes next (and a prefetch past the weight's end cannot fault).
    if constexpr (kPrefetch) _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchAhead) * kPanel), _MM_HINT_T0);
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * x_stride + k);
      lo[r] = _mm256_fmadd_ps(xv, w_lo, lo[r]);
      hi[r] = _mm256_fmadd_ps(xv, w_hi, hi[r]);
    }
  }
  store_sums<R>(lo, hi, bias, y, y_stride, cols);
}

#if defined(__AVX512F__)
constexpr int kMaxTileRows = 12;

// Rows [0, R) of y = the sums (+ bias), one zmm register a row; only the first `cols` columns are real.
template <int R>
inline void store_sums512(const __m512 (&sums)[R], const float* bias, float* y, int64_t y_stride, int64_t cols) {
  alignas(64) float row[kPanel];
  _Pragma("GCC unroll 32") for (int r = 0; r < R; ++r) {
    _mm512_store_ps(row, sums[r]);
    float* out = y + r * y_stride;
    for (int64_t c = 0; c < cols; ++c) out[c] = bias ? row[c] + bias[c] : row[c];
  }
}

template <int R, bool kPrefetch>
inline void tile512(const float* x, int64_t x_stride, const float* panel, int64_t k_dim, const float* bias,
                    float* y, int64_t y_stride, int64_t cols) {
  __m512 sums[R];
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_dim; ++k) {
    const __m512 w = _mm512_loadu_ps(panel + k * kPanel);
    if constexpr (kPrefetch) _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchAhead) * kPanel), _MM_HINT_T0);
    _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)
      sums[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * x_stride + k]), w, sums[r]);
  }
  store_sums512<R>(sums, bias, y, y_stride, cols);
}
#define CONVEYOR_TILE_FN tile512

// Two adjacent panels a tile: R rows x 32 columns in 2R zmm registers. A k step's two weight
// loads and R broadcasts feed 2R FMAs, where the one-panel tile spends a load on every FMA; on a
// core with two 512-bit FMA units the loads then set the pace, here the FMAs do. At decode sizes,
// where the weights' stream sets the pace, the first tile keeps two streams in flight instead of
// one (faster there too: docs/PERF.md). Each column's sum is still one FMA a k step in k order:
// the same bits as tile512.
constexpr int kMaxPairRows = 14;  // 28 sums + 2 weights + 1 broadcast of the 32 zmm registers

template <int R, bool kPrefetch>
inline void pair_tile512(const float* x, int64_t x_stride, const float* left_panel, const float* right_panel,
                         int64_t k_dim, const float* bias, float* y, int64_t y_stride, int64_t right_cols) {
  __m512 left[R], right[R];
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) left[r] = right[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_dim; ++k) {
    const __m512 w_left = _mm512_loadu_ps(left_panel + k * kPanel);
    const __m512 w_right = _mm512_loadu_ps(right_panel + k * kPanel);
    if constexpr (kPrefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(left_panel + (k + kPrefetchAhead) * kPanel), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(right_panel + (k + kPrefetchAhead) * kPanel), _MM_HINT_T0);
    }
    _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * x_stride + k]);
      left[r] = _mm512_fmadd_ps(xv, w_left, left[r]);
      right[r] = _mm512_fmadd_ps(xv, w_right, right[r]);
    }
  }
  store_sums512<R>(left, bias, y, y_stride, kPanel);
  store_sums512<R>(right, bias ? bias + kPanel : nullptr, y + kPanel, y_stride, right_cols);
}
#else
constexpr int kMaxTileRows = 6;
#define CONVEYOR_TILE_FN tile
#endif

// Rows [0, m) against one panel; cols < 16 only in the last panel of an N not divisible by 16.
// The first tile streams the panel from memory; the others find it in L2.
inline void rows_times_panel(const float* x, int64_t x_stride, int64_t m, const float* panel, int64_t k_dim,
                             const float* bias, float* y, int64_t y_stride, int64_t cols, bool from_memory = true) {
  const bool prefetch = from_memory && m > 2;
  for_balanced_tiles<kMaxTileRows>(m, [&](int64_t r, int64_t rows) {
    const float* xr = x + r * x_stride;
    float* yr = y + r * y_stride;
    const bool stream = prefetch && r == 0;
    with_rows<kMaxTileRows>(rows, [&](auto tile_rows) {
      constexpr int R = decltype(tile_rows)::value;
      if (stream) CONVEYOR_TILE_FN<R, true>(xr, x_stride, panel, k_dim, bias, yr, y_stride, cols);
      else CONVEYOR_TILE_FN<R, false>(xr, x_stride, panel, k_dim, bias, yr, y_stride, cols);
    });
  });
}

// Rows [0, m) against two adjacent panels (the left one full); right_cols < 16 only when the
// right one is the last panel of an N not divisible by 16. Without AVX-512 (16 registers) it is
// the one-panel tile twice.
inline void rows_times_panel_pair(const float* x, int64_t x_stride, int64_t m, const float* left_panel,
                                  const float* right_panel, int64_t k_dim, const float* bias, float* y,
                                  int64_t y_stride, int64_t right_cols, bool from_memory = true) {
#if defined(__AVX512F__)
  const bool prefetch = from_memory && m > 2;
  for_balanced_tiles<kMaxPairRows>(m, [&](int64_t r, int64_t rows) {
    const float* xr = x + r * x_stride;
    float* yr = y + r * y_stride;
    const bool stream = prefetch && r == 0;
    with_rows<kMaxPairRows>(rows, [&](auto tile_rows) {
      constexpr int R = decltype(tile_rows)::value;
      if (stream) pair_tile512<R, true>(xr, x_stride, left_panel, right_panel, k_dim, bias, yr, y_stride, right_cols);
      else pair_tile512<R, false>(xr, x_stride, left_panel, right_panel, k_dim, bias, yr, y_stride, right_cols);
    });
  });
#else
  rows_times_panel(x, x_stride, m, left_panel, k_dim, bias, y, y_stride, kPanel, from_memory);
  rows_times_panel(x, x_stride, m, right_panel, k_dim, bias ? bias + kPanel : nullptr, y + kPanel, y_stride,
                   right_cols, from_memory);
#endif
}

// A product of many rows (a prefill chunk) runs in blocks of rows, each over all of a thread's
// panels: a block of x (<= 120 rows, 270-720 KiB at K = 576-1536) stays in L2 while the panels
// pass, where one pass of all the rows per panel read the whole of x from L3 for every panel.
// Blocks of balanced sizes; a decode step's rows are one block.
#if defined(__AVX512F__)
constexpr int64_t kRowBlock = 10 * kMaxTileRows;
#else
constexpr int64_t kRowBlock = 16 * kMaxTileRows;
#endif

template <class F>
inline void for_row_blocks(int64_t m, F&& block) {
  for_balanced_tiles<kRowBlock>(m, block);
}

}  // namespace conveyor_panels
