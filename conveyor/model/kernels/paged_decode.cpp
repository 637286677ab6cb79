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
// Rows that share their first block with another row take a register-blocked span (VectorSpan);
// on AVX-512 builds every row does (kUnsharedSpan).
#include "array.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "fast_math.h"
#include "kv_half.h"
#include "spread_prefetch.h"

using namespace conveyor_array;
using conveyor_kv::Half;

namespace {

// A token's keys (or values) for all KV heads are 768 bytes (12 cache lines) for SmolLM2. A
// token's arithmetic (nine dot products, or nine updates of an output row) is long enough that
// the out-of-order core reaches too few of the next lines by itself; prefetching the token 4 ahead
// (into the next block at a block's end) reads the cold cache faster (docs/PERF.md). A whole
// block ahead gained nothing.
constexpr int64_t kPrefetchTokens = 4;

// D is the head dimension when known at compile time (fully unrolled, no remainder), else 0.
// T: the cache's element, float or Half (read into fp32).
template <int64_t D, class T>
inline float dot(const float* a, const T* b, int64_t n) {
  if constexpr (D > 0) n = D;
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * conveyor_kv::to_float(b[i]);
  return acc;
}

template <int64_t D, class T>
inline void axpy(float alpha, const T* x, float* y, int64_t n) {
  if constexpr (D > 0) n = D;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * conveyor_kv::to_float(x[i]);
}

}  // namespace

#if defined(__AVX2__) && defined(__FMA__)
#include "simd.h"

