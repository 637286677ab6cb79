"""Builds the matmul and attention kernels for another x86 target beside the native build and
checks they agree.

The kernels compile with -march=native, so a machine with AVX-512 never runs the code an AVX2-only
machine (CI, a laptop) gets, and an AVX2-only machine never runs the AVX-512 code. This builds
panel_gemm.cpp, quant_gemm.cpp, quant_int8.cpp, paged_decode.cpp and paged_prefill.cpp for `--march`:
by default haswell (AVX2, FMA, F16C, no AVX-512) where the native build has AVX-512, and
`avx512-emulated` where it has not: the AVX-512 paths built for AVX2 with SIMDe's portable AVX-512
intrinsics (benchmarks/kernels/avx512_on_avx2.h; SIMDe's headers are fetched once from Debian's
archive, pinned by hash, into ~/.cache/conveyor), slow but with the instructions' results.

It checks on random blocks of every GGUF type the kernel reads that both builds give gguf's
dequantised weights exactly (one-hot rows) and bit-identical products at 1-33 and 131 rows, with
and without bias, on a partial last panel, and bit-identical int8-activation products (VNNI against
vpmaddubsw, rows with features carried exactly among them); that both builds' decode attention
matches a float64 reference (1e-5) over head sizes 16-256, GQA groups 1-8, blocks of 4 and 16 tokens,
sliding windows, one row and many, rows with blocks of their own and rows sharing their first
block (its two spans); and that both builds' prefill attention matches one too (2e-5): fresh
prompts and cache hits, GQA groups 1-32, blocks of 5 and 16 tokens, windows; both attention
kernels on an fp32 cache and on a float16 one.

    python benchmarks/isa_check.py [--march haswell | avx512-emulated | another -march target]
"""
from __future__ import annotations

import argparse
import hashlib
import io
import itertools
import os
import shutil
import sysconfig
import tarfile
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from gguf import quants
from gguf.constants import GGMLQuantizationType

from conveyor.model import kernels
from conveyor.model.kernels import _load, panel_gemm, quant_gemm
from conveyor.model.loader import model_cache_dir
from conveyor.model.quantized import BLOCK_SIZES, HALF_TYPES, INT8_TYPES, KERNEL_QTYPE, KERNEL_TYPES, KERNEL_UNIT_K

EMULATED = "avx512-emulated"
EMULATION_HEADER = Path(__file__).parent / "kernels" / "avx512_on_avx2.h"
# SIMDe 0.7.4 (header-only, MIT), as Debian 12 packages it.
SIMDE_DEB = "http://deb.debian.org/debian/pool/main/s/simde/libsimde-dev_0.7.4~rc2-2_all.deb"
SIMDE_SHA256 = "471b66fdc79e0a479c4d11dc85c2b6313df1704b737ea2f7266753335c5d062b"
# The native build's int8 product takes its AVX-512 path with all four (quant_int8.cpp), as
# /proc/cpuinfo spells them (VNNI with an underscore, VBMI without).
AVX512_FLAGS = ("avx512f", "avx512bw", "avx512_vnni", "avx512vbmi")

HALF_OFFSETS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
                "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "Q2_K": [80, 82], "Q3_K": [108], "F16": [0], "BF16": [0]}


def native_has_avx512() -> bool:
    with open("/proc/cpuinfo") as cpuinfo:
        flags = next((line.split() for line in cpuinfo if line.startswith("flags")), [])
    return all(flag in flags for flag in AVX512_FLAGS)


def simde_include_dir() -> Path:
    """SIMDe's headers, fetched from Debian's archive and unpacked on first use."""
    target = model_cache_dir() / "simde-0.7.4"
    include = target / "usr" / "include"
    if (include / "simde" / "x86" / "avx512.h").is_file():
        return include
    print(f"isa_check: fetching SIMDe's headers ({SIMDE_DEB}) into {target}", flush=True)
    with urllib.request.urlopen(SIMDE_DEB, timeout=120) as response:
        deb = response.read()
    if hashlib.sha256(deb).hexdigest() != SIMDE_SHA256:
        raise SystemExit(f"isa_check: {SIMDE_DEB} does not have the expected sha256 {SIMDE_SHA256}")
    # A .deb is an ar archive (8-byte magic, then 60-byte member headers: name, ..., size at 48-58).
    data, offset = None, 8
    while offset + 60 <= len(deb):
        name, size = deb[offset : offset + 16].decode().strip(), int(deb[offset + 48 : offset + 58].decode())
        if name.startswith("data.tar"):
            data = deb[offset + 60 : offset + 60 + size]
        offset += 60 + size + size % 2
    if data is None:
        raise SystemExit(f"isa_check: {SIMDE_DEB} holds no data.tar")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".simde-"))
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        archive.extractall(staging, members=[m for m in archive.getmembers() if m.name.startswith("./usr/include/simde")],
                           filter="data")
    try:
        os.replace(staging, target)
    except OSError:  # another process unpacked it first
        shutil.rmtree(staging, ignore_errors=True)
    return include


