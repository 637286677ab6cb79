// Causal attention for one prefill chunk, read from the paged KV cache: the chunk's own keys
// (already written there) and any cached context before it (a prefix-cache hit, an earlier chunk)
// are one sequence of positions, so a fresh prompt and a hit take the same path.
//
// A tile is up to 16 query rows (AVX-512; 8 with AVX2), one per vector lane: a few positions times
// the query heads of one KV group, so each key and value is read once for all the heads that
// share it (GQA). A step takes 16 keys (8): their scores for all the tile's rows in 16 registers,
// one FMA per key and head dimension (a key's element broadcast against the rows' queries, which
// lie transposed [d][lanes]), so the online softmax (running max and sum per row, as flash
// attention) is lane-wise across registers: no horizontal reductions. Then each row's output adds
// the values weighted by its probabilities. A tile visits only the steps of keys its rows can see
// (causal, and a sliding window's start), so the upper triangle costs nothing; only steps on a row's edge
// are masked. Keys and values are first copied out of the blocks into one run per KV head, so a
// step addresses its 16 keys from one pointer (the head dimension is compiled in); a float16 cache
// is widened to fp32 in that copy, so the tiles read fp32 whatever the cache holds. Tasks are split
// between the threads by their number of keys, since later positions see more.
#include "array.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"  // errors without AVX2 and FMA: the loader then falls back to SDPA

using namespace conveyor_array;
namespace {

using namespace conveyor_simd;
using conveyor_kv::Half;

// Positions [begin, end) of the context, all KV heads, out of the cache's blocks into the runs.
template <class T>
void copy_runs(const T* k_cache, const T* v_cache, const int64_t* table, int64_t block_size, int64_t kv_heads,
               int64_t d, int64_t key_base, int64_t run, int64_t begin, int64_t end, float* keys, float* values) {
  for (int64_t pos = begin; pos < end; ++pos) {
    const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
    for (int64_t g = 0; g < kv_heads; ++g) {
      const int64_t from = (slot * kv_heads + g) * d, to = (g * run + pos - key_base) * d;
      conveyor_kv::to_floats(k_cache + from, keys + to, d);
      conveyor_kv::to_floats(v_cache + from, values + to, d);
    }
  }
}

constexpr int kKeys = static_cast<int>(kWidth);  // keys per step: one score register each
constexpr int kMaxRows = static_cast<int>(kWidth);

struct Chunk {
  const float* q;      // [n, heads, d], rows contiguous
  float* out;          // [n, heads, d]
  const float* keys;   // [kv_heads][positions from key_base (+ kKeys of zeros)][d]
  const float* values; // likewise
  int64_t heads, kv_heads, num_cached, window, key_base, run;  // run: positions per KV head
  float scale;

