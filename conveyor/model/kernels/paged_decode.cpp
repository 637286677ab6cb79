// Decode attention read straight from a paged KV cache: one query row per request, no gather,
// no padding to the longest context. With enough rows, one task is one request with all its KV
// heads, so each cache block is read as one contiguous run, which the hardware prefetcher follows
// (prefetching the next block by hand measured slower); with few rows a task is one (request, KV
// head) pair so both cores still work. Keys and values are read once and shared by the query
// heads of their group (GQA).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fast_math.h"

namespace {

// D is the head dimension when known at compile time (fully unrolled, no remainder), else 0.
template <int64_t D>
inline float dot(const float* a, const float* b, int64_t n) {
  if constexpr (D > 0) n = D;
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

template <int64_t D>
inline void axpy(float alpha, const float* x, float* y, int64_t n) {
  if constexpr (D > 0) n = D;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

void softmax_in_place(float* s, int64_t n) {
  const float peak = *std::max_element(s, s + n);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = conveyor::fast_exp(s[t] - peak);
    total += s[t];
  }
  const float inv = 1.f / total;
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) s[t] *= inv;
}

}  // namespace

template <int64_t D>
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous() && context_lens.is_contiguous(), "contiguous inputs only");
  const int64_t num_rows = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % kv_heads == 0, "head layout mismatch");
  TORCH_CHECK(block_tables.size(0) == num_rows && context_lens.size(0) == num_rows, "one table per row");
  const int64_t group = num_heads / kv_heads;
  const int64_t table_width = block_tables.size(1);
  const int64_t token_stride = kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;
  // Whole requests per task once there are a few rows per thread; otherwise one KV head per task.
  const int64_t task_kv_heads = num_rows >= 2 * at::get_num_threads() ? kv_heads : 1;
  const int64_t tasks_per_row = kv_heads / task_kv_heads;
  const int64_t task_heads = task_kv_heads * group;

  for (int64_t row = 0; row < num_rows; ++row) {  // checked here: no exceptions inside the parallel region
    const int64_t context = context_lens.data_ptr<int64_t>()[row];
    TORCH_CHECK(context > 0 && (context + block_size - 1) / block_size <= table_width, "bad context length");
  }
  auto out = torch::empty_like(q);
  const float* q_ptr = q.data_ptr<float>();
  const float* k_ptr = k_cache.data_ptr<float>();
  const float* v_ptr = v_cache.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_rows * tasks_per_row, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(task_heads * head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / tasks_per_row, first_kv_head = (task % tasks_per_row) * task_kv_heads;
      const int64_t context = lens[row], num_blocks = (context + block_size - 1) / block_size;
      const int64_t head_offset = first_kv_head * head_dim;  // this task's slice of each token
      const float* q_rows = q_ptr + (row * num_heads + first_kv_head * group) * head_dim;
      const int64_t* table = tables + row * table_width;
      scores.resize(task_heads * context);

      // Walks the task's cached tokens block by block, handing each (token, query head) pair the
      // token's key or value vector for that head's KV group: the score and the value passes.
      auto for_each_token_head = [&](const float* cache, auto&& visit) {
        for (int64_t b = 0; b < num_blocks; ++b) {
          const float* block = cache + table[b] * block_stride + head_offset;
          const int64_t t0 = b * block_size, n = std::min(block_size, context - t0);
          for (int64_t j = 0; j < n; ++j)
            for (int64_t kv = 0, h = 0; kv < task_kv_heads; ++kv) {
              const float* vec = block + j * token_stride + kv * head_dim;
              for (int64_t g = 0; g < group; ++g, ++h) visit(t0 + j, h, vec);
            }
        }
      };
      for_each_token_head(k_ptr, [&](int64_t t, int64_t h, const float* key) {
        scores[h * context + t] = dot<D>(q_rows + h * head_dim, key, head_dim) * fscale;
      });
      for (int64_t h = 0; h < task_heads; ++h) softmax_in_place(scores.data() + h * context, context);
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_token_head(v_ptr, [&](int64_t t, int64_t h, const float* value) {
        axpy<D>(scores[h * context + t], value, acc.data() + h * head_dim, head_dim);
      });
      std::copy(acc.begin(), acc.end(), out_ptr + (row * num_heads + first_kv_head * group) * head_dim);
    }
  });
  return out;
}

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& context_lens, double scale) {
  switch (q.size(-1)) {
    case 64: return decode_attention<64>(q, k_cache, v_cache, block_tables, context_lens, scale);
    case 128: return decode_attention<128>(q, k_cache, v_cache, block_tables, context_lens, scale);
    default: return decode_attention<0>(q, k_cache, v_cache, block_tables, context_lens, scale);
  }
}

// The ops run without the GIL, so the server's event loop streams responses while a step computes.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (fp32)",
        py::call_guard<py::gil_scoped_release>());
}