// Vector helpers for the two spans below (AVX-512 where the build has it, else AVX2).
namespace vec {

using namespace conveyor_simd;

inline __m256 fold(Vec v) {  // lanes i and i + 8 added: 8 lanes (AVX2: v itself)
#if defined(__AVX512F__)
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
#else
  return v;
#endif
}

constexpr int64_t kTile = 8;           // tokens whose scores are summed together
constexpr int64_t kMaxHeadDim = 512;   // larger heads keep the plain loops (tested up to 256)
constexpr int64_t kHeadsPerPass = 4, kVectorsPerPass = 4;  // the values pass's 16 accumulators

// Lane t of the result: the sum of v[t]'s 8 lanes, in the same order for every t.
inline __m256 sum_lanes(const __m256 (&v)[kTile]) {
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);  // [t0..t3 low halves | t0..t3 high]
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// Prefetches the next block of a pass a few lines at a time, spread over the current block's work.
using Prefetcher = conveyor_prefetch::SpreadPrefetcher<3>;

// out[h] += sum over the block's tokens [j0, j1) of p[h][t] * value_t, for GC heads of one KV group
// and the head's dimensions [d0, d0 + vectors * kWidth).
template <int GC, class T>
inline void values_pass(const T* block, int64_t j0, int64_t j1, int64_t token_stride, const float* const* probs,
                        float* const* outs, int64_t d0, int64_t vectors, Prefetcher& prefetcher) {
  Vec acc[GC][kVectorsPerPass];
  for (int g = 0; g < GC; ++g)
    for (int64_t c = 0; c < kVectorsPerPass; ++c)
      if (c < vectors) acc[g][c] = load(outs[g] + d0 + c * kWidth);
  for (int64_t j = j0; j < j1; ++j) {
    prefetcher.step();
    const T* value = block + j * token_stride + d0;
    Vec v[kVectorsPerPass];
    for (int64_t c = 0; c < kVectorsPerPass; ++c)
      if (c < vectors) v[c] = load(value + c * kWidth);
    for (int g = 0; g < GC; ++g) {
      const Vec p = splat(probs[g][j]);
      for (int64_t c = 0; c < kVectorsPerPass; ++c)
        if (c < vectors) acc[g][c] = fma(p, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int64_t c = 0; c < kVectorsPerPass; ++c)
      if (c < vectors) store(outs[g] + d0 + c * kWidth, acc[g][c]);
}

inline bool handles(int64_t head_dim) { return head_dim % kWidth == 0 && head_dim <= kMaxHeadDim; }

// One dot product summed exactly as one lane of sum_lanes: the walk below and the tiles of
// VectorSpan then give a token the same score, bit for bit.
template <int64_t D, class T>  // the head dimension when compiled in (unrolled), else 0
inline float dot(const float* a, const T* b, int64_t n) {
  if constexpr (D > 0) n = D;
  Vec acc = zero();
  for (int64_t d = 0; d < n; d += kWidth) acc = fma(load(a + d), load(b + d), acc);
  __m256 h = fold(acc);
  h = _mm256_hadd_ps(h, h);
  h = _mm256_hadd_ps(h, h);  // lane 0: (0 + 1) + (2 + 3); lane 4: (4 + 5) + (6 + 7)
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

template <int64_t D, class T>
inline void axpy(float alpha, const T* x, float* y, int64_t n) {
  if constexpr (D > 0) n = D;
  const Vec a = splat(alpha);
  for (int64_t d = 0; d < n; d += kWidth) store(y + d, fma(a, load(x + d), load(y + d)));
}

}  // namespace vec
#endif

// exp(s[t] - peak) in place over a span's scores, and their sum. The sum's order is the
// language's (8 running partials, then a fixed tree), not a vectorizer's choice that could
// depend on where the row starts: both spans, whose score rows sit at different offsets, must
// get the same bits.
inline float exp_and_sum(float* s, int64_t n, float peak) {
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
#pragma omp simd
    for (int j = 0; j < 8; ++j) {  // lane j adds to part[j] only: a vector op per 8, order kept
      s[t + j] = conveyor::fast_exp(s[t + j] - peak);
      part[j] += s[t + j];
    }
  }
  for (int j = 0; t < n; ++t, ++j) {
    s[t] = conveyor::fast_exp(s[t] - peak);
    part[j] += s[t];
  }
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

// The largest of n >= 1 scores. A maximum is exact in any order, so the lanes may split the row (a
// scalar scan was most of the softmax's time); only a NaN's place could differ, and a NaN score
// makes the row's sum, so its output, NaN either way.
inline float row_max(const float* s, int64_t n) {
  float peak = s[0];
  int64_t t = 1;
#if defined(__AVX2__)
  if (n >= 33) {  // four running maxima of 8 lanes, so that one's latency does not hold the next
    __m256 m[4];
    for (auto& v : m) v = _mm256_set1_ps(s[0]);
    for (; t + 32 <= n; t += 32)
      for (int i = 0; i < 4; ++i) m[i] = _mm256_max_ps(m[i], _mm256_loadu_ps(s + t + 8 * i));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
    for (const float lane : lanes) peak = std::max(peak, lane);
  }
#endif
  for (; t < n; ++t) peak = std::max(peak, s[t]);
  return peak;
}

// Per head h: row h of `scores` (`row_stride` apart, n tokens) -> exp(score - max) in place, and
// result[h] = [max, sum, head_dim zeros] for the values pass to add into.
inline void softmax_rows(float* scores, int64_t row_stride, int64_t n, int64_t num_heads, int64_t head_dim, float* result) {
  const int64_t stride = head_dim + 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    float* s = scores + h * row_stride;
    const float peak = row_max(s, n);
    result[h * stride] = peak;
    result[h * stride + 1] = exp_and_sum(s, n, peak);
    std::fill(result + h * stride + 2, result + (h + 1) * stride, 0.f);
  }
}

// One task: query row `row` against its cached tokens [first_block * block_size, ...) over
// `num_blocks` blocks, all KV heads, skipping tokens before the row's first visible one (`starts`). Leaves per head the running max and sum of exp(score - max)
// and the unnormalised weighted sum of values: [max, sum, out[head_dim]].
template <int64_t D, class T>
struct Span {
  const float* q;
  const T *k, *v;
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
    auto for_each_token_head = [&](const T* cache, auto&& visit) {
      constexpr int64_t kPerLine = 64 / sizeof(T);
      for (int64_t b = 0; b < num_blocks; ++b) {
        const T* block = cache + table[b] * block_stride;
        const int64_t t0 = b * block_size, count = std::min(block_size, end - t0);
        const T* next_block = b + 1 < num_blocks ? cache + table[b + 1] * block_stride : nullptr;
        for (int64_t j = std::max<int64_t>(0, skip - t0); j < count; ++j) {
          const int64_t a = j + kPrefetchTokens;
          const T* ahead = a < block_size ? block + a * token_stride
                           : next_block ? next_block + (a - block_size) * token_stride : nullptr;
          if (ahead)
            for (int64_t line = 0; line < token_stride; line += kPerLine) __builtin_prefetch(ahead + line, 0, 3);
          for (int64_t kv = 0, h = 0; kv < kv_heads; ++kv) {
            const T* vec = block + j * token_stride + kv * head_dim;
            for (int64_t g = 0; g < group; ++g, ++h) visit(t0 + j - skip, h, vec);
          }
        }
      }
    };
#if defined(__AVX2__) && defined(__FMA__)
    if (vec::handles(head_dim)) {  // VectorSpan's arithmetic, so either span may take any task
      for_each_token_head(k, [&](int64_t t, int64_t h, const T* key) {
        scores[h * n + t] = vec::dot<D>(q_row + h * head_dim, key, head_dim) * scale;
      });
      softmax_rows(scores.data(), n, n, num_heads, head_dim, result);
      for_each_token_head(v, [&](int64_t t, int64_t h, const T* value) {
        vec::axpy<D>(scores[h * n + t], value, result + h * (head_dim + 2) + 2, head_dim);
      });
      return;
    }
#endif
    for_each_token_head(k, [&](int64_t t, int64_t h, const T* key) {
      scores[h * n + t] = dot<D>(q_row + h * head_dim, key, head_dim) * scale;
    });
    softmax_rows(scores.data(), n, n, num_heads, head_dim, result);
    for_each_token_head(v, [&](int64_t t, int64_t h, const T* value) {
      axpy<D>(scores[h * n + t], value, result + h * (head_dim + 2) + 2, head_dim);
    });
  }
};

#if defined(__AVX2__) && defined(__FMA__)
// The same task, register-blocked, for rows whose blocks other rows share (prefix-cache hits), so
// they are read from the caches, where the walk above is bound by its instruction count: one
// horizontal sum per dot product, a load and store of the output row per (token, head). Here a
// tile of 8 tokens' dot products with one query head is summed into one vector at once, and the
// values pass keeps up to 4 heads x 4 vectors of output in registers over a block's tokens. The
// hardware prefetcher does not follow this walk, so the next block is prefetched a few lines at a
// time. Every score, softmax sum and output sum is formed as in the walk above: same bits.
template <class T>
struct VectorSpan {
  const float* q;
  const T *k, *v;
  const int64_t* tables;
  const int64_t* lens;
  const int64_t* starts;
  int64_t num_heads, head_dim, group, block_size, kv_heads, table_width, token_stride, block_stride;
  float scale;
  const T* zero_token;  // token_stride zeros: the keys of a partial tile's missing slots

