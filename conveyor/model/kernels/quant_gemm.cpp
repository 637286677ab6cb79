// y = x @ W^T (+ bias) on weights kept in a GGUF checkpoint's own blocks (Q4_1, Q8_0), laid out in
// the panels of panel_gemm.cpp: 0.625 / 1.06 bytes a weight stream from memory against 4.
//
// A weight is expanded to fp32 as d * q + m. d * q is exact in fp32 and fmadd rounds once, so it
// equals the fp32 weight the loader dequantises, and the tiles sum in the same order as the fp32
// panel kernel's: the results are bit-identical to it; only the bytes read per step shrink. Few
// rows expand each panel in registers; more rows expand it once into an L2 buffer.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

#include "panel_tile.h"

#if !defined(__F16C__)
#error "quant_gemm needs F16C"  // the loader then keeps fp32 panels
#endif

using namespace conveyor_panels;

namespace {

// Per panel, per block of 32 k: 16 fp16 scales [, 16 fp16 minimums], then the codes k by k.
constexpr int64_t kBlockK = 32;
constexpr int64_t kQ4_1Bytes = 32 + 32 + kBlockK * 8;  // a code byte holds column c and c + 8
constexpr int64_t kQ8_0Bytes = 32 + kBlockK * 16;
enum class QType : int64_t { kQ4_1 = 0, kQ8_0 = 1 };

// Block kb of a quantised panel: its scales (and minimums) as fp32 vectors, and code k -> the 16
// weights of step k. fmadd(q, d, m) rounds once, and d * q is exact (11 + 8 significant bits at
// most), so a weight equals the loader's separate multiply and add: the fp32 weight exactly.
template <QType T>
struct PanelBlock {
  static constexpr int64_t kBytes = T == QType::kQ4_1 ? kQ4_1Bytes : kQ8_0Bytes;
  __m256 d_lo, d_hi, m_lo, m_hi;
  const uint8_t* codes;

  explicit PanelBlock(const uint8_t* src) {
    d_lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    d_hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16)));
    if constexpr (T == QType::kQ4_1) {
      m_lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32)));
      m_hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48)));
      codes = src + 64;
    } else {
      codes = src + 32;
    }
  }

  inline void weights(int64_t k, __m256& w_lo, __m256& w_hi) const {
    if constexpr (T == QType::kQ4_1) {
      const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + k * 8)));
      w_lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(0xF))), d_lo, m_lo);
      w_hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), d_hi, m_hi);
    } else {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * 16));
      w_lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d_lo);
      w_hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), d_hi);
    }
  }
};

// One panel of quantised blocks -> [K][16] fp32 in `out`, for the tiles to read from L2.
template <QType T>
void expand_panel(const uint8_t* src, int64_t k_blocks, float* out) {
  for (int64_t kb = 0; kb < k_blocks; ++kb, src += PanelBlock<T>::kBytes, out += kBlockK * kPanel) {
    const PanelBlock<T> block(src);
    _Pragma("GCC unroll 4") for (int64_t k = 0; k < kBlockK; ++k) {
      __m256 w_lo, w_hi;
      block.weights(k, w_lo, w_hi);
      _mm256_storeu_ps(out + k * kPanel, w_lo);
      _mm256_storeu_ps(out + k * kPanel + 8, w_hi);
    }
  }
}

// Up to 5 rows against one quantised panel, expanding in registers: for so few rows the round
// trip through an L2 buffer costs as much as the arithmetic (measured: docs/PERF.md, "streaming the
// GGUF's own blocks"). Up to 10 rows run as two such tiles, each
// expanding the panel; more rows expand it once into the buffer. 6-row tiles spill registers.
// Same sums in the same order as tile<R>, so the same results.
constexpr int kFusedRows = 5;
constexpr int64_t kFusedRowsMax = 10;

