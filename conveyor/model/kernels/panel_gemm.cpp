// y = x @ W^T (+ bias) for the few rows of a decode step, on fp32 weights laid out once in panels.
//
// A decode step multiplies 1-64 rows by every weight matrix, and the weights (hundreds of MB) come
// from DRAM each step. The panel layout keeps 16 output columns of W for all of K together
// ([panels][K][16]), so one panel is one sequential stream: the kernel reads it from memory once,
// for the first tile of rows, then from L2 for the other tiles. A tile holds up to 6 rows x 16
// columns in 12 AVX registers; per k it loads 2 vectors of weights and broadcasts 6 inputs (with
// AVX-512, a tile takes two adjacent panels at once: panel_tile.h). The two threads take halves
// of the panels (each its own contiguous stream). With a few rows per tile there is enough
// arithmetic between loads that one core keeps too few cache misses in flight to pull its share
// of DRAM bandwidth, so the first tile prefetches the stream 2 KiB ahead (faster at 4-32 rows,
// docs/PERF.md; at 1-2 rows the core is waiting on memory anyway and gains nothing).
// Sums run over k in order, one FMA per step: results differ from a BLAS's (numpy's matmul, the
// fallback) in rounding only.
#include "array.h"

#include "panel_tile.h"

using namespace conveyor_array;
using namespace conveyor_panels;

// [N, K] fp32 -> [ceil(N/16), K, 16]; the columns past N in the last panel are zero.
Array pack_panels(const Array& weight) {
  CHECK(weight.dim() == 2 && weight.dtype() == DType::kFloat32, "pack_panels: weight must be 2-D fp32");
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k_dim = w.size(1), panels = (n + kPanel - 1) / kPanel;
  auto packed = zeros({panels, k_dim, kPanel}, w.dtype());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min(kPanel, n - p * kPanel);
      float* out = dst + p * k_dim * kPanel;
      for (int64_t c = 0; c < cols; ++c) {
        const float* in = src + (p * kPanel + c) * k_dim;
        for (int64_t k = 0; k < k_dim; ++k) out[k * kPanel + c] = in[k];
      }
    }
  });
  return packed;
}

Array panel_matmul(const Array& x, const Array& packed, int64_t out_features,
                   const std::optional<Array>& bias) {
  CHECK(x.dim() == 2 && x.dtype() == DType::kFloat32, "panel_matmul: x must be 2-D fp32");
  CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(), "panel_matmul: bad packed weight");
  CHECK(packed.size(1) == x.size(1), "panel_matmul: x has ", x.size(1), " features, the weight ", packed.size(1));
  CHECK(out_features > (packed.size(0) - 1) * kPanel && out_features <= packed.size(0) * kPanel,
        "panel_matmul: out_features does not match the packed weight");
  const auto xs = x.stride(1) == 1 ? x : x.contiguous();
  const float* bias_ptr = nullptr;
  Array b;
  if (bias.has_value()) {
    b = bias->contiguous();
    CHECK(b.dtype() == DType::kFloat32 && b.numel() == out_features, "panel_matmul: bad bias");
    bias_ptr = b.data_ptr<float>();
  }
  const int64_t m = xs.size(0), k_dim = xs.size(1), x_stride = xs.stride(0);
  auto y = empty({m, out_features}, x.dtype());
  if (m == 0) return y;
  const float* xp = xs.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    for_row_blocks(m, [&](int64_t r0, int64_t rows) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t col0 = p * kPanel;
        if (p + 1 < end) {
          rows_times_panel_pair(xp + r0 * x_stride, x_stride, rows, wp + p * k_dim * kPanel,
                                wp + (p + 1) * k_dim * kPanel, k_dim, bias_ptr ? bias_ptr + col0 : nullptr,
                                yp + r0 * out_features + col0, out_features,
                                std::min(kPanel, out_features - col0 - kPanel));
          ++p;
          continue;
        }
        rows_times_panel(xp + r0 * x_stride, x_stride, rows, wp + p * k_dim * kPanel, k_dim,
                         bias_ptr ? bias_ptr + col0 : nullptr, yp + r0 * out_features + col0, out_features,
                         std::min(kPanel, out_features - col0));
      }
    });
  });
  return y;
}

// The ops run without the GIL, so the server's event loop streams responses while a step computes.
PYBIND11_MODULE(CONVEYOR_MODULE_NAME, m) {
  def_thread_functions(m);
  m.def("pack_panels", &pack_panels, "fp32 [N, K] weight -> [ceil(N/16), K, 16] panels",
        py::call_guard<py::gil_scoped_release>());
  m.def("panel_matmul", &panel_matmul, "x [M, K] @ W^T (+ bias) on a weight packed by pack_panels",
        py::call_guard<py::gil_scoped_release>());
}