  // `then`: the first keys block the thread reads after this span (the next task's), or null.
  void operator()(int64_t row, int64_t first_block, int64_t num_blocks, std::vector<float>& scores,
                  float* result, const T* then) const {
    using namespace vec;
    const int64_t t_begin = first_block * block_size;
    const int64_t end = std::min(num_blocks * block_size, lens[row] - t_begin);
    const int64_t skip = std::max<int64_t>(0, starts[row] - t_begin);
    // Scores are indexed by the token's place in the span; a tile starts at a block's first token.
    const int64_t padded = num_blocks * block_size + kTile;  // a block's last tile may write past its end
    const float* q_row = q + row * num_heads * head_dim;
    const int64_t* table = tables + row * table_width + first_block;
    scores.resize(num_heads * padded);
    const __m256 scale8 = _mm256_set1_ps(scale);

    Prefetcher prefetcher;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const T* block = k + table[b] * block_stride;
      const int64_t t0 = b * block_size, count = std::min(block_size, end - t0);
      const int64_t j_first = skip > t0 ? (skip - t0) / kTile * kTile : 0;
      prefetcher.aim(b + 1 < num_blocks ? k + table[b + 1] * block_stride : v + table[0] * block_stride,
                     block_stride * sizeof(T), (count - j_first + kTile - 1) / kTile * num_heads);
      for (int64_t j = j_first; j < count; j += kTile) {
        const T* tokens[kTile];
        for (int64_t t = 0; t < kTile; ++t) tokens[t] = j + t < count ? block + (j + t) * token_stride : zero_token;
        for (int64_t kv = 0, h = 0; kv < kv_heads; ++kv) {
          for (int64_t g = 0; g < group; ++g, ++h) {
            prefetcher.step();
            const float* q_head = q_row + h * head_dim;
            Vec acc[kTile];
            for (int64_t t = 0; t < kTile; ++t) acc[t] = zero();
            for (int64_t d = 0; d < head_dim; d += kWidth) {
              const Vec qv = load(q_head + d);
              for (int64_t t = 0; t < kTile; ++t) acc[t] = fma(qv, load(tokens[t] + kv * head_dim + d), acc[t]);
            }
            __m256 folded[kTile];
            for (int64_t t = 0; t < kTile; ++t) folded[t] = fold(acc[t]);
            _mm256_storeu_ps(scores.data() + h * padded + t0 + j, _mm256_mul_ps(sum_lanes(folded), scale8));
          }
        }
      }
    }
    const int64_t stride = head_dim + 2;
    softmax_rows(scores.data() + skip, padded, end - skip, num_heads, head_dim, result);
    const int64_t vectors = head_dim / kWidth;
    const int64_t passes = kv_heads * ((group + kHeadsPerPass - 1) / kHeadsPerPass) *
                           ((vectors + kVectorsPerPass - 1) / kVectorsPerPass);  // values_pass calls a block
    for (int64_t b = 0; b < num_blocks; ++b) {
      const T* block = v + table[b] * block_stride;
      const int64_t t0 = b * block_size, count = std::min(block_size, end - t0), j0 = std::max<int64_t>(0, skip - t0);
      prefetcher.aim(b + 1 < num_blocks ? v + table[b + 1] * block_stride : then, block_stride * sizeof(T),
                     std::max<int64_t>(1, count - j0) * passes);
      for (int64_t kv = 0; kv < kv_heads; ++kv) {
        for (int64_t g0 = 0; g0 < group; g0 += kHeadsPerPass) {
          const int64_t heads = std::min(kHeadsPerPass, group - g0);
          const float* probs[kHeadsPerPass];
          float* outs[kHeadsPerPass];
          for (int64_t g = 0; g < heads; ++g) {
            const int64_t h = kv * group + g0 + g;
            probs[g] = scores.data() + h * padded + t0;
            outs[g] = result + h * stride + 2;
          }
          for (int64_t c = 0; c < vectors; c += kVectorsPerPass) {
            const int64_t n = std::min(kVectorsPerPass, vectors - c);
            const T* values = block + kv * head_dim;
            switch (heads) {
              case 1: values_pass<1>(values, j0, count, token_stride, probs, outs, c * kWidth, n, prefetcher); break;
              case 2: values_pass<2>(values, j0, count, token_stride, probs, outs, c * kWidth, n, prefetcher); break;
              case 3: values_pass<3>(values, j0, count, token_stride, probs, outs, c * kWidth, n, prefetcher); break;
              default: values_pass<4>(values, j0, count, token_stride, probs, outs, c * kWidth, n, prefetcher); break;
            }
          }
        }
      }
    }
  }
};
#endif