def build(name: str, march: str) -> Any:
    """`name`.cpp built for `march` by the kernels' own builder (conveyor.model.kernels.compile_module),
    named by content and flags and cached beside the server's builds; EMULATED: its AVX-512 code on
    this AVX2 CPU (at -O1: the emulated intrinsics take minutes to compile at -O3 and run slowly at
    any level)."""
    sources = kernels._sources(name)
    if march != EMULATED:
        flags = ["-O3", f"-march={march}", "-fopenmp", "-fno-trapping-math"]
    else:
        include = simde_include_dir()
        sources[EMULATION_HEADER.name] = EMULATION_HEADER.read_bytes()
        flags = ["-O1", "-march=haswell", f"-I{include}", "-include", EMULATION_HEADER.name, "-fopenmp",
                 "-fno-trapping-math"]
    digest = hashlib.sha1(" ".join(flags).encode())
    for file_name, content in sources.items():
        digest.update(file_name.encode() + b"\0" + content + b"\0")
    extension = f"conveyor_{name}_march_{march.replace('-', '_')}_{digest.hexdigest()[:12]}"
    library = kernels._cache_root() / extension / f"{extension}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if library.is_file():
        return kernels._import_module(extension, library)
    source = kernels._staged_source(name, library.parent / "src", sources)
    if march == EMULATED:  # the forced include, found beside the source
        flags[flags.index(EMULATION_HEADER.name)] = str(source.parent / EMULATION_HEADER.name)
    return kernels.compile_module(extension, source, flags, library)


def softmax(scores: np.ndarray) -> np.ndarray:
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


