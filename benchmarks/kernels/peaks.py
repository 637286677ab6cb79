"""This CPU's arithmetic peaks: fp32 FMA, int8 dot products (AVX-512 VNNI `vpdpbusd`, or AVX2
`vpmaddubsw` + `vpmaddwd` + add) and bf16 dot products (AVX512-BF16 `vdpbf16ps`), each an
instruction loop of 12 independent register chains (no memory traffic), on 1 and on all threads;
and where the CPU has Intel's AMX tiles, their int8 (`tdpbssd`) and bf16 (`tdpbf16ps`) products,
four independent 16 x 16 sums tiles fed by two pairs of input tiles loaded once, and the bf16
products again with every input tile loaded before its products, as a matmul feeds them, from a
working set in L1 (32 KiB a thread) and in L2 (1 MiB): the ceilings of a tile kernel's inner loop.
These are the ceilings the products of docs/PERF.md are measured against: an fp32 FMA does 2 flops
a lane, a `vpdpbusd` 8 integer ops a 32-bit lane (4 multiply-adds), a `vdpbf16ps` 4 flops a lane,
a `tdpbssd` 16 x 16 x 64 multiply-adds, a `tdpbf16ps` 16 x 16 x 32.

    python benchmarks/kernels/peaks.py [--threads 1 2] [--repeats 5]

The loops are compiled by conveyor's kernel builder (pybind11, -O3 -march=native -fopenmp) and
cached beside the server's builds, named by the source and the CPU.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sysconfig
import time

from conveyor.model import kernels

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <vector>
#include <pybind11/pybind11.h>

// Each returns the number of operations done; 12 chains hide the instruction latency. OPAQUE tells
// the compiler a and b may change every iteration, so it cannot fold the loop into a closed form.
// KEEP makes the chains' sum an input of the (empty) asm, so they are not dead code.
#define OPAQUE(a, b) __asm__ volatile("" : "+v"(a), "+v"(b));
#define KEEP(s) __asm__ volatile("" : : "v"(s));
#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

double fp32_fma(int64_t iters, int threads) {
  double total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
#if defined(__AVX512F__)
    __m512 a = _mm512_set1_ps(1.0000001f), b = _mm512_set1_ps(0.9999999f);
#define DECL(i) __m512 c##i = _mm512_set1_ps((float)i);
#define STEP(i) c##i = _mm512_fmadd_ps(c##i, a, b);
#define SUM(i) s = _mm512_add_ps(s, c##i);
    CHAINS(DECL)
    for (int64_t n = 0; n < iters; ++n) { OPAQUE(a, b) CHAINS(STEP) }
    __m512 s = _mm512_setzero_ps();
    CHAINS(SUM)
    KEEP(s)
    total += (double)iters * 12 * 16 * 2;
#undef DECL
#undef STEP
#undef SUM
#else
    __m256 a = _mm256_set1_ps(1.0000001f), b = _mm256_set1_ps(0.9999999f);
#define DECL(i) __m256 c##i = _mm256_set1_ps((float)i);
#define STEP(i) c##i = _mm256_fmadd_ps(c##i, a, b);
#define SUM(i) s = _mm256_add_ps(s, c##i);
    CHAINS(DECL)
    for (int64_t n = 0; n < iters; ++n) { OPAQUE(a, b) CHAINS(STEP) }
    __m256 s = _mm256_setzero_ps();
    CHAINS(SUM)
    KEEP(s)
    total += (double)iters * 12 * 8 * 2;
#undef DECL
#undef STEP
#undef SUM
#endif
  }
  return total;
}

double int8_dot(int64_t iters, int threads) {
  double total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
#if defined(__AVX512VNNI__)
    __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
#define DECL(i) __m512i c##i = _mm512_set1_epi32(i);
#define STEP(i) c##i = _mm512_dpbusd_epi32(c##i, a, b);
#define SUM(i) s = _mm512_add_epi32(s, c##i);
    CHAINS(DECL)
    for (int64_t n = 0; n < iters; ++n) { OPAQUE(a, b) CHAINS(STEP) }
    __m512i s = _mm512_setzero_si512();
    CHAINS(SUM)
    KEEP(s)
    total += (double)iters * 12 * 64 * 2;
#undef DECL
#undef STEP
#undef SUM
#else
    // AVX2: u8 x s8 pairs to s16 (vpmaddubsw), s16 pairs to s32 (vpmaddwd), then an add: 32 multiply-adds.
    __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2);
    const __m256i ones = _mm256_set1_epi16(1);
#define DECL(i) __m256i c##i = _mm256_set1_epi32(i);
#define STEP(i) c##i = _mm256_add_epi32(c##i, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones));
#define SUM(i) s = _mm256_add_epi32(s, c##i);
    CHAINS(DECL)
    for (int64_t n = 0; n < iters; ++n) { OPAQUE(a, b) CHAINS(STEP) }
    __m256i s = _mm256_setzero_si256();
    CHAINS(SUM)
    KEEP(s)
    total += (double)iters * 12 * 32 * 2;
#undef DECL
#undef STEP
#undef SUM
#endif
  }
  return total;
}

double bf16_dot(int64_t iters, int threads) {
#if defined(__AVX512BF16__)
  double total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3f7f);
#define DECL(i) __m512 c##i = _mm512_set1_ps((float)i);
#define STEP(i) c##i = _mm512_dpbf16_ps(c##i, a, b);
#define SUM(i) s = _mm512_add_ps(s, c##i);
    CHAINS(DECL)
    for (int64_t n = 0; n < iters; ++n) { OPAQUE(a, b) CHAINS(STEP) }
    __m512 s = _mm512_setzero_ps();
    CHAINS(SUM)
    KEEP(s)
    total += (double)iters * 12 * 32 * 2;
#undef DECL
#undef STEP
#undef SUM
  }
  return total;
#else
  return -1.0;  // no AVX512-BF16 on this CPU
#endif
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)
// Tiles 0-3 sums (16 x 64 bytes), 4-5 one side's inputs (16 x 64 bytes), 6-7 the other's (16 x 64).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux lends the tile registers to a process that asks (ARCH_REQ_XCOMP_PERM, XTILEDATA).
static bool amx_permitted() { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

template <bool kBf16>
double amx_product(int64_t iters, int threads) {
  if (!amx_permitted()) return -1.0;
  double total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    TileConfig config;
    for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
    alignas(64) static thread_local uint8_t inputs[16 * 64];
    for (int i = 0; i < 16 * 64; ++i) inputs[i] = static_cast<uint8_t>(kBf16 ? (i % 2 ? 0x3f : 0x80) : 1);
    _tile_loadd(4, inputs, 64); _tile_loadd(5, inputs, 64); _tile_loadd(6, inputs, 64); _tile_loadd(7, inputs, 64);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t n = 0; n < iters / 16; ++n) {
      if constexpr (kBf16) {
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
      } else {
        _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 4, 7); _tile_dpbssd(2, 5, 6); _tile_dpbssd(3, 5, 7);
      }
    }
    alignas(64) static thread_local int32_t sums[16 * 16];
    _tile_stored(0, sums, 64);  // the sums leave the tiles, so the loop is not dead code
    KEEP(sums[0])
    _tile_release();
    total += (double)(iters / 16) * 4 * 16 * 16 * (kBf16 ? 32 : 64) * 2;
  }
  return total;
}
double amx_int8(int64_t iters, int threads) { return amx_product<false>(iters, threads); }
double amx_bf16(int64_t iters, int threads) { return amx_product<true>(iters, threads); }

// bf16 tile products as a matmul feeds them: each step loads its four input tiles (two row tiles
// of x, two panels of weights, 1 KiB each and contiguous) and issues the four products, walking
// `groups` steps of 32 k over buffers of 4 x groups KiB a thread, so they stay in L1 or in L2.
double amx_bf16_loaded(int64_t iters, int threads, int64_t groups) {
  if (!amx_permitted()) return -1.0;
  double total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    TileConfig config;
    for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
    std::vector<uint16_t> buffer(static_cast<size_t>(4 * groups * 512), 0x3f80);  // bf16 1.0
    const uint16_t *xa = buffer.data(), *xb = xa + groups * 512, *wa = xb + groups * 512, *wb = wa + groups * 512;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const int64_t passes = std::max<int64_t>(1, iters / 16 / groups);
    for (int64_t n = 0; n < passes; ++n)
      for (int64_t g = 0; g < groups; ++g) {
        _tile_loadd(4, xa + 512 * g, 64);
        _tile_loadd(6, wa + 512 * g, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, wb + 512 * g, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, xb + 512 * g, 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    alignas(64) static thread_local float sums[16 * 16];
    _tile_stored(0, sums, 64);
    KEEP(sums[0])
    _tile_release();
    total += (double)passes * groups * 4 * 16 * 16 * 32 * 2;
  }
  return total;
}
double amx_bf16_l1(int64_t iters, int threads) { return amx_bf16_loaded(iters, threads, 8); }     // 32 KiB
double amx_bf16_l2(int64_t iters, int threads) { return amx_bf16_loaded(iters, threads, 256); }   // 1 MiB
#else
double amx_int8(int64_t, int) { return -1.0; }  // no AMX on this CPU (or in this compiler)
double amx_bf16(int64_t, int) { return -1.0; }
double amx_bf16_l1(int64_t, int) { return -1.0; }
double amx_bf16_l2(int64_t, int) { return -1.0; }
#endif
"""