// Which span runs rows that stream blocks of their own (rows sharing their first block take
// VectorSpan wherever it handles the head size): VectorSpan on AVX-512 builds, where it was faster
// for every row, cold blocks included, on both kinds of core measured (Intel with AMX, AMD Zen 4 once
// the cache held fp16: the walk converts each key and value once per query head of its group); the
// token-by-token walk on AVX2-only builds, where VectorSpan has not been measured against it since
// (docs/PERF.md, "Every row on the register-blocked span"). Both give the same bits, so the choice
// moves no output.
enum class UnsharedSpan { kToken, kVector };
#if defined(__AVX512F__)
constexpr UnsharedSpan kUnsharedSpan = UnsharedSpan::kVector;
#else
constexpr UnsharedSpan kUnsharedSpan = UnsharedSpan::kToken;
#endif

template <int64_t D, class T>
Array decode_attention(const Array& q, const Array& k_cache,
                       const Array& v_cache, const Array& block_tables,
                       const Array& context_lens, double scale, int64_t window,
                       UnsharedSpan unshared) {
  CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  CHECK(block_tables.dtype() == DType::kInt64 && context_lens.dtype() == DType::kInt64, "int64 tables");
  CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
            block_tables.is_contiguous() && context_lens.is_contiguous(), "contiguous inputs only");
  const int64_t num_rows = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  CHECK(k_cache.size(3) == head_dim && num_heads % kv_heads == 0, "head layout mismatch");
  CHECK(block_tables.size(0) == num_rows && context_lens.size(0) == num_rows, "one table per row");
  const int64_t table_width = block_tables.size(1);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t row = 0; row < num_rows; ++row)  // checked here: no exceptions inside the parallel region
    CHECK(lens[row] > 0 && (lens[row] + block_size - 1) / block_size <= table_width, "bad context length");
  CHECK(window >= 0, "window must be >= 0 (0: none)");
  std::vector<int64_t> starts(num_rows, 0);
  if (window > 0)
    for (int64_t row = 0; row < num_rows; ++row) starts[row] = std::max<int64_t>(0, lens[row] - window);

  const Span<D, T> span{q.data_ptr<float>(), static_cast<const T*>(k_cache.data_ptr()),
                        static_cast<const T*>(v_cache.data_ptr()),
                     block_tables.data_ptr<int64_t>(), lens, starts.data(), num_heads, head_dim, num_heads / kv_heads,
                     block_size, kv_heads, table_width, kv_heads * head_dim, block_size * kv_heads * head_dim,
                     static_cast<float>(scale)};
  // Rows whose first block another row also holds (prefix-cache hits) read blocks the cache
  // already has: the register-blocked span, bound by arithmetic, is the faster one there. A row
  // streaming blocks of its own from memory is bound by the walk, which the token-by-token span
  // keeps in the order the hardware prefetcher follows (docs/PERF.md). Both give the same bits.
