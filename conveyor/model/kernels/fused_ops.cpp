// The small per-layer ops of a decoder layer, one pass over the rows each: RMSNorm (alone and
// after the residual add), rotary embedding fused with the KV-cache write, and SiLU(gate) * up.
// As separate array ops each is 2-16 passes over a few KiB, so at decode sizes their dispatch costs
// more than their arithmetic. Built with -ffp-contract=off: products and sums round as separate ops
// round them (model/ops.py's numpy reference; rotary embedding matches it bit for bit).
#include "array.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>

#include "fast_math.h"
#include "kv_half.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

using namespace conveyor_array;
namespace {

// Below this many elements a task runs on the calling thread: waking the other costs more.
constexpr int64_t kMinElementsPerTask = 1 << 14;
constexpr int64_t kMaxHeadDim = 512;

int64_t grain_rows(int64_t row_size) { return std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(row_size, 1)); }

void check_rows(const Array& t, const char* name) {
  CHECK(t.dtype() == DType::kFloat32, name, " must be float32");
  CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, features] with contiguous rows");
}

void check_weight(const Array& weight, int64_t n) {
  CHECK(weight.dtype() == DType::kFloat32 && weight.is_contiguous() && weight.numel() == n,
        "the norm weight must be a contiguous float32 vector of the row size");
}

// The order of HF's LlamaRMSNorm: x * rsqrt(mean(x^2) + eps), then times the weight.
inline void rms_norm_row(const float* x, const float* weight, float* out, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inv);
}

Array rms_norm(const Array& x, const Array& weight, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  check_weight(weight, n);
  auto out = empty({rows, n}, x.dtype());
  const float* x_ptr = x.data_ptr<float>();
  const float* w_ptr = weight.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(x_ptr + r * stride, w_ptr, out_ptr + r * n, n, eps);
  });
  return out;
}

// residual += delta (the residual stream is updated in place), then returns rms_norm(residual).
Array add_rms_norm_(Array residual, const Array& delta, const Array& weight,
                    double eps) {
  check_rows(residual, "residual");
  check_rows(delta, "delta");
  CHECK(residual.writeable(), "residual must be writeable: it is updated in place");
  CHECK(residual.sizes() == delta.sizes(), "residual and delta must have the same shape");
  const int64_t rows = residual.size(0), n = residual.size(1);
  const int64_t res_stride = residual.stride(0), delta_stride = delta.stride(0);
  check_weight(weight, n);
  auto out = empty({rows, n}, residual.dtype());
  float* res_ptr = residual.data_ptr<float>();
  const float* delta_ptr = delta.data_ptr<float>();
  const float* w_ptr = weight.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* x = res_ptr + r * res_stride;
      const float* d = delta_ptr + r * delta_stride;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) x[i] += d[i];
      rms_norm_row(x, w_ptr, out_ptr + r * n, n, eps);
    }
  });
  return out;
}