FUNCTIONS = ["fp32_fma", "int8_dot", "bf16_dot", "amx_int8", "amx_bf16", "amx_bf16_l1", "amx_bf16_l2"]
BINDINGS = "\nPYBIND11_MODULE(CONVEYOR_MODULE_NAME, m) {\n" + "".join(
    f'  m.def("{name}", &{name}, pybind11::call_guard<pybind11::gil_scoped_release>());\n' for name in FUNCTIONS) + "}\n"
FLAGS = ["-O3", "-march=native", "-fopenmp"]


def build() -> object:
    """The loops as a Python module, built once per source and CPU (cached under conveyor's kernels
    folder, as benchmarks/isa_check.py's builds)."""
    source = SOURCE + BINDINGS
    digest = hashlib.sha1(" ".join(FLAGS).encode() + b"\0" + source.encode())
    extension = f"conveyor_peaks_{kernels._cpu_tag()}_{digest.hexdigest()[:12]}"
    library = kernels._cache_root() / extension / f"{extension}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if library.is_file():
        return kernels._import_module(extension, library)
    file = library.parent / "src" / "peaks.cpp"
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(source)
    return kernels.compile_module(extension, file, FLAGS, library)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20_000_000)
    args = parser.parse_args()
    module = build()
    print(f"{os.cpu_count()} CPUs; giga-operations a second, best of {args.repeats}")
    print(f"{'threads':>7} {'fp32 FMA':>10} {'int8 dot':>10} {'bf16 dot':>10} {'int8/fp32':>10} {'bf16/fp32':>10}"
          f" {'AMX int8':>10} {'AMX bf16':>10} {'+L1 loads':>10} {'+L2 loads':>10}")
    for threads in args.threads:
        best: dict[str, float] = {}
        for name in FUNCTIONS:
            rates = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                ops = getattr(module, name)(args.iters, threads)
                rates.append(ops / (time.perf_counter() - start) / 1e9 if ops > 0 else float("nan"))
            best[name] = max(rates)
        fp32, int8, bf16 = best["fp32_fma"], best["int8_dot"], best["bf16_dot"]
        print(f"{threads:>7} {fp32:>10.0f} {int8:>10.0f} {bf16:>10.0f} {int8 / fp32:>9.2f}x {bf16 / fp32:>9.2f}x"
              f" {best['amx_int8']:>10.0f} {best['amx_bf16']:>10.0f} {best['amx_bf16_l1']:>10.0f}"
              f" {best['amx_bf16_l2']:>10.0f}")


if __name__ == "__main__":
    main()