  int64_t first_key(int64_t pos) const { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; }
};

// A tile: query positions [i0, i0 + positions) of the chunk, query heads [h0, h0 + per_position)
// of KV head g; row (lane) r is position r / per_position, head r % per_position.
struct Task {
  int64_t g, h0, per_position, i0, positions;
};

// Per thread: the tile's queries transposed [d][lanes] (pre-scaled, idle lanes 0), outputs [rows][d],
// a step's probabilities [keys][lanes].
struct Scratch {
  std::vector<float> qt, o, p;
  explicit Scratch(int64_t d) : qt(d * kWidth), o(d * kMaxRows), p(kKeys * kWidth) {}
};

template <int64_t D>
void run_tile(const Chunk& c, const Task& t, Scratch& w) {
  const int64_t per = t.per_position, rows = t.positions * per;
  std::fill(w.qt.begin(), w.qt.end(), 0.f);
  alignas(64) float pos[kWidth], first[kWidth];
  for (int r = 0; r < kWidth; ++r) {
    pos[r] = first[r] = 0.f;  // idle lanes compute finite garbage, never stored
    if (r >= rows) continue;
    const int64_t position = c.num_cached + t.i0 + r / per;
    pos[r] = static_cast<float>(position);
    first[r] = static_cast<float>(c.first_key(position));
    const float* q = c.q + ((t.i0 + r / per) * c.heads + t.h0 + r % per) * D;
    for (int64_t k = 0; k < D; ++k) w.qt[k * kWidth + r] = q[k] * c.scale;
  }
  std::fill(w.o.begin(), w.o.begin() + rows * D, 0.f);
  const Vec pos_v = load(pos), first_v = load(first);
  Vec row_max = splat(-INFINITY), row_sum = zero();
  const int64_t tile_first = c.first_key(c.num_cached + t.i0) / kKeys * kKeys;
  const int64_t tile_last = c.num_cached + t.i0 + t.positions - 1;
  const int64_t max_first = c.first_key(tile_last), min_pos = c.num_cached + t.i0;
  const float* head_keys = c.keys + t.g * c.run * D;
  const float* head_values = c.values + t.g * c.run * D;
  for (int64_t j0 = tile_first; j0 <= tile_last; j0 += kKeys) {
    const int64_t keys = std::min<int64_t>(kKeys, tile_last + 1 - j0);
    const float* key = head_keys + (j0 - c.key_base) * D;  // past the run's end: zeros, masked
    Vec s[kKeys];
    _Pragma("GCC unroll 16") for (int k = 0; k < kKeys; ++k) s[k] = zero();
    const float* qt = w.qt.data();
    _Pragma("GCC unroll 2") for (int64_t e = 0; e < D; ++e, qt += kWidth) {
      const Vec qv = load(qt);
      _Pragma("GCC unroll 16") for (int k = 0; k < kKeys; ++k) s[k] = fma(splat(key[k * D + e]), qv, s[k]);
    }
    // Keys a row cannot see (on the tile's edges only) weigh exactly 0.
    const bool edge = j0 < max_first || j0 + kKeys - 1 > min_pos;
    if (edge) {
      _Pragma("GCC unroll 16") for (int k = 0; k < kKeys; ++k)
        s[k] = keep_between(s[k], splat(static_cast<float>(j0 + k)), first_v, pos_v, splat(-INFINITY));
    }
    Vec peak = row_max;
    _Pragma("GCC unroll 16") for (int k = 0; k < kKeys; ++k) peak = vmax(peak, s[k]);
    // A row that has seen no key yet keeps max -inf: its exps are taken against 0 instead (its
    // masked keys then zeroed below; its correction multiplies a sum and outputs still 0).
    const Vec safe = minus_inf_to_zero(peak);
    const Vec correction = vexp(sub(row_max, safe));
    Vec total = zero();
    _Pragma("GCC unroll 16") for (int k = 0; k < kKeys; ++k) {
      Vec p = vexp(sub(s[k], safe));
      if (edge) p = keep_between(p, splat(static_cast<float>(j0 + k)), first_v, pos_v, zero());
      total = add(total, p);
      store(w.p.data() + k * kWidth, p);
    }
    row_sum = fma(row_sum, correction, total);
    row_max = peak;
    alignas(64) float corr[kWidth];
    store(corr, correction);
    const float* value = head_values + (j0 - c.key_base) * D;
    for (int64_t c0 = 0; c0 < D; c0 += kWidth) {
      Vec acc[kMaxRows];
      _Pragma("GCC unroll 16") for (int r = 0; r < kMaxRows; ++r)
        if (r < rows) acc[r] = mul(load(w.o.data() + r * D + c0), splat(corr[r]));
      for (int64_t k = 0; k < keys; ++k) {
        const Vec v = load(value + k * D + c0);
        _Pragma("GCC unroll 16") for (int r = 0; r < kMaxRows; ++r)
          if (r < rows) acc[r] = fma(splat(w.p[k * kWidth + r]), v, acc[r]);
      }
      _Pragma("GCC unroll 16") for (int r = 0; r < kMaxRows; ++r)
        if (r < rows) store(w.o.data() + r * D + c0, acc[r]);
    }
  }
  alignas(64) float sums[kWidth];
  store(sums, row_sum);
  for (int64_t r = 0; r < rows; ++r) {
    float* out = c.out + ((t.i0 + r / per) * c.heads + t.h0 + r % per) * D;
    const float inv = 1.f / sums[r];
    for (int64_t e = 0; e < D; ++e) out[e] = w.o[r * D + e] * inv;
  }
}

}  // namespace

