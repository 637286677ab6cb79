"""`conveyor bench roofline`: where decode turns from memory-bound to compute-bound, predicted and found.

Decode reads every weight once per step whatever the batch, and spends ~2 FLOPs per parameter per
token. So a step costs about max(weight_bytes / bandwidth, batch * flops_per_token / peak_flops):
flat until the knee batch = weight_bytes * peak_flops / (bandwidth * flops_per_token), linear
after. The command measures this machine's bandwidth and matmul throughput, predicts the knee for
the loaded model, then measures decode step time across batch sizes and fits the same two-piece
line to find the knee the engine actually has.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from conveyor.bench.decode import time_decode_steps
from conveyor.engine.llm_engine import LLMEngine


@dataclass
class MachinePeaks:
    bandwidth_gbs: float  # streaming read, GB/s
    fp32_gflops: float  # decode-shaped matmul [64 x hidden] @ [hidden x intermediate]
    bf16_gflops: float  # the same on bf16 weights, as a bfloat16 model multiplies them (model/linear.py)


def _best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_peaks(hidden: int, intermediate: int, repeats: int = 5) -> MachinePeaks:
    from conveyor.model.linear import held_once, matmul_path

    # 256 MiB, far beyond the caches, read by a matrix-vector product (BLAS's, on every thread)
    data = np.ones((256 * 2**20 // 4 // 4096, 4096), dtype=np.float32)
    ones = np.ones(4096, dtype=np.float32)
    read_s = _best_of(lambda: data @ ones, repeats)
    flops = {}
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, hidden), dtype=np.float32)
    w = rng.standard_normal((intermediate, hidden), dtype=np.float32)
    for dtype in ("float32", "bfloat16"):
        # The shape decode runs: a batch of rows against an MLP weight, not a square GEMM; held and
        # multiplied as a model served in `dtype` holds and multiplies it.
        plain, packed = held_once(w, dtype)
        product = matmul_path("int8")
        seconds = _best_of(lambda f=product, p=plain, q=packed: [f(x, p, q, None) for _ in range(20)], repeats) / 20
        flops[dtype] = 2 * 64 * hidden * intermediate / seconds / 1e9
    return MachinePeaks(data.nbytes / read_s / 1e9, flops["float32"], flops["bfloat16"])


def model_costs(model: Any) -> tuple[int, int]:
    """Bytes of weights read per decode step, and FLOPs per decoded token (matmuls only). A
    projection streams its packed form: a GGUF's blocks are 3.8x (Q8_0) to 7.1x (Q4_0) smaller than
    fp32 by their format (SmolLM2-135M's: 96 MB against 538)."""
    from conveyor.model.linear import Embedding, Linear

    def streamed(m: Linear | Embedding) -> int:
        if m.packed is not None:
            return m.packed.nbytes
        assert m.weight is not None
        return int(m.weight.nbytes)

    projections: list[Linear | Embedding] = [m for m in model.modules() if isinstance(m, Linear)]
    if model.lm_head is None:  # tied: the embedding's weight is the vocabulary projection's
        projections.append(model.head)
    # Vectors (norms, biases) are read whole; the embedding only by the rows looked up, so it
    # counts once, as the vocabulary projection (tied or not).
    vectors = sum(int(v.nbytes) for v in model.vectors())
    weight_bytes = vectors + sum(streamed(m) for m in projections)
    matmul_params = sum(m.num_embeddings * m.embedding_dim if isinstance(m, Embedding) else m.in_features * m.out_features
                        for m in projections)
    return weight_bytes, 2 * matmul_params


def fit_knee(batches: list[int], step_s: list[float]) -> float:
    """Knee of t(b) = max(t_flat, slope * b): t_flat from the smallest batch, slope from the largest."""
    slope = step_s[-1] / batches[-1]
    return step_s[0] / slope


@dataclass
class RooflineResult:
    peaks: MachinePeaks
    weight_bytes: int
    flops_per_token: int
    predicted_knee: float
    measured_knee: float
    batches: list[int]
    step_ms: list[float]
    throughput: list[float]
    predicted_step_ms: list[float]


def run_roofline(engine: LLMEngine, batches: list[int], context: int, steps: int) -> RooflineResult:
    cfg = engine.runner.model_config  # type: ignore[attr-defined]
    peaks = measure_peaks(cfg.hidden_size, cfg.intermediate_size)
    weight_bytes, flops_per_token = model_costs(engine.runner.model)  # type: ignore[attr-defined]
    dtype_flops = peaks.fp32_gflops if engine.config.dtype == "float32" else peaks.bf16_gflops
    predicted_knee = weight_bytes * dtype_flops * 1e9 / (peaks.bandwidth_gbs * 1e9 * flops_per_token)
    step_s = [time_decode_steps(engine, b, [context], steps).median_s for b in batches]
    predicted = [max(weight_bytes / (peaks.bandwidth_gbs * 1e9), b * flops_per_token / (dtype_flops * 1e9)) for b in batches]
    return RooflineResult(
        peaks=peaks,
        weight_bytes=weight_bytes,
        flops_per_token=flops_per_token,
        predicted_knee=predicted_knee,
        measured_knee=fit_knee(batches, step_s),
        batches=batches,
        step_ms=[s * 1e3 for s in step_s],
        throughput=[b / s for b, s in zip(batches, step_s)],
        predicted_step_ms=[p * 1e3 for p in predicted],
    )


def report(result: RooflineResult) -> str:
    p = result.peaks
    lines = [
        f"bandwidth {p.bandwidth_gbs:.1f} GB/s | matmul fp32 {p.fp32_gflops:.0f} GFLOP/s, bf16 {p.bf16_gflops:.0f} GFLOP/s",
        f"model: {result.weight_bytes / 1e6:.0f} MB of weights per step, {result.flops_per_token / 1e6:.0f} MFLOP per token",
        f"{'batch':>5} | {'step ms':>8} | {'roofline ms':>11} | {'output tok/s':>12}",
    ]
    for b, ms, pred, tput in zip(result.batches, result.step_ms, result.predicted_step_ms, result.throughput):
        lines.append(f"{b:>5} | {ms:>8.1f} | {pred:>11.1f} | {tput:>12.1f}")
    lines.append(f"predicted knee: batch {result.predicted_knee:.1f} | measured knee: batch {result.measured_knee:.1f}")
    return "\n".join(lines)


def plot(result: RooflineResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(result.batches, result.throughput, "o-", label="measured")
    left.plot(result.batches, [b / (p / 1e3) for b, p in zip(result.batches, result.predicted_step_ms)], "--", label="roofline")
    right.plot(result.batches, result.step_ms, "o-", label="measured")
    right.plot(result.batches, result.predicted_step_ms, "--", label="roofline")
    for ax, label in ((left, "output tokens/s"), (right, "decode step = TPOT (ms)")):
        ax.axvline(result.predicted_knee, color="gray", linestyle=":", label="predicted knee")
        ax.axvline(result.measured_knee, color="red", linestyle=":", label="measured knee")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (max_num_seqs)")
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(result: RooflineResult, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "roofline.json").write_text(json.dumps(asdict(result), indent=2))
    plot(result, out_dir / "roofline.png")