#if defined(__AVX2__) && defined(__FMA__)
  const std::vector<T> zero_token(kv_heads * head_dim, T{});  // must outlive the tasks (T{}: +0)
  std::vector<bool> shares_blocks(num_rows, false);
  if (vec::handles(head_dim)) {
    std::vector<std::pair<int64_t, int64_t>> firsts(num_rows);  // (first block, row)
    for (int64_t row = 0; row < num_rows; ++row) firsts[row] = {span.tables[row * table_width], row};
    std::sort(firsts.begin(), firsts.end());
    for (int64_t i = 1; i < num_rows; ++i)
      if (firsts[i].first == firsts[i - 1].first) shares_blocks[firsts[i].second] = shares_blocks[firsts[i - 1].second] = true;
  }
  const VectorSpan<T> vector_span{span.q, span.k, span.v, span.tables, span.lens, span.starts, span.num_heads,
                               span.head_dim, span.group, span.block_size, span.kv_heads, span.table_width,
                               span.token_stride, span.block_stride, span.scale, zero_token.data()};
  auto run_span = [&](int64_t row, int64_t first_block, int64_t num_blocks, std::vector<float>& scores, float* result,
                      const T* then) {
    if (shares_blocks[row] || (unshared == UnsharedSpan::kVector && vec::handles(span.head_dim)))
      vector_span(row, first_block, num_blocks, scores, result, then);
    else span(row, first_block, num_blocks, scores, result);
  };
