"""The block kernels built at two optimisation levels, their products alternated in one process:
does -O3 (4-5x the compile time of -O2 for quant_gemm.cpp and panel_gemm.cpp) buy any speed?

Builds quant_gemm and quant_int8 at `--levels` (default -O3 and -O2; each build is cached like the
server's), then times every block matrix of a GGUF file (default: Qwen2.5-Coder-0.5B-Instruct) but
the vocabulary, the vocabulary projection alone, and, where the file's head is Q8_0, the screened
argmax, at each row count; checks both builds' outputs are equal. Prints medians and the ratio
(first level's time / second's).

    python benchmarks/kernels/build_flags.py --rows 1 4 16 32 256 --repeats 9
    python benchmarks/kernels/build_flags.py --model smollm2-135m --rows 1 16 32
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

import conveyor.model.kernels as kernels
from conveyor.model.gguf_loader import _blocks, read_gguf
from conveyor.model.loader import resolve_model_path
from conveyor.model.quantized import BLOCK_SIZES, KERNEL_QTYPE

Product = tuple[int, int, np.ndarray, int]  # out features, in features, packed panels, qtype


def build(name: str, level: str) -> object:
    kernels._OPTIMIZATION[name] = level
    kernels._load.cache_clear()
    module = kernels._load(name)
    if module is None:
        raise SystemExit(f"{name} did not build at {level}")
    return module


def products(path: str, packer: object) -> tuple[list[Product], Product | None, str]:
    gf = read_gguf(path)
    layers, head, head_type = [], None, ""
    for t in gf.tensors.values():
        q = _blocks(gf, t)
        if q is None:
            continue
        packed = packer.pack_quantized(q.blocks, KERNEL_QTYPE[q.qtype])  # type: ignore[attr-defined]
        weights, nbytes = BLOCK_SIZES[q.qtype]
        in_features = q.blocks.shape[1] // nbytes * weights
        product = (q.blocks.shape[0], in_features, packed, KERNEL_QTYPE[q.qtype])
        if t.name in ("token_embd.weight", "output.weight"):
            if head is None or t.name == "output.weight":
                head, head_type = product, q.qtype
        else:
            layers.append(product)
    return layers, head, head_type


def timed(run: Callable[[], list[np.ndarray]]) -> tuple[float, list[np.ndarray]]:
    start = time.perf_counter()
    out = run()
    return (time.perf_counter() - start) * 1e3, out


def compare(title: str, runs: dict[str, Callable[[], list[np.ndarray]]], repeats: int) -> None:
    times: dict[str, list[float]] = {level: [] for level in runs}
    outs: dict[str, list[np.ndarray]] = {}
    for _ in range(repeats):
        for level, run in runs.items():
            t, outs[level] = timed(run)
            times[level].append(t)
    first, second = list(runs)
    same = all(np.array_equal(a, b) for a, b in zip(outs[first], outs[second]))
    medians = {level: statistics.median(ts) for level, ts in times.items()}
    print(f"{title:44} " + "  ".join(f"{level} {medians[level]:8.2f} ms" for level in runs)
          + f"  {first}/{second} {medians[first] / medians[second]:.3f}  equal {same}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="a conveyor model name or a .gguf path")
    p.add_argument("--levels", nargs=2, default=["-O3", "-O2"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 256])
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    quant = {level: build("quant_gemm", level) for level in args.levels}
    int8 = {level: build("quant_int8", level) for level in args.levels}
    layers, head, head_type = products(str(resolve_model_path(args.model)), quant[args.levels[0]])
    print(f"{args.model}: {len(layers)} block matrices, head {head_type}; numpy {np.__version__}, "
          f"{kernels.get_num_threads()} threads")
    for rows in args.rows:
        time_rows(rows, layers, head, head_type, quant, int8, args.repeats)


def on_layers(module: object, op: str, layers: list[Product], xs: dict[int, np.ndarray]) -> Callable[[], list[np.ndarray]]:
    return lambda: [getattr(module, op)(xs[k], w, n, None, qt) for n, k, w, qt in layers]


def on_head(module: object, head: Product, x: np.ndarray, screened: bool) -> Callable[[], list[np.ndarray]]:
    n, _, w, qt = head
    if screened:
        return lambda: [module.q8_0_argmax(x, w, n, 4096)]  # type: ignore[attr-defined]
    return lambda: [module.quantized_matmul(x, w, n, None, qt)]  # type: ignore[attr-defined]


def time_rows(rows: int, layers: list[Product], head: Product | None, head_type: str, quant: dict[str, object],
              int8: dict[str, object], repeats: int) -> None:
    xs = {k: np.random.default_rng(k).standard_normal((rows, k), dtype=np.float32) for k in {p[1] for p in layers}}
    compare(f"{rows:3} rows: quant_gemm, fp32 x, layers",
            {level: on_layers(m, "quantized_matmul", layers, xs) for level, m in quant.items()}, repeats)
    compare(f"{rows:3} rows: quant_int8, layers", {level: on_layers(m, "int8_matmul", layers, xs) for level, m in int8.items()},
            repeats)
    if head is None:
        return
    x = np.random.default_rng(1).standard_normal((rows, head[1]), dtype=np.float32) * np.float32(3)
    compare(f"{rows:3} rows: quant_gemm, fp32 x, {head_type} head",
            {level: on_head(m, head, x, False) for level, m in quant.items()}, repeats)
    if head_type == "Q8_0" and all(hasattr(m, "q8_0_argmax") for m in quant.values()):
        compare(f"{rows:3} rows: screened Q8_0 argmax", {level: on_head(m, head, x, True) for level, m in quant.items()}, repeats)


if __name__ == "__main__":
    main()
