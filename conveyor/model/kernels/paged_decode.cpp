// Decode attention read straight from a paged KV cache: one query row per request, no gather,
// no padding to the longest context. A task covers all KV heads of a run of a request's blocks,
// so each cache block is read as one contiguous run, which the hardware prefetcher follows (the
// kernel also prefetches a few tokens ahead, across block boundaries). With enough rows a task is
// a whole request; with fewer rows than two per thread, requests are cut into slices of their context
// and the slices' partial softmax sums merged, so both cores work on one long request too. Each
// thread takes a run of consecutive tasks holding about its share of the cached tokens (an even
// split by count left one core idle for much of a step whose long requests sat together). Keys
// and values are read once and shared by the query heads of their group (GQA). A sliding window
// (Gemma's local layers) starts each row at its window's first token: blocks before it are never read.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fast_math.h"

namespace {

// A token's keys (or values) for all KV heads are 768 bytes (12 cache lines) for SmolLM2. A
// token's arithmetic (nine dot products, or nine updates of an output row) is long enough that
// the out-of-order core reaches too few of the next lines by itself; prefetching the token 4 ahead
// (into the next block at a block's end) reads the cold cache faster (docs/PERF.md). A whole
// block ahead gained nothing.
constexpr int64_t kPrefetchTokens = 4;

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

}  // namespace

// One task: query row `row` against its cached tokens [first_block * block_size, ...) over
// `num_blocks` blocks, all KV heads, skipping tokens before the row's first visible one (`starts`). Leaves per head the running max and sum of exp(score - max)
// and the unnormalised weighted sum of values: [max, sum, out[head_dim]].
template <int64_t D>
struct Span {
  const float *q, *k, *v;
  const int64_t* tables;
  const int64_t* lens;
  const int64_t* starts;  // first visible token of each row: 0, or where its sliding window begins
  int64_t num_heads, head_dim, group, block_size, kv_heads, table_width, token_stride, block_stride;
  float scale;

  void operator()(int64_t row, int64_t first_block, int64_t num_blocks, std::vector<float>& scores,
                  float* result) const {
    const int64_t t_begin = first_block * block_size;
    const int64_t end = std::min(num_blocks * block_size, lens[row] - t_begin);  // past the span's last token
    // Only the row's first span can begin inside its window's first block; it keeps >= 1 token.
    const int64_t skip = std::max<int64_t>(0, starts[row] - t_begin);
    const int64_t n = end - skip;  // tokens of this span
    const float* q_row = q + row * num_heads * head_dim;
    const int64_t* table = tables + row * table_width + first_block;
    scores.resize(num_heads * n);

    // Walks the span block by block, handing each (token, query head) pair the token's key or
    // value vector for that head's KV group: the score and the value passes.
    auto for_each_token_head = [&](const float* cache, auto&& visit) {
      for (int64_t b = 0; b < num_blocks; ++b) {
        const float* block = cache + table[b] * block_stride;
        const int64_t t0 = b * block_size, count = std::min(block_size, end - t0);
        const float* next_block = b + 1 < num_blocks ? cache + table[b + 1] * block_stride : nullptr;
        for (int64_t j = std::max<int64_t>(0, skip - t0); j < count; ++j) {
          const int64_t a = j + kPrefetchTokens;
          const float* ahead = a < block_size ? block + a * token_stride
                               : next_block ? next_block + (a - block_size) * token_stride : nullptr;
          if (ahead)
            for (int64_t line = 0; line < token_stride; line += 16) __builtin_prefetch(ahead + line, 0, 3);
          for (int64_t kv = 0, h = 0; kv < kv_heads; ++kv) {
            const float* vec = block + j * token_stride + kv * head_dim;
            for (int64_t g = 0; g < group; ++g, ++h) visit(t0 + j - skip, h, vec);
          }
        }
      }
    };
    for_each_token_head(k, [&](int64_t t, int64_t h, const float* key) {
      scores[h * n + t] = dot<D>(q_row + h * head_dim, key, head_dim) * scale;
    });
    const int64_t stride = head_dim + 2;
    for (int64_t h = 0; h < num_heads; ++h) {
      float* s = scores.data() + h * n;
      const float peak = *std::max_element(s, s + n);
      float total = 0.f;
#pragma omp simd reduction(+ : total)
      for (int64_t t = 0; t < n; ++t) {
        s[t] = conveyor::fast_exp(s[t] - peak);
        total += s[t];
      }
      result[h * stride] = peak;
      result[h * stride + 1] = total;
      std::fill(result + h * stride + 2, result + (h + 1) * stride, 0.f);
    }
    for_each_token_head(v, [&](int64_t t, int64_t h, const float* value) {
      axpy<D>(scores[h * n + t], value, result + h * stride + 2, head_dim);
    });
  }
};

