"""Every product of one SmolLM2-135M decode step, cold: the panel kernel vs numpy's matmul (and, with
`--torch`, oneDNN and MKL through torch, as peers).

Builds 30 layers' worth of distinct fp32 weights of the model's shapes (fused QKV 576->960, O
576->576, fused gate/up 576->3072, down 1536->576) plus the 576->49,152 vocabulary projection, 538
MB in all against a 32 MiB L3, and times one pass over all of them at each row count: conveyor's
panel kernel (kernels/panel_gemm.cpp) and `x @ W.T` in numpy (its BLAS, OpenBLAS in numpy's wheels)
on the plain weight, what conveyor multiplies on where the kernel is off (linear.reference_product);
with `--torch` (torch installed: the test extra) also oneDNN on its own packed layout and
`F.linear` (MKL) on the plain weight. The modes alternate repeat by repeat so drift hits all alike.

    python benchmarks/kernels/panel_gemm.py --rows 1 2 4 8 16 32 64 --repeats 5
    python benchmarks/kernels/panel_gemm.py --rows 1 8 32 --torch   # oneDNN and MKL beside
    python benchmarks/kernels/panel_gemm.py --baseline fa25266~1 --rows 1 2 4 6 8 12 16 32 --repeats 16   # a kernel change

With `--baseline REV` it times the working tree's panel kernel against the same kernel built from
its source at git revision REV (same packed weights), alternating the two repeat by repeat.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import numpy as np
from kernel_at import kernel_at

from conveyor.model.kernels import panel_gemm
from conveyor.model.linear import reference_product
from conveyor.model.threads import set_num_threads

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]  # (in, out)
LABELS = {"numpy": "numpy plain", "onednn": "oneDNN", "mkl": "MKL plain"}


def inputs(rows: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(rows)
    return {k: rng.standard_normal((rows, k), dtype=np.float32) for k in (576, 1536)}


def torch_peers(weights: list[np.ndarray]) -> dict[str, Callable[[dict[int, np.ndarray]], list[object]]]:
    """oneDNN on its packed layout and F.linear (MKL) on the plain weight, through torch (the peers
    the panel kernel was written against); x handed over without a copy (torch.from_numpy)."""
    import torch
    import torch.nn.functional as F

    plain = [torch.from_numpy(w) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in plain]

    def onednn_pass(xs: dict[int, np.ndarray]) -> list[object]:
        tensors = {k: torch.from_numpy(x) for k, x in xs.items()}
        return [torch.ops.mkldnn._linear_pointwise(tensors[w.shape[1]], p, None, "none", [], "")
                for w, p in zip(plain, onednn)]

    def mkl_pass(xs: dict[int, np.ndarray]) -> list[object]:
        tensors = {k: torch.from_numpy(x) for k, x in xs.items()}
        return [F.linear(tensors[w.shape[1]], w) for w in plain]

    return {"onednn": onednn_pass, "mkl": mkl_pass}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--baseline", help="git revision whose panel kernel to time beside the working tree's")
    parser.add_argument("--torch", action="store_true", help="also time oneDNN and MKL through torch (installed)")
    args = parser.parse_args()
    set_num_threads(args.num_threads)
    kernel = panel_gemm()
    if kernel is None:
        raise SystemExit("the panel kernel is not available here (no compiler, no AVX2/FMA, or CONVEYOR_KERNELS=0)")
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((n, k), dtype=np.float32) for k, n in SHAPES]
    panels = [kernel.pack_panels(w) for w in weights]  # type: ignore[attr-defined]
    if args.baseline:
        baseline = kernel_at(args.baseline, "panel_gemm")
        baseline.set_num_threads(args.num_threads)  # type: ignore[attr-defined]
        return against_baseline(kernel, baseline, args.baseline, weights, panels, args)
    peers: dict[str, Callable[[dict[int, np.ndarray]], list[object]]] = {
        "numpy": lambda xs: [reference_product(xs[w.shape[1]], w) for w in weights]}
    if args.torch:
        import torch

        torch.set_num_threads(args.num_threads)
        peers.update(torch_peers(weights))
    weight_bytes = sum(w.size * 4 for w in weights)
    flops_per_row = sum(2 * w.size for w in weights)
    print(f"{len(weights)} products, {weight_bytes / 1e6:.0f} MB of fp32 weights, {args.num_threads} threads")
    print("| rows | panels ms (min / median) | " + " | ".join(f"{LABELS[p]} ms" for p in peers) + " | "
          + " | ".join(f"{LABELS[p].split()[0]} / panels" for p in peers) + " | panels GFLOP/s | panels GB/s |")
    print("|---:|---:|" + "---:|---:|" * len(peers) + "---:|---:|")
    for rows in args.rows:
        xs = inputs(rows)
        modes: dict[str, Callable[[], object]] = {
            "panels": lambda xs=xs: [kernel.panel_matmul(xs[w.shape[1]], p, w.shape[0], None)  # type: ignore[attr-defined]
                                     for w, p in zip(weights, panels)],
            **{name: (lambda xs=xs, run=run: run(xs)) for name, run in peers.items()},
        }
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        for run in modes.values():
            run()  # warm-up
        for _ in range(args.repeats):
            for mode, run in modes.items():
                start = time.perf_counter()
                run()
                times[mode].append((time.perf_counter() - start) * 1e3)
        med = {mode: statistics.median(t) for mode, t in times.items()}
        best = min(times["panels"]) / 1e3
        print(f"| {rows} | {min(times['panels']):.1f} / {med['panels']:.1f} | "
              + " | ".join(f"{med[p]:.1f}" for p in peers) + " | "
              + " | ".join(f"{med[p] / med['panels']:.2f}x" for p in peers)
              + f" | {rows * flops_per_row / best / 1e9:.0f} | {weight_bytes / best / 1e9:.1f} |", flush=True)


def against_baseline(kernel: object, baseline: object, revision: str, weights: list[np.ndarray],
                     panels: list[np.ndarray], args: argparse.Namespace) -> None:
    print(f"| rows | this tree ms (min / median) | {revision} ms (min / median) | {revision} / this tree |")
    print("|---:|---:|---:|---:|")
    for rows in args.rows:
        xs = inputs(rows)
        runs = {name: (lambda m=module, xs=xs: [m.panel_matmul(xs[w.shape[1]], p, w.shape[0], None)  # type: ignore[attr-defined]
                                                for w, p in zip(weights, panels)])
                for name, module in (("tree", kernel), ("base", baseline))}
        # as tests/model/test_linear.py: a change may round differently (another order of the sums)
        np.testing.assert_allclose(runs["tree"]()[0], runs["base"]()[0], rtol=1e-5, atol=2e-4)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - start) * 1e3)
        tree, base = times["tree"], times["base"]
        print(f"| {rows} | {min(tree):.1f} / {statistics.median(tree):.1f} | {min(base):.1f} / {statistics.median(base):.1f} "
              f"| {statistics.median(base) / statistics.median(tree):.2f}x |", flush=True)


if __name__ == "__main__":
    main()