// x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[half:], x[:half]): HF Llama's layout.
inline void rotate(const float* x, float* out, const float* cos, const float* sin, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
#pragma omp simd
  for (int64_t i = half; i < 2 * half; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

// qkv: [T, (heads + 2 kv_heads) * d], the fused projection's output. Rotates each row's query
// heads into a new contiguous [T, heads, d] (what the attention kernels read) and its key heads
// in place (prefill chunks attend to them straight from qkv), then copies the row's keys and
// values into the caches [blocks, block_size, kv_heads, d] at the row's flat slot. Returns q and
// views of the rotated keys and the values inside qkv, [T, kv_heads, d] each (made here: a
// Python split costs more than this whole op at batch 1). With `q_norm` and `k_norm` (Qwen3's and
// Gemma 3's per-head RMSNorm weights, [d] each), every query and key head is normed in place first.
std::tuple<Array, Array, Array> rope_and_cache(
    Array qkv, const Array& cos, const Array& sin, Array k_cache,
    Array v_cache, const Array& slots, int64_t num_heads, int64_t num_kv_heads,
    const std::optional<Array>& q_norm, const std::optional<Array>& k_norm, double norm_eps) {
  check_rows(qkv, "qkv");
  CHECK(qkv.writeable() && k_cache.writeable() && v_cache.writeable(),
        "qkv and the caches must be writeable: they are written in place");
  const bool half_cache = k_cache.dtype() == DType::kFloat16;
  CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
            v_cache.is_contiguous() && (half_cache || k_cache.dtype() == DType::kFloat32) &&
            v_cache.dtype() == k_cache.dtype(),
        "caches must be contiguous float32 or float16 [blocks, block_size, kv_heads, d]");
  const int64_t rows = qkv.size(0), d = k_cache.size(3), half = d / 2, stride = qkv.stride(0);
  CHECK(k_cache.size(2) == num_kv_heads && d % 2 == 0 && d <= kMaxHeadDim, "cache head layout mismatch");
  CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * d, "qkv row size must be (heads + 2 kv_heads) * d");
  CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == rows && cos.size(1) == d &&
            cos.is_contiguous() && sin.is_contiguous() && cos.dtype() == DType::kFloat32 &&
            sin.dtype() == DType::kFloat32, "cos and sin must be contiguous float32 [T, d]");
  CHECK(slots.dtype() == DType::kInt64 && slots.is_contiguous() && slots.numel() == rows, "one int64 slot per row");
  CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm go together");
  if (q_norm.has_value()) {
    check_weight(*q_norm, d);
    check_weight(*k_norm, d);
  }
  const float* q_norm_ptr = q_norm.has_value() ? q_norm->data_ptr<float>() : nullptr;
  const float* k_norm_ptr = k_norm.has_value() ? k_norm->data_ptr<float>() : nullptr;
  const float eps = static_cast<float>(norm_eps);
  const int64_t kv_row = num_kv_heads * d, num_slots = k_cache.numel() / kv_row;
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)  // checked here: no exceptions inside the parallel region
    CHECK(slot_ptr[r] >= 0 && slot_ptr[r] < num_slots, "slot out of range");

  auto q = empty({rows, num_heads, d}, qkv.dtype());
  float* qkv_ptr = qkv.data_ptr<float>();
  float* q_ptr = q.data_ptr<float>();
  const float* cos_ptr = cos.data_ptr<float>();
  const float* sin_ptr = sin.data_ptr<float>();
  void* k_cache_ptr = k_cache.data_ptr();
  void* v_cache_ptr = v_cache.data_ptr();
  // A row's keys and values into its slot, as the cache stores them (fp16: rounded to nearest even).
  auto store = [&](void* cache, int64_t slot, const float* src) {
    if (half_cache) conveyor_kv::from_floats(src, static_cast<conveyor_kv::Half*>(cache) + slot * kv_row, kv_row);
    else std::memcpy(static_cast<float*>(cache) + slot * kv_row, src, kv_row * sizeof(float));
  };
  parallel_for(0, rows, grain_rows(qkv.size(1)), [&](int64_t begin, int64_t end) {
    float rotated[kMaxHeadDim];
    for (int64_t r = begin; r < end; ++r) {
      float* row = qkv_ptr + r * stride;
      const float* c = cos_ptr + r * d;
      const float* s = sin_ptr + r * d;
      for (int64_t h = 0; h < num_heads; ++h) {
        if (q_norm_ptr != nullptr) rms_norm_row(row + h * d, q_norm_ptr, row + h * d, d, eps);
        rotate(row + h * d, q_ptr + (r * num_heads + h) * d, c, s, half);
      }
      float* keys = row + num_heads * d;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        if (k_norm_ptr != nullptr) rms_norm_row(keys + h * d, k_norm_ptr, keys + h * d, d, eps);
        rotate(keys + h * d, rotated, c, s, half);
        std::memcpy(keys + h * d, rotated, d * sizeof(float));
      }
      store(k_cache_ptr, slot_ptr[r], keys);
      store(v_cache_ptr, slot_ptr[r], keys + kv_row);
    }
  });
  auto k = qkv.narrow(1, num_heads * d, kv_row).view({rows, num_kv_heads, d});
  auto v = qkv.narrow(1, num_heads * d + kv_row, kv_row).view({rows, num_kv_heads, d});
  return {q, k, v};
}

