// How fast this machine reads 12 KiB blocks (one KV block of SmolLM2-135M: 16 tokens x 3 heads x
// 64 x fp32) in order and in shuffled order, as decode attention reads a paged cache: the ceiling
// for the decode kernel's cold reads. Plain C++ with OpenMP, no torch:
//
//     g++ -O3 -march=native -fopenmp benchmarks/kernels/block_read.cpp -o /tmp/block_read
//     OMP_NUM_THREADS=2 /tmp/block_read          # HUGE=1 to madvise the pools for huge pages
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace {

constexpr size_t kBlockFloats = 16 * 3 * 64;
constexpr size_t kBlocks = 40000;  // 480 MB per pool, far past the L3

__m256 sum_block(const float* block, __m256 acc, const float* next_block) {
  for (size_t i = 0; i < kBlockFloats; i += 16) {
    if (next_block) _mm_prefetch(reinterpret_cast<const char*>(next_block + i), _MM_HINT_T0);
    acc = _mm256_add_ps(acc, _mm256_loadu_ps(block + i));
    acc = _mm256_add_ps(acc, _mm256_loadu_ps(block + i + 8));
  }
  return acc;
}

float* pool() {
  const size_t bytes = kBlocks * kBlockFloats * sizeof(float);
  auto* p = static_cast<float*>(aligned_alloc(2 << 20, bytes));
  if (std::getenv("HUGE")) madvise(p, bytes, MADV_HUGEPAGE);
  std::fill(p, p + kBlocks * kBlockFloats, 1.f);
  return p;
}

}  // namespace

int main() {
  float* keys = pool();
  float* values = pool();
  std::vector<int> in_order(kBlocks);
  for (size_t i = 0; i < kBlocks; ++i) in_order[i] = static_cast<int>(i);
  std::vector<int> shuffled = in_order;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(1));

  // Each thread reads its half of the block list; `with_values` reads K then V in runs of 64
  // blocks (one task's span) or, `interleaved`, block by block.
  auto run = [&](const char* name, const std::vector<int>& order, bool with_values, bool interleaved, bool prefetch) {
    double best = 1e30;
    float sink = 0.f;
    for (int repeat = 0; repeat < 5; ++repeat) {
      const auto start = std::chrono::steady_clock::now();
#pragma omp parallel reduction(+ : sink)
      {
        const size_t lo = kBlocks * omp_get_thread_num() / omp_get_num_threads();
        const size_t hi = kBlocks * (omp_get_thread_num() + 1) / omp_get_num_threads();
        auto at = [&](const float* base, size_t b, size_t end) {
          return b < end ? base + order[b] * kBlockFloats : nullptr;
        };
        __m256 acc = _mm256_setzero_ps();
        for (size_t run_begin = lo; run_begin < hi; run_begin += 64) {
          const size_t run_end = std::min(hi, run_begin + 64);
          for (size_t b = run_begin; b < run_end; ++b) {
            acc = sum_block(at(keys, b, run_end), acc, prefetch ? at(keys, b + 1, run_end) : nullptr);
            if (with_values && interleaved)
              acc = sum_block(at(values, b, run_end), acc, prefetch ? at(values, b + 1, run_end) : nullptr);
          }
          if (with_values && !interleaved)
            for (size_t b = run_begin; b < run_end; ++b)
              acc = sum_block(at(values, b, run_end), acc, prefetch ? at(values, b + 1, run_end) : nullptr);
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, acc);
        for (float lane : lanes) sink += lane;
      }
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    const double bytes = kBlocks * kBlockFloats * sizeof(float) * (with_values ? 2.0 : 1.0);
    std::printf("%-44s %6.1f GB/s%s\n", name, bytes / best / 1e9, sink == 1.f ? " " : "");
  };
  run("K, blocks in order", in_order, false, false, false);
  run("K, blocks shuffled", shuffled, false, false, false);
  run("K, blocks shuffled, next block prefetched", shuffled, false, false, true);
  run("K then V per 64-block run, in order", in_order, true, false, false);
  run("K then V per 64-block run, shuffled", shuffled, true, false, false);
  run("K and V block by block, shuffled", shuffled, true, true, false);
  run("K and V block by block, shuffled, prefetched", shuffled, true, true, true);
}