template <QType T, int R>
void fused_tile(const float* x, int64_t x_stride, const uint8_t* src, int64_t k_blocks, const float* bias,
                float* y, int64_t y_stride, int64_t cols) {
  __m256 lo[R], hi[R];
  zero_sums<R>(lo, hi);
  for (int64_t kb = 0; kb < k_blocks; ++kb, src += PanelBlock<T>::kBytes) {
    const PanelBlock<T> block(src);
    const float* xk = x + kb * kBlockK;
    _Pragma("GCC unroll 2") for (int64_t k = 0; k < kBlockK; ++k) {
      __m256 w_lo, w_hi;
      block.weights(k, w_lo, w_hi);
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(xk + r * x_stride + k);
        lo[r] = _mm256_fmadd_ps(xv, w_lo, lo[r]);
        hi[r] = _mm256_fmadd_ps(xv, w_hi, hi[r]);
      }
    }
  }
  store_sums<R>(lo, hi, bias, y, y_stride, cols);
}

template <QType T>
void rows_times_quantized_panel(const float* x, int64_t x_stride, int64_t m, const uint8_t* src, int64_t k_blocks,
                                const float* bias, float* y, int64_t y_stride, int64_t cols, std::vector<float>& buffer) {
  if (m <= kFusedRowsMax) {
    // Tiles of balanced sizes (7 rows as 4 + 3): each expands the panel again, from L1.
    const int64_t tiles = (m + kFusedRows - 1) / kFusedRows;
    for (int64_t r0 = 0, t = 0; t < tiles; ++t) {
      const int64_t rows = (m - r0) / (tiles - t);
      const float* xr = x + r0 * x_stride;
      float* yr = y + r0 * y_stride;
      switch (rows) {
        case 1: fused_tile<T, 1>(xr, x_stride, src, k_blocks, bias, yr, y_stride, cols); break;
        case 2: fused_tile<T, 2>(xr, x_stride, src, k_blocks, bias, yr, y_stride, cols); break;
        case 3: fused_tile<T, 3>(xr, x_stride, src, k_blocks, bias, yr, y_stride, cols); break;
        case 4: fused_tile<T, 4>(xr, x_stride, src, k_blocks, bias, yr, y_stride, cols); break;
        case 5: fused_tile<T, 5>(xr, x_stride, src, k_blocks, bias, yr, y_stride, cols); break;
        default: break;
      }
      r0 += rows;
    }
    return;
  }
  buffer.resize(k_blocks * kBlockK * kPanel);
  expand_panel<T>(src, k_blocks, buffer.data());
  rows_times_panel(x, x_stride, m, buffer.data(), k_blocks * kBlockK, bias, y, y_stride, cols, /*from_memory=*/false);
}

// Value j (0-31) of one GGUF block, as the code stored in a quantised panel.
inline uint8_t gguf_code(const uint8_t* block, QType type, int64_t j) {
  if (type == QType::kQ8_0) return block[2 + j];
  const uint8_t packed = block[4 + (j & 15)];
  return j < 16 ? packed & 0xF : packed >> 4;
}

}  // namespace