// gate_up: [T, 2 I] (gate then up, the fused projection's output) -> silu(gate) * up, [T, I].
Array silu_and_mul(const Array& gate_up) {
  check_rows(gate_up, "gate_up");
  CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even row size");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = empty({rows, n}, gate_up.dtype());
  const float* in_ptr = gate_up.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = in_ptr + r * stride;
      const float* up = gate + n;
      float* o = out_ptr + r * n;
      // Two passes: gcc's code for the one-pass loop measured several times slower (docs/PERF.md).
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = conveyor::fast_exp(-gate[i]);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = gate[i] / (1.f + o[i]) * up[i];
    }
  });
  return out;
}

// First index of the row's largest value, a NaN counting as larger than any number: numpy's (and
// torch's) argmax answer. One vectorised pass finds the maximum (and whether a NaN is there), a
// second the first element equal to it (or the first NaN); torch's CPU argmax, which this replaced,
// compared element by element (for Gemma 3's 262,144-token vocabulary, ~2% of a decode step).
#if defined(__AVX2__)
int64_t argmax_row(const float* x, int64_t n) {
  constexpr int64_t kStep = 32;  // 4 vectors: 4 independent max chains
  const int64_t vector_end = n / kStep * kStep;
  __m256 best_v[4], nan_v = _mm256_setzero_ps();
  for (auto& b : best_v) b = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < vector_end; i += kStep)
    for (int j = 0; j < 4; ++j) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * j);
      best_v[j] = _mm256_max_ps(v, best_v[j]);  // maxps returns its second operand for a NaN v
      nan_v = _mm256_or_ps(nan_v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(best_v[0], best_v[1]), _mm256_max_ps(best_v[2], best_v[3])));
  float best = lanes[0];
  for (float lane : lanes) best = std::max(best, lane);
  bool nan = _mm256_movemask_ps(nan_v) != 0;
  for (int64_t i = vector_end; i < n; ++i) {
    best = std::max(best, x[i]);
    nan = nan || x[i] != x[i];
  }
  const __m256 target = _mm256_set1_ps(best);
  for (int64_t i = 0; i < vector_end; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const int mask = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, target, _CMP_EQ_OQ));
    if (mask != 0) return i + __builtin_ctz(static_cast<unsigned>(mask));
  }
  for (int64_t i = vector_end; i < n; ++i)
    if (nan ? x[i] != x[i] : x[i] == best) return i;
  return 0;  // not reached: some element is the maximum or the NaN
}
#else
int64_t argmax_row(const float* x, int64_t n) {
  int64_t first = 0;
  for (int64_t i = 1; i < n; ++i)
    if (x[first] == x[first] && (x[i] > x[first] || x[i] != x[i])) first = i;
  return first;
}
#endif

// logits [rows, vocab] -> int64 [rows], each row's argmax.
Array argmax_rows(const Array& logits) {
  check_rows(logits, "logits");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  CHECK(n > 0, "argmax of an empty row");
  auto out = empty({rows}, DType::kInt64);
  const float* in_ptr = logits.data_ptr<float>();
  int64_t* out_ptr = out.data_ptr<int64_t>();
  parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out_ptr[r] = argmax_row(in_ptr + r * stride, n);
  });
  return out;
}

}  // namespace

// The ops run without the GIL, so the server's event loop streams responses while a step computes.
PYBIND11_MODULE(CONVEYOR_MODULE_NAME, m) {
  def_thread_functions(m);
  m.def("rms_norm", &rms_norm, "RMSNorm over the rows of a float32 [T, n] array",
        py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm_", &add_rms_norm_, "residual += delta in place, then RMSNorm of the residual",
        py::call_guard<py::gil_scoped_release>());
  m.def("rope_and_cache", &rope_and_cache, "rotary embedding of q and k from fused qkv rows, k and v into the cache",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up over fused gate_up rows",
        py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &argmax_rows, "each row's argmax (first index of the maximum, NaN first), as numpy's argmax",
        py::call_guard<py::gil_scoped_release>());
}
