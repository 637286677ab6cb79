// What bounds one row against Q8_0 panels (the layout of quant_gemm.cpp: per 32-k unit, 16 fp16
// scales, then 16 int8 codes per k), on one thread: the kernel's loop as it is (two 8-column FMA
// chains), the same as one 16-column AVX-512 chain, and 2 or 4 panels side by side (4-8 chains),
// the last with software prefetch, each over panels that fit in L2 ("hot") and over 36 MB
// ("cold", from DRAM). Every variant sums each column over k in the same order, so all must agree
// bit for bit (checked). A sequential read of 256 MB, the core's stream ceiling, is printed last.
// Plain C++, no torch; needs AVX-512F (the kernel itself also runs on AVX2):
//
//     g++ -O3 -march=native -fopenmp benchmarks/kernels/one_row.cpp -o /tmp/one_row && /tmp/one_row
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr int64_t kUnitK = 32, kUnitBytes = 32 + kUnitK * 16, kK = 1024, kUnits = kK / kUnitK;
constexpr int64_t kPanelBytes = kUnits * kUnitBytes;

inline __m256 half8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256i codes8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m512i codes16(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Panels [first, first + 1): as quant_gemm.cpp's fused 1-row tile.
void two_chains(const float* x, const uint8_t* panel, float* y) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int64_t u = 0; u < kUnits; ++u) {
    const uint8_t* unit = panel + u * kUnitBytes;
    const __m256 s_lo = half8(unit), s_hi = half8(unit + 16);
#pragma GCC unroll 2
    for (int64_t k = 0; k < kUnitK; ++k) {
      const __m256 xv = _mm256_broadcast_ss(x + u * kUnitK + k);
      lo = _mm256_fmadd_ps(xv, _mm256_mul_ps(_mm256_cvtepi32_ps(codes8(unit + 32 + k * 16)), s_lo), lo);
      hi = _mm256_fmadd_ps(xv, _mm256_mul_ps(_mm256_cvtepi32_ps(codes8(unit + 40 + k * 16)), s_hi), hi);
    }
  }
  _mm256_storeu_ps(y, lo);
  _mm256_storeu_ps(y + 8, hi);
}

// P panels at once, one 16-column chain each; kAhead > 0 prefetches each panel kAhead units ahead.
template <int P, int kAhead>
void side_by_side(const float* x, const uint8_t* panel, float* y) {
  __m512 sums[P];
#pragma GCC unroll 8
  for (int q = 0; q < P; ++q) sums[q] = _mm512_setzero_ps();
  for (int64_t u = 0; u < kUnits; ++u) {
    __m512 scales[P];
#pragma GCC unroll 8
    for (int q = 0; q < P; ++q)
      scales[q] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + q * kPanelBytes + u * kUnitBytes)));
#pragma GCC unroll 2
    for (int64_t k = 0; k < kUnitK; ++k) {
      if (kAhead && k % 4 == 0) {
#pragma GCC unroll 8
        for (int q = 0; q < P; ++q)
          _mm_prefetch(reinterpret_cast<const char*>(panel + q * kPanelBytes + (u + kAhead) * kUnitBytes + k * 16), _MM_HINT_T0);
      }
      const __m512 xv = _mm512_set1_ps(x[u * kUnitK + k]);
#pragma GCC unroll 8
      for (int q = 0; q < P; ++q) {
        const uint8_t* codes = panel + q * kPanelBytes + u * kUnitBytes + 32 + k * 16;
        sums[q] = _mm512_fmadd_ps(xv, _mm512_mul_ps(_mm512_cvtepi32_ps(codes16(codes)), scales[q]), sums[q]);
      }
    }
  }
#pragma GCC unroll 8
  for (int q = 0; q < P; ++q) _mm512_storeu_ps(y + 16 * q, sums[q]);
}

using Kernel = void (*)(const float*, const uint8_t*, float*);

// Best of 15 passes over all panels, in seconds; a kernel takes `step` panels per call.
double time_pass(Kernel kernel, int64_t step, const float* x, const std::vector<uint8_t>& w, int64_t panels,
                 std::vector<float>& y) {
  double best = 1e9;
  const int passes = panels <= 64 ? 200 : 4;
  for (int r = 0; r < 15; ++r) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < passes; ++i)
      for (int64_t p = 0; p < panels; p += step) kernel(x, w.data() + p * kPanelBytes, y.data() + p * 16);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / passes);
  }
  return best;
}

double stream_read_gbps() {
  std::vector<uint8_t> buffer(size_t{256} << 20, 1);
  double best = 1e9;
  long long total = 0;
  for (int r = 0; r < 5; ++r) {
    const auto start = std::chrono::steady_clock::now();
    __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
    for (size_t i = 0; i < buffer.size(); i += 256) {
      a = _mm512_add_epi64(a, _mm512_loadu_si512(&buffer[i]));
      b = _mm512_add_epi64(b, _mm512_loadu_si512(&buffer[i + 64]));
      c = _mm512_add_epi64(c, _mm512_loadu_si512(&buffer[i + 128]));
      d = _mm512_add_epi64(d, _mm512_loadu_si512(&buffer[i + 192]));
    }
    total += _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a, b), _mm512_add_epi64(c, d)));
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::printf("sequential read, one thread: %.1f GB/s (checksum %lld)\n", buffer.size() / best / 1e9, total);
  return buffer.size() / best / 1e9;
}

}  // namespace

int main() {
  std::mt19937 rng(0);
  std::vector<float> x(kK);
  for (float& v : x) v = static_cast<float>(rng() % 2001) / 1000.0f - 1.0f;
  const struct { const char* name; Kernel kernel; int64_t step; } variants[] = {
      {"2 chains (quant_gemm.cpp)", two_chains, 1},
      {"1 zmm chain", side_by_side<1, 0>, 1},
      {"2 panels side by side", side_by_side<2, 0>, 2},
      {"4 panels side by side", side_by_side<4, 0>, 4},
      {"4 side by side + prefetch", side_by_side<4, 2>, 4},
  };
  for (const int64_t panels : {int64_t{32}, int64_t{2048}}) {
    std::vector<uint8_t> w(panels * kPanelBytes);
    for (uint8_t& b : w) b = static_cast<uint8_t>(rng());
    for (int64_t unit = 0; unit < panels * kUnits; ++unit)
      for (int c = 0; c < 16; ++c) {
        const uint16_t scale = static_cast<uint16_t>(0x2000 + (rng() & 0x3FF));  // fp16 in [2^-7, 2^-6)
        std::memcpy(&w[unit * kUnitBytes + 2 * c], &scale, 2);
      }
    std::printf("%s: %ld panels, %.1f MB\n", panels <= 64 ? "hot (L2)" : "cold (DRAM)", static_cast<long>(panels),
                w.size() / 1e6);
    std::vector<float> reference(panels * 16), y(panels * 16);
    for (int64_t p = 0; p < panels; ++p) two_chains(x.data(), w.data() + p * kPanelBytes, reference.data() + p * 16);
    for (const auto& v : variants) {
      const double s = time_pass(v.kernel, v.step, x.data(), w, panels, y);
      const bool same = std::memcmp(y.data(), reference.data(), y.size() * sizeof(float)) == 0;
      std::printf("  %-28s %7.1f us  %5.2f G weights/s  %5.1f GB/s  %s\n", v.name, s * 1e6,
                  panels * 16.0 * kK / s / 1e9, w.size() / s / 1e9, same ? "bit-identical" : "DIFFERENT");
    }
  }
  stream_read_gbps();
}