// GGUF blocks [N, K/32 * block bytes] (Q4_1: 20, Q8_0: 34) -> [ceil(N/16), K/32, panel block bytes];
// columns past N in the last panel have zero scales, so they come out as zero weights.
torch::Tensor pack_quantized(const torch::Tensor& blocks, int64_t qtype) {
  TORCH_CHECK(qtype == 0 || qtype == 1, "pack_quantized: qtype must be 0 (Q4_1) or 1 (Q8_0)");
  const auto type = static_cast<QType>(qtype);
  const int64_t src_bytes = type == QType::kQ4_1 ? 20 : 34, dst_bytes = type == QType::kQ4_1 ? kQ4_1Bytes : kQ8_0Bytes;
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == torch::kUInt8 && blocks.size(1) % src_bytes == 0,
              "pack_quantized: blocks must be uint8 [N, K/32 * ", src_bytes, "]");
  const auto b = blocks.contiguous();
  const int64_t n = b.size(0), k_blocks = b.size(1) / src_bytes, panels = (n + kPanel - 1) / kPanel;
  auto packed = torch::zeros({panels, k_blocks, dst_bytes}, b.options());
  const uint8_t* src = b.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < std::min(kPanel, n - p * kPanel); ++c) {
        for (int64_t kb = 0; kb < k_blocks; ++kb) {
          const uint8_t* block = src + ((p * kPanel + c) * k_blocks + kb) * src_bytes;
          uint8_t* out = dst + (p * k_blocks + kb) * dst_bytes;
          std::copy(block, block + 2, out + 2 * c);  // fp16 scale
          if (type == QType::kQ8_0) {
            for (int64_t j = 0; j < kBlockK; ++j) out[32 + j * kPanel + c] = gguf_code(block, type, j);
            continue;
          }
          std::copy(block + 2, block + 4, out + 32 + 2 * c);  // fp16 minimum
          for (int64_t j = 0; j < kBlockK; ++j) out[64 + j * 8 + c % 8] |= gguf_code(block, type, j) << (c < 8 ? 0 : 4);
        }
      }
    }
  });
  return packed;
}

torch::Tensor quantized_matmul(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                               const c10::optional<torch::Tensor>& bias, int64_t qtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "quantized_matmul: x must be 2-D fp32");
  TORCH_CHECK(qtype == 0 || qtype == 1, "quantized_matmul: qtype must be 0 (Q4_1) or 1 (Q8_0)");
  const auto type = static_cast<QType>(qtype);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
              packed.size(2) == (type == QType::kQ4_1 ? kQ4_1Bytes : kQ8_0Bytes), "quantized_matmul: bad packed weight");
  TORCH_CHECK(packed.size(1) * kBlockK == x.size(1), "quantized_matmul: x has ", x.size(1), " features, the weight ",
              packed.size(1) * kBlockK);
  TORCH_CHECK(out_features > (packed.size(0) - 1) * kPanel && out_features <= packed.size(0) * kPanel,
              "quantized_matmul: out_features does not match the packed weight");
  const auto xs = x.stride(1) == 1 ? x : x.contiguous();
  torch::Tensor b;
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == torch::kFloat32 && b.numel() == out_features, "quantized_matmul: bad bias");
    bias_ptr = b.data_ptr<float>();
  }
  const int64_t m = xs.size(0), k_dim = xs.size(1), k_blocks = packed.size(1), x_stride = xs.stride(0);
  auto y = torch::empty({m, out_features}, x.options());
  if (m == 0) return y;
  const float* xp = xs.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int64_t panel_bytes = k_blocks * packed.size(2);
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> expanded;  // one panel in fp32 (K x 64 bytes, in L2) for 5+ rows
    for (int64_t p = begin; p < end; ++p) {
      const int64_t col0 = p * kPanel, cols = std::min(kPanel, out_features - col0);
      const float* panel_bias = bias_ptr ? bias_ptr + col0 : nullptr;
      if (type == QType::kQ4_1)
        rows_times_quantized_panel<QType::kQ4_1>(xp, x_stride, m, wp + p * panel_bytes, k_blocks, panel_bias,
                                                 yp + col0, out_features, cols, expanded);
      else
        rows_times_quantized_panel<QType::kQ8_0>(xp, x_stride, m, wp + p * panel_bytes, k_blocks, panel_bias,
                                                 yp + col0, out_features, cols, expanded);
    }
  });
  return y;
}

// The ops run without the GIL, so the server's event loop streams responses while a step computes.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_quantized", &pack_quantized, "GGUF Q4_1 (qtype 0) / Q8_0 (1) blocks [N, K/32 * bytes] -> quantised panels",
        py::call_guard<py::gil_scoped_release>());
  m.def("quantized_matmul", &quantized_matmul, "x [M, K] @ W^T (+ bias) on a weight packed by pack_quantized",
        py::call_guard<py::gil_scoped_release>());
}
