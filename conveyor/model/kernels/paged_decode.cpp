// Decode attention read straight from a paged KV cache: one query row per request, no gather,
// no padding to the longest context. Each (request, kv head) pair is one task: its keys and values
// are read once and shared by the query heads of its group (GQA).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

}  // namespace

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
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

  at::parallel_for(0, num_rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(group * head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / kv_heads, kv_head = task % kv_heads;
      const int64_t context = lens[row];
      const float* q_row = q_ptr + (row * num_heads + kv_head * group) * head_dim;
      const int64_t* table = tables + row * table_width;
      scores.resize(group * context);

      for (int64_t t = 0; t < context; t += block_size) {
        const float* keys = k_ptr + table[t / block_size] * block_stride + kv_head * head_dim;
        const int64_t n = std::min(block_size, context - t);
        for (int64_t j = 0; j < n; ++j)
          for (int64_t g = 0; g < group; ++g)
            scores[g * context + t + j] = dot(q_row + g * head_dim, keys + j * token_stride, head_dim) * fscale;
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * context;
        const float peak = *std::max_element(s, s + context);
        float total = 0.f;
        for (int64_t t = 0; t < context; ++t) total += (s[t] = std::exp(s[t] - peak));
        const float inv = 1.f / total;
        for (int64_t t = 0; t < context; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < context; t += block_size) {
        const float* values = v_ptr + table[t / block_size] * block_stride + kv_head * head_dim;
        const int64_t n = std::min(block_size, context - t);
        for (int64_t j = 0; j < n; ++j)
          for (int64_t g = 0; g < group; ++g)
            axpy(scores[g * context + t + j], values + j * token_stride, acc.data() + g * head_dim, head_dim);
      }
      std::copy(acc.begin(), acc.end(), out_ptr + (row * num_heads + kv_head * group) * head_dim);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (fp32)");
}
