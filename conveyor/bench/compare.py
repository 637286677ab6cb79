"""`conveyor bench compare`: one workload, several scheduling policies and request rates, in-process.

All engines share one loaded model, run one after another in this process on the same requests
(same ids, lengths and arrival times), so their figures are ratios from one run on one machine.

Policies (the engine's knobs each one sets):
- `static`: request-level batching; chunked prefill on, budget `--max-num-batched-tokens`.
- `continuous`: iteration-level batching with the engine's defaults: chunked prefill on, same
  budget as static. The cleanest static-vs-continuous pair: only *when requests join* differs.
- `continuous-naive`: chunked prefill off: a prompt is prefilled whole in one step (the budget is
  raised to the longest request if needed), so every decode in the batch waits for it.
- `continuous-chunked`: chunked prefill on with a small budget `--chunk-size`, so long prompts are
  cut into chunks that ride along with the decodes (Sarathi-Serve).
- `continuous-slo`: as `continuous`, with the SLO controller holding `--slo-tpot-ms` (it lowers
  the batch cap and token budget under `--max-num-seqs` / `--max-num-batched-tokens` as load requires).

With `--rate-schedule` the arrivals follow it (one run per policy; the table's rate column shows the
schedule's mean rate) instead of the `--request-rate` list.
"""
from __future__ import annotations

import gc
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from conveyor.errors import ConfigError
from conveyor.bench.metrics import compute_metrics, per_request_dict
from conveyor.bench.offline import run_offline
from conveyor.bench.results import RunResult
from conveyor.bench.workloads import (
    BenchRequest,
    WorkloadConfig,
    describe,
    generate_requests,
    parse_rate_schedule,
    request_arrivals,
)
from conveyor.config import EngineConfig, SchedulerConfig, SpeculativeConfig