// q [n, heads, d]: the chunk's queries at positions num_cached .. num_cached + n - 1, whose keys
// and values are in the cache (with those of every earlier position) through block_table.
Array paged_prefill_attention(const Array& q, const Array& k_cache,
                              const Array& v_cache, const Array& block_table,
                              int64_t num_cached, double scale, int64_t window) {
  CHECK(q.dim() == 3 && q.dtype() == DType::kFloat32, "paged_prefill_attention: q must be [n, heads, d] fp32");
  const bool half = k_cache.dtype() == DType::kFloat16;
  CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
            (half || k_cache.dtype() == DType::kFloat32) && v_cache.dtype() == k_cache.dtype() &&
            k_cache.is_contiguous() && v_cache.is_contiguous(),
        "paged_prefill_attention: caches must be contiguous fp32 or fp16 [blocks, block_size, kv_heads, d]");
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  CHECK(k_cache.size(3) == d && (d == 64 || d == 128 || d == 256), "paged_prefill_attention: head dim ", d,
        " unsupported (64, 128 or 256)");
  CHECK(kv_heads > 0 && heads % kv_heads == 0, "paged_prefill_attention: heads not a multiple of KV heads");
  CHECK(num_cached >= 0 && window >= 0, "paged_prefill_attention: negative num_cached or window");
  const auto table = block_table.to(DType::kInt64).contiguous();
  const int64_t context = num_cached + n;
  CHECK(table.dim() == 1 && table.size(0) * block_size >= context, "paged_prefill_attention: block table too short");
  const auto qc = q.contiguous();
  auto out = empty_like(qc);
  if (n == 0) return out;
  const int64_t* tp = table.data_ptr<int64_t>();
  for (int64_t b = 0; b < (context + block_size - 1) / block_size; ++b)
    CHECK(tp[b] >= 0 && tp[b] < k_cache.size(0), "paged_prefill_attention: block id out of range");

  Chunk c{qc.data_ptr<float>(), out.data_ptr<float>(), nullptr, nullptr, heads, kv_heads, num_cached, window,
          0, 0, static_cast<float>(scale)};
  // Steps of keys start on multiples of kKeys whatever position a tile or chunk starts at, so a
  // query's sums group its keys alike however its prompt is cut into chunks and runs of rows (a
  // sliding window's first visible key moves with each query). Positions before the first any query
  // sees stay zeros in the runs (masked): a window's pool may have reused their blocks.
  const int64_t first_seen = c.first_key(num_cached);
  c.key_base = first_seen / kKeys * kKeys;
  c.run = context - c.key_base + kKeys;  // a step past the last key reads zeros (masked)

  // The keys and values any query sees, out of the blocks into one run per KV head.
  std::vector<float> keys(kv_heads * c.run * d, 0.f), values(kv_heads * c.run * d, 0.f);
  c.keys = keys.data();
  c.values = values.data();
  parallel_for(first_seen, context, 64, [&](int64_t begin, int64_t end) {
    if (half)
      copy_runs(static_cast<const Half*>(k_cache.data_ptr()), static_cast<const Half*>(v_cache.data_ptr()), tp,
                block_size, kv_heads, d, c.key_base, c.run, begin, end, keys.data(), values.data());
    else
      copy_runs(k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tp, block_size, kv_heads, d, c.key_base, c.run,
                begin, end, keys.data(), values.data());
  });

  // Tiles: a KV group's query heads (in parts of at most kMaxRows) times as many positions as fit.
  const int64_t per_group = heads / kv_heads;
  const int64_t parts = (per_group + kMaxRows - 1) / kMaxRows, per_part = (per_group + parts - 1) / parts;
  const int64_t positions = std::max<int64_t>(1, kMaxRows / per_part);
  std::vector<Task> tasks;
  std::vector<int64_t> cost_before{0};  // keys visited by the tasks before each
  for (int64_t g = 0; g < kv_heads; ++g)
    for (int64_t h0 = 0; h0 < per_group; h0 += per_part)
      for (int64_t i0 = 0; i0 < n; i0 += positions) {
        const Task t{g, g * per_group + h0, std::min(per_part, per_group - h0), i0, std::min(positions, n - i0)};
        tasks.push_back(t);
        const int64_t last = num_cached + i0 + t.positions - 1;
        cost_before.push_back(cost_before.back() + (last - c.first_key(num_cached + i0) + 1) * t.positions * t.per_position);
      }
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(get_num_threads(), static_cast<int64_t>(tasks.size())));
  std::vector<int64_t> bounds(threads + 1, static_cast<int64_t>(tasks.size()));
  bounds[0] = 0;
  for (int64_t th = 1; th < threads; ++th) {
    const int64_t share = cost_before.back() * th / threads;
    bounds[th] = std::lower_bound(cost_before.begin(), cost_before.end(), share) - cost_before.begin();
  }
  parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(d);
    for (int64_t th = begin; th < end; ++th)
      for (int64_t i = bounds[th]; i < bounds[th + 1]; ++i) {
        if (d == 64) run_tile<64>(c, tasks[i], scratch);
        else if (d == 128) run_tile<128>(c, tasks[i], scratch);
        else run_tile<256>(c, tasks[i], scratch);
      }
  });
  return out;
}

// The op runs without the GIL, so the server's event loop streams responses while a step computes.
PYBIND11_MODULE(CONVEYOR_MODULE_NAME, m) {
  def_thread_functions(m);
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of one prefill chunk over a paged KV cache (fp32 or fp16); window > 0: each query sees its "
        "last `window` positions",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("num_cached"),
        py::arg("scale"), py::arg("window") = 0, py::call_guard<py::gil_scoped_release>());
}