def attention_reference(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, tables: np.ndarray,
                        lens: list[int], scale: float, window: int) -> np.ndarray:
    heads, kv_heads, block_size = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    rows = []
    for i, c in enumerate(lens):
        slots = [(int(tables[i, t // block_size]), t % block_size) for t in range(max(0, c - window) if window else 0, c)]
        k = np.stack([k_cache[b, o] for b, o in slots]).astype(np.float64).repeat(heads // kv_heads, axis=1)
        v = np.stack([v_cache[b, o] for b, o in slots]).astype(np.float64).repeat(heads // kv_heads, axis=1)
        weights = softmax(np.einsum("hd,thd->ht", q[i].astype(np.float64), k) * scale)
        rows.append(np.einsum("ht,thd->hd", weights, v))
    return np.stack(rows)


def attention_agrees(native: Any, other: Any) -> bool:
    rng = np.random.default_rng(0)
    ok = True
    for head_dim, heads, kv_heads, block_size in ((16, 6, 2, 4), (64, 9, 3, 16), (128, 32, 4, 16), (256, 4, 1, 16),
                                                  (256, 8, 8, 4), (80, 10, 2, 16)):
        for lens, window in (([1], 0), ([37], 0), ([1500], 0), ([5, 1, 17, 8, 300, 70], 0), ([300, 9], 7),
                             ([64, 3, 33, 4, 4, 120], 50)):
            blocks = sum(-(-c // block_size) for c in lens) + 2
            k_cache = rng.standard_normal((blocks, block_size, kv_heads, head_dim)).astype(np.float32)
            v_cache = rng.standard_normal((blocks, block_size, kv_heads, head_dim)).astype(np.float32)
            order = rng.permutation(blocks).tolist()
            width, tables, used = max(-(-c // block_size) for c in lens), [], 0
            for c in lens:
                n = -(-c // block_size)
                tables.append(order[used : used + n] + [0] * (width - n))
                used += n
            q = rng.standard_normal((len(lens), heads, head_dim)).astype(np.float32)
            scale = head_dim**-0.5
            # Each row's own blocks (the token-by-token span), then every row's first block row 0's
            # (a prefix-cache hit: the register-blocked span).
            # An fp32 cache and a float16 one (read into fp32: the reference takes the same halves).
            for shared_first, dtype in itertools.product((False, True), (np.float32, np.float16)):
                rows = [[tables[0][0], *t[1:]] if shared_first else t for t in tables]
                table_array = np.array(rows, dtype=np.int64)
                kc, vc = k_cache.astype(dtype), v_cache.astype(dtype)
                want = attention_reference(q, kc, vc, table_array, lens, scale, window)
                for kernel in (native, other):
                    got = kernel.paged_decode_attention(q, kc, vc, table_array, np.array(lens, dtype=np.int64), scale,
                                                        window)
                    ok &= bool(np.allclose(got, want, rtol=1e-5, atol=1e-5))
    return ok


def prefill_attention_agrees(native: Any, other: Any) -> bool:
    """Both builds' prefill attention against each query's softmax in float64: fresh prompts and
    cache hits, lengths on and off a step's 16 (AVX2: 8) keys, GQA groups 1-32, windows."""
    rng = np.random.default_rng(1)
    ok = True
    cases = ((0, 1, 0), (0, 37, 0), (0, 300, 0), (45, 70, 0), (1024, 9, 0), (30, 20, 17), (100, 7, 40), (0, 50, 1))
    for head_dim, heads, kv_heads, block_size in ((64, 9, 3, 16), (128, 32, 4, 16), (256, 4, 1, 16), (64, 8, 8, 5),
                                                  (128, 32, 1, 16)):
        for (num_cached, num_tokens, window), dtype in itertools.product(cases, (np.float32, np.float16)):
            total = num_cached + num_tokens
            used = -(-total // block_size)
            k_cache = rng.standard_normal((used + 2, block_size, kv_heads, head_dim)).astype(dtype)
            v_cache = rng.standard_normal((used + 2, block_size, kv_heads, head_dim)).astype(dtype)
            table = rng.permutation(used + 2)[:used].astype(np.int64)
            slots = table[np.arange(total) // block_size] * block_size + np.arange(total) % block_size
            keys = k_cache.reshape(-1, kv_heads, head_dim)[slots].astype(np.float64).repeat(heads // kv_heads, axis=1)
            values = v_cache.reshape(-1, kv_heads, head_dim)[slots].astype(np.float64).repeat(heads // kv_heads, axis=1)
            q = rng.standard_normal((num_tokens, heads, head_dim)).astype(np.float32)
            scale = head_dim**-0.5
            want = []
            for i in range(num_tokens):
                pos = num_cached + i
                first = max(0, pos - window + 1) if window else 0
                weights = softmax(np.einsum("hd,thd->ht", q[i].astype(np.float64), keys[first:pos + 1]) * scale)
                want.append(np.einsum("ht,thd->hd", weights, values[first:pos + 1]))
            for kernel in (native, other):
                got = kernel.paged_prefill_attention(q, k_cache, v_cache, table, num_cached, scale, window)
                ok &= bool(np.allclose(got, np.stack(want), rtol=2e-5, atol=2e-5))
    return ok


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16 (nearest even, as the kernels round them), as float64."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32).view(np.float32).astype(np.float64)


def random_blocks(qtype: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Uniformly random code and scale bytes; any finite fp16 bit pattern in the fp16 fields."""
    weights, nbytes = BLOCK_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * k // weights, nbytes), dtype=np.uint8)
    for offset in HALF_OFFSETS[qtype]:
        bits = rng.integers(0, 1 << 16, raw.shape[0], dtype=np.uint16)
        infinite = 0x7F80 if qtype == "BF16" else 0x7C00  # the exponent of inf and NaN
        bits[(bits & infinite) == infinite] &= 0xBFFF
        raw[:, offset : offset + 2] = bits.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--march", default=None,
                        help=f"the other build's target (default: haswell on an AVX-512 machine, else {EMULATED})")
    args = parser.parse_args()
    if args.march is None:
        args.march = "haswell" if native_has_avx512() else EMULATED
    print(f"isa_check: the native build against a {args.march} build", flush=True)
    native_panels: Any = panel_gemm()
    native_quant: Any = quant_gemm()
    if native_panels is None or native_quant is None:
        raise SystemExit("the native kernels are not built here")
    other_panels, other_quant = build("panel_gemm", args.march), build("quant_gemm", args.march)
    native_int8: Any = _load("quant_int8")
    other_int8 = build("quant_int8", args.march)
    rng = np.random.default_rng(0)
    failures = 0
    for qtype in KERNEL_TYPES:
        unit = KERNEL_UNIT_K[qtype]
        k, n = 3 * unit if unit == 256 else 4 * unit, 40  # 40 outputs: a partial last panel
        raw = random_blocks(qtype, n, k, rng)
        weight = np.ascontiguousarray(quants.dequantize(raw, GGMLQuantizationType[qtype]), dtype=np.float32).reshape(n, k)
        code = KERNEL_QTYPE[qtype]
        packed = {"native": native_quant.pack_quantized(raw, code), args.march: other_quant.pack_quantized(raw, code)}
        same_packing = np.array_equal(packed["native"], packed[args.march])
        dense = native_panels.pack_panels(weight)
        eye = np.eye(k, dtype=np.float32)
        exact = all(np.array_equal(kernel.quantized_matmul(eye, packed[name], n, None, code).T, weight)
                    for name, kernel in (("native", native_quant), (args.march, other_quant)))
        identical = True
        bias = rng.standard_normal(n).astype(np.float32)
        for rows in (1, 2, 3, 4, 5, 7, 8, 10, 11, 13, 32, 33, 131):  # 131: row blocks of 96 and 120
            x = rng.standard_normal((rows, k)).astype(np.float32)
            for b in (None, bias):
                want = native_panels.panel_matmul(x, dense, n, b)
                got = [native_quant.quantized_matmul(x, packed["native"], n, b, code),
                       other_quant.quantized_matmul(x, packed[args.march], n, b, code),
                       other_panels.panel_matmul(x, other_panels.pack_panels(weight), n, b)]
                identical &= all(np.array_equal(want, g) for g in got)
        # int8 activations: the integer sums are exact in both builds and the scales apply in the same order
        int8_identical = True
        for rows in (1, 3, 4, 17, 33, 131) if qtype in INT8_TYPES else ():  # F16 / BF16: fp32 products only
            x = rng.standard_normal((rows, k)).astype(np.float32)
            flat = x.reshape(-1)
            flat[rng.permutation(x.size)[: x.size // 64]] *= 100.0  # lone large features, carried exactly
            for b in (None, bias):
                int8_identical &= np.array_equal(native_int8.int8_matmul(x, packed["native"], n, b, code),
                                                 other_int8.int8_matmul(x, packed[args.march], n, b, code))
        # 16-bit floats with fast activations: x (and F16 weights) rounded to bf16 on vdpbf16ps, in a
        # build for a CPU with AVX512-BF16 only (elsewhere the engine keeps the exact product);
        # against float64.
        bf16_note, bf16_ok = "", True
        if qtype in HALF_TYPES:  # weights of a model's size (any bit pattern's products would overflow)
            values = rng.uniform(-1, 1, (n, k)).astype(np.float32)
            if qtype == "BF16":
                sane_bits = (bf16(values).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
                sane = bf16(values)
            else:
                sane_bits = values.astype(np.float16).view(np.uint16)
                sane = values.astype(np.float16).astype(np.float64)
            sane_blocks = np.ascontiguousarray(sane_bits).view(np.uint8).reshape(n, -1)
            runs = {"native": (native_int8, native_quant), args.march: (other_int8, other_quant)}
            for kernel, packer in runs.values():
                for rows in (9, 33) if kernel.bf16_dot() else ():  # one tile, three
                    x = rng.standard_normal((rows, k)).astype(np.float32)
                    xb, wd = bf16(x), bf16(sane.astype(np.float32))
                    y = kernel.bf16_dot_matmul(x, packer.pack_quantized(sane_blocks, code), n, bias, code).astype(np.float64)
                    want = xb @ wd.T + bias.astype(np.float64)
                    bound = (np.abs(xb) @ np.abs(wd).T + np.abs(bias.astype(np.float64))) * (k + 2) * 2.0**-24
                    bf16_ok &= bool((np.abs(y - want) <= bound + 1e-30).all())
            built = ", ".join(f"{name} {bool(kernel.bf16_dot())}" for name, (kernel, _) in runs.items())
            bf16_note = f"; bf16 products (built: {built}) match float64 {bf16_ok}"
        ok = same_packing and exact and identical and int8_identical and bf16_ok
        failures += not ok
        print(f"{qtype}: packing equal {same_packing}, weights = gguf's in both builds {exact}, "
              f"products bit-identical (native / {args.march} blocks, {args.march} panels vs native panels) {identical}, "
              f"int8 products bit-identical ({native_int8.isa()} / {other_int8.isa()}) "
              f"{int8_identical if qtype in INT8_TYPES else 'n/a (no int8 product)'}{bf16_note}")
    attention_ok = attention_agrees(_load("paged_decode"), build("paged_decode", args.march))
    failures += not attention_ok
    print(f"decode attention: native and {args.march} builds match the float64 reference {attention_ok}")
    prefill_ok = prefill_attention_agrees(_load("paged_prefill"), build("paged_prefill", args.march))
    failures += not prefill_ok
    print(f"prefill attention: native and {args.march} builds match the float64 reference {prefill_ok}")
    print("all agree" if not failures else f"{failures} check(s) disagree")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