@dataclass
class CompareConfig:
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    request_rates: list[float] = field(default_factory=lambda: [math.inf])
    burstiness: float = 1.0
    rate_schedule: str | None = None  # e.g. "0:1,120:4,240:1"; overrides request_rates
    slo_tpot_ms: float | None = None  # for the continuous-slo policy
    policies: list[str] = field(default_factory=lambda: ["static", "continuous-naive", "continuous-chunked"])
    max_num_seqs: int = 32  # below the engine's 64: the policies differ most with a few slots
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    chunk_size: int = 128  # the token budget of continuous-chunked
    # The engine's own defaults (conveyor/config.py)
    kv_cache_memory: str | int = EngineConfig.kv_cache_memory
    block_size: int = EngineConfig.block_size
    enable_prefix_caching: bool = EngineConfig.enable_prefix_caching
    model: str | None = EngineConfig.model
    dtype: str = EngineConfig.dtype
    dequantize_weights: bool = EngineConfig.dequantize_weights
    kv_cache_dtype: str = EngineConfig.kv_cache_dtype
    num_threads: int | None = EngineConfig.num_threads
    # The continuous-spec policy's speculative decoding (None: SpeculativeConfig's defaults, n-gram)
    speculative_config: SpeculativeConfig | None = None
    output_dir: str = "out/compare"
    percentiles: list[float] = field(default_factory=lambda: [99.0])
    goodput: dict[str, float] = field(default_factory=dict)
    warmup: bool = True
    plots: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown:
            raise ConfigError(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
        if "continuous-slo" in self.policies and not self.slo_tpot_ms:
            raise ConfigError("the continuous-slo policy needs slo_tpot_ms (--slo-tpot-ms)")
        if 99.0 not in self.percentiles:
            self.percentiles = [*self.percentiles, 99.0]


def _static(c: CompareConfig, longest: int) -> dict[str, Any]:
    return dict(policy="static", chunked_prefill=True, max_num_batched_tokens=c.max_num_batched_tokens)


def _continuous(c: CompareConfig, longest: int) -> dict[str, Any]:
    return dict(policy="continuous", chunked_prefill=True, max_num_batched_tokens=c.max_num_batched_tokens)


def _naive(c: CompareConfig, longest: int) -> dict[str, Any]:
    budget = max(c.max_num_batched_tokens, longest)  # a whole request must fit one step
    return dict(policy="continuous", chunked_prefill=False, max_num_batched_tokens=budget)


def _chunked(c: CompareConfig, longest: int) -> dict[str, Any]:
    return dict(policy="continuous", chunked_prefill=True, max_num_batched_tokens=c.chunk_size)


def _slo(c: CompareConfig, longest: int) -> dict[str, Any]:
    return dict(_continuous(c, longest), slo_tpot_ms=c.slo_tpot_ms)


def _spec(c: CompareConfig, longest: int) -> dict[str, Any]:
    return dict(_continuous(c, longest), speculative_config=asdict(c.speculative_config or SpeculativeConfig()))


POLICIES: dict[str, Callable[[CompareConfig, int], dict[str, Any]]] = {
    "static": _static,
    "continuous": _continuous,
    "continuous-naive": _naive,
    "continuous-chunked": _chunked,
    "continuous-slo": _slo,
    "continuous-spec": _spec,
}


def engine_kwargs(cfg: CompareConfig, policy: str, requests: list[BenchRequest]) -> dict[str, Any]:
    longest = max(r.prompt_len + r.output_len for r in requests)
    return dict(
        model=cfg.model, dtype=cfg.dtype, dequantize_weights=cfg.dequantize_weights, num_threads=cfg.num_threads,
        kv_cache_dtype=cfg.kv_cache_dtype, max_num_seqs=cfg.max_num_seqs,
        kv_cache_memory=cfg.kv_cache_memory, block_size=cfg.block_size,
        enable_prefix_caching=cfg.enable_prefix_caching, **POLICIES[policy](cfg, longest),
    )


def run_compare(cfg: CompareConfig, loaded: Any | None = None, echo: Callable[[str], None] = print) -> list[RunResult]:
    """Runs every policy at every rate; `loaded` (runner.model_runner.LoadedModel) is loaded if None."""
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.runner.model_runner import load_model

    if cfg.num_threads:
        from conveyor.model.threads import set_num_threads

        set_num_threads(cfg.num_threads)
    loaded = loaded or load_model(EngineConfig.from_kwargs(model=cfg.model, dtype=cfg.dtype,
                                                           dequantize_weights=cfg.dequantize_weights))
    cfg.workload.vocab_size = loaded.model.cfg.vocab_size
    if cfg.workload.tokenizer is None:
        cfg.workload.tokenizer = cfg.model or "smollm2-135m"  # the edit and questions datasets' prompts are real text
    requests = generate_requests(cfg.workload)
    echo(f"workload {cfg.workload.dataset}: {describe(requests)}")
    results = []
    schedule = parse_rate_schedule(cfg.rate_schedule) if cfg.rate_schedule else None
    for rate in [math.nan] if schedule else cfg.request_rates:
        arrivals = request_arrivals(requests, rate, cfg.burstiness, cfg.workload.seed, schedule)
        if schedule:
            last = max(t for t in arrivals if not math.isnan(t))
            rate = float(f"{len(requests) / max(last, 1e-9):.3g}")  # its mean rate labels the run
        for policy in cfg.policies:
            kwargs = engine_kwargs(cfg, policy, requests)
            engine = LLMEngine.from_config(EngineConfig.from_kwargs(**kwargs), loaded)
            if cfg.warmup:
                engine.warm_up()
            echo(f"running {policy} at rate {rate} ...")
            offline = run_offline(engine, requests, arrivals, progress=cfg.progress)
            metrics = compute_metrics(offline.records, offline.duration, cfg.percentiles, cfg.goodput or None)
            if cfg.enable_prefix_caching or "ttft_mean_later_turns_ms" in offline.extra:  # turns: on or off
                echo("  prefix cache: " + ", ".join(f"{k} {v:.3g}" for k, v in offline.extra.items()))
            results.append(RunResult(policy, rate, kwargs, offline, metrics))
            del engine
            gc.collect()
    return results


_COLUMNS = [  # header, width, value
    ("policy", 20, lambda r, base: r.policy),
    ("rate", 6, lambda r, base: "inf" if math.isinf(r.rate) else f"{r.rate:g}"),
    ("req/s", 7, lambda r, base: f"{r.metrics.request_throughput:.2f}"),
    ("out tok/s", 9, lambda r, base: f"{r.metrics.output_throughput:.1f}"),
    ("TTFT mean", 9, lambda r, base: f"{r.metrics.stats['ttft'].mean:.0f}"),
    ("TTFT p50", 9, lambda r, base: f"{r.metrics.stats['ttft'].median:.0f}"),
    ("TTFT p99", 9, lambda r, base: f"{_p99(r, 'ttft'):.0f}"),
    ("TPOT mean", 9, lambda r, base: f"{r.metrics.stats['tpot'].mean:.1f}"),
    ("TPOT p99", 9, lambda r, base: f"{_p99(r, 'tpot'):.1f}"),
    ("ITL p99", 9, lambda r, base: f"{_p99(r, 'itl'):.1f}"),
    ("preempt", 7, lambda r, base: str(r.offline.num_preemptions)),
    ("x static", 8, lambda r, base: "-" if base is None else f"{r.metrics.output_throughput / base:.2f}x"),
]


def _p99(r: RunResult, name: str) -> float:
    return dict(r.metrics.stats[name].percentiles)[99.0]


def format_table(results: list[RunResult]) -> str:
    """One row per (policy, rate); latencies in ms; 'x static' = output tok/s over static's at that rate."""
    static = {r.rate: r.metrics.output_throughput for r in results if r.policy == "static"}
    widths = [w for _, w, _ in _COLUMNS]

    def line(cells: list[str]) -> str:  # first column left-aligned, the numbers right-aligned
        return "  ".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, w) in enumerate(zip(cells, widths)))

    lines = [line([h for h, _, _ in _COLUMNS])]
    for r in results:
        base = static.get(r.rate) or None
        lines.append(line([fn(r, base) for _, _, fn in _COLUMNS]))
    return "\n".join(lines)


def save_json(cfg: CompareConfig, results: list[RunResult], path: Path) -> None:
    def clean(x: float) -> float | str:
        return "inf" if isinstance(x, float) and math.isinf(x) else x

    config = asdict(cfg)
    config["request_rates"] = [clean(r) for r in cfg.request_rates]
    runs = []
    for r in results:
        summary = r.summary()
        summary["request_rate"] = clean(r.rate)
        runs.append({**summary, "engine": r.engine_kwargs, "trace": r.offline.trace_dict(),
                     **per_request_dict(r.offline.records)})
    path.write_text(json.dumps({"config": config, "table": format_table(results), "runs": runs}, indent=1))


def main(cfg: CompareConfig) -> int:
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = run_compare(cfg)
    table = format_table(results)
    print(table)
    (out_dir / "table.txt").write_text(table + "\n")
    save_json(cfg, results, out_dir / "compare.json")
    written = [out_dir / "table.txt", out_dir / "compare.json"]
    if cfg.plots:
        from conveyor.bench.plots import write_plots

        written += write_plots(results, out_dir)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0