#else
  (void)unshared;
  auto run_span = [&](int64_t row, int64_t first_block, int64_t num_blocks, std::vector<float>& scores, float* result,
                      const T*) { span(row, first_block, num_blocks, scores, result); };
#endif
  const int64_t stride = head_dim + 2, threads = get_num_threads();
  auto out = empty_like(q);
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
  parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t group_begin, int64_t group_end) {
    std::vector<float> scores, own(sliced ? 0 : num_heads * stride);
    for (int64_t task = bounds[group_begin]; task < bounds[group_end]; ++task) {
      const auto [row, first_block, num_blocks] = tasks[task];
      float* result = sliced ? results.data() + task * num_heads * stride : own.data();
      const T* then = nullptr;
      if (task + 1 < bounds[group_end]) {
        const auto& next = tasks[task + 1];
        then = span.k + span.tables[next[0] * table_width + next[1]] * span.block_stride;
      }
      run_span(row, first_block, num_blocks, scores, result, then);
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

template <class T>
Array decode_attention_of(const Array& q, const Array& k_cache,
                          const Array& v_cache, const Array& block_tables,
                          const Array& context_lens, double scale, int64_t window, UnsharedSpan unshared) {
  switch (q.size(-1)) {
    case 64: return decode_attention<64, T>(q, k_cache, v_cache, block_tables, context_lens, scale, window, unshared);
    case 128: return decode_attention<128, T>(q, k_cache, v_cache, block_tables, context_lens, scale, window, unshared);
    case 256: return decode_attention<256, T>(q, k_cache, v_cache, block_tables, context_lens, scale, window, unshared);
    default: return decode_attention<0, T>(q, k_cache, v_cache, block_tables, context_lens, scale, window, unshared);
  }
}

Array paged_decode_attention(const Array& q, const Array& k_cache,
                             const Array& v_cache, const Array& block_tables,
                             const Array& context_lens, double scale, int64_t window,
                             const std::string& unshared_span) {
  CHECK(q.dtype() == DType::kFloat32, "q must be float32");
  CHECK(v_cache.dtype() == k_cache.dtype(), "k_cache and v_cache must have one dtype");
  CHECK(unshared_span == "auto" || unshared_span == "token" || unshared_span == "vector",
        "unshared_span must be auto, token or vector, not ", unshared_span);
  const UnsharedSpan unshared = unshared_span == "token"    ? UnsharedSpan::kToken
                                : unshared_span == "vector" ? UnsharedSpan::kVector
                                                            : kUnsharedSpan;
  if (k_cache.dtype() == DType::kFloat32)
    return decode_attention_of<float>(q, k_cache, v_cache, block_tables, context_lens, scale, window, unshared);
  CHECK(k_cache.dtype() == DType::kFloat16, "the KV cache must be float32 or float16");
  return decode_attention_of<Half>(q, k_cache, v_cache, block_tables, context_lens, scale, window, unshared);
}

// The ops run without the GIL, so the server's event loop streams responses while a step computes.
PYBIND11_MODULE(CONVEYOR_MODULE_NAME, m) {
  def_thread_functions(m);
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache (fp32 or fp16; fp32 q and arithmetic); window > 0: each row sees its "
        "last `window` tokens; unshared_span: the span of rows not sharing their first block (auto: this CPU's; token; vector)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("scale"), py::arg("window") = 0, py::arg("unshared_span") = "auto",
        py::call_guard<py::gil_scoped_release>());
}