template <int64_t D>
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                               const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                               const torch::Tensor& context_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous() && context_lens.is_contiguous(), "contiguous inputs only");
  const int64_t num_rows = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % kv_heads == 0, "head layout mismatch");
  TORCH_CHECK(block_tables.size(0) == num_rows && context_lens.size(0) == num_rows, "one table per row");
  const int64_t table_width = block_tables.size(1);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t row = 0; row < num_rows; ++row)  // checked here: no exceptions inside the parallel region
    TORCH_CHECK(lens[row] > 0 && (lens[row] + block_size - 1) / block_size <= table_width, "bad context length");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  std::vector<int64_t> starts(num_rows, 0);
  if (window > 0)
    for (int64_t row = 0; row < num_rows; ++row) starts[row] = std::max<int64_t>(0, lens[row] - window);

  const Span<D> span{q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                     block_tables.data_ptr<int64_t>(), lens, starts.data(), num_heads, head_dim, num_heads / kv_heads,
                     block_size, kv_heads, table_width, kv_heads * head_dim, block_size * kv_heads * head_dim,
                     static_cast<float>(scale)};
  const int64_t stride = head_dim + 2, threads = at::get_num_threads();
  auto out = torch::empty_like(q);
  float* out_ptr = out.data_ptr<float>();
  auto first_block_of = [&](int64_t row) { return starts[row] / block_size; };
  auto blocks_of = [&](int64_t row) { return (lens[row] + block_size - 1) / block_size - first_block_of(row); };

  // Enough rows for every thread: one task per row. Fewer: each row's context is cut into slices
  // (about four per thread) whose partial results are merged, as flash-decoding does on GPUs.
  std::vector<std::array<int64_t, 3>> tasks;  // (row, first block, blocks)
  if (num_rows >= 2 * threads) {
    for (int64_t row = 0; row < num_rows; ++row) tasks.push_back({row, first_block_of(row), blocks_of(row)});
  } else {
    int64_t total_blocks = 0;
    for (int64_t row = 0; row < num_rows; ++row) total_blocks += blocks_of(row);
    const int64_t min_slice = (64 + block_size - 1) / block_size;  // at least 64 tokens a slice
    const int64_t slice = std::max(min_slice, (total_blocks + 4 * threads - 1) / (4 * threads));
    for (int64_t row = 0; row < num_rows; ++row)
      for (int64_t b = 0; b < blocks_of(row); b += slice)
        tasks.push_back({row, first_block_of(row) + b, std::min(slice, blocks_of(row) - b)});
  }
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const bool sliced = num_tasks > num_rows;
  std::vector<float> results(sliced ? num_tasks * num_heads * stride : 0);
  // Each thread takes a run of consecutive tasks holding about its share of the blocks.
  int64_t total_blocks = 0;
  for (const auto& task : tasks) total_blocks += task[2];
  std::vector<int64_t> bounds{0};  // a task goes to the thread whose share holds its midpoint
  for (int64_t task = 0, sum = 0; task < num_tasks; sum += tasks[task++][2]) {
    for (int64_t next = static_cast<int64_t>(bounds.size());
         next < threads && (2 * sum + tasks[task][2]) * threads > 2 * total_blocks * next; ++next)
      bounds.push_back(task);
  }
  bounds.push_back(num_tasks);
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t group_begin, int64_t group_end) {
    std::vector<float> scores, own(sliced ? 0 : num_heads * stride);
    for (int64_t task = bounds[group_begin]; task < bounds[group_end]; ++task) {
      const auto [row, first_block, num_blocks] = tasks[task];
      float* result = sliced ? results.data() + task * num_heads * stride : own.data();
      span(row, first_block, num_blocks, scores, result);
      if (sliced) continue;
      for (int64_t h = 0; h < num_heads; ++h) {  // the whole context: normalise straight into out
        const float* r = result + h * stride;
        const float inv = 1.f / r[1];
        float* o = out_ptr + (row * num_heads + h) * head_dim;
        for (int64_t c = 0; c < head_dim; ++c) o[c] = r[2 + c] * inv;
      }
    }
  });
  if (!sliced) return out;

  // Each row: rescale its slices' sums to their common max and normalise.
  std::vector<float> weights;
  for (int64_t first = 0, last; first < num_tasks; first = last) {
    const int64_t row = tasks[first][0];
    for (last = first + 1; last < num_tasks && tasks[last][0] == row; ++last) {}
    for (int64_t h = 0; h < num_heads; ++h) {
      float peak = -INFINITY, total = 0.f;
      for (int64_t t = first; t < last; ++t) peak = std::max(peak, results[(t * num_heads + h) * stride]);
      weights.assign(last - first, 0.f);
      for (int64_t t = first; t < last; ++t) {
        const float* r = results.data() + (t * num_heads + h) * stride;
        weights[t - first] = std::exp(r[0] - peak);
        total += weights[t - first] * r[1];
      }
      float* o = out_ptr + (row * num_heads + h) * head_dim;
      for (int64_t c = 0; c < head_dim; ++c) {
        float sum = 0.f;
        for (int64_t t = first; t < last; ++t) sum += weights[t - first] * results[(t * num_heads + h) * stride + 2 + c];
        o[c] = sum / total;
      }
    }
  }
  return out;
}

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& context_lens, double scale, int64_t window) {
  switch (q.size(-1)) {
    case 64: return decode_attention<64>(q, k_cache, v_cache, block_tables, context_lens, scale, window);
    case 128: return decode_attention<128>(q, k_cache, v_cache, block_tables, context_lens, scale, window);
    case 256: return decode_attention<256>(q, k_cache, v_cache, block_tables, context_lens, scale, window);
    default: return decode_attention<0>(q, k_cache, v_cache, block_tables, context_lens, scale, window);
  }
}

// The ops run without the GIL, so the server's event loop streams responses while a step computes.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache (fp32); window > 0: each row sees its last `window` tokens",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("scale"), py::arg("window") = 0, py::call_guard<py::gil_scoped_release>());
}
