"""PNG figures for `conveyor bench compare` (matplotlib, Agg backend: no display needed).

- occupancy.png: batch occupancy per iteration over time, static (slots held / computing) vs
  continuous: "full from first to last" against "decaying from head to tail".
- itl_over_time.png: every inter-token gap at the time its token arrived, naive vs chunked
  prefill: the stalls long prefills cause, and their removal.
- latency_cdf.png: TTFT and TPOT CDFs per policy (one row per request rate).
- vs_rate.png: output throughput and TPOT (mean, P99) against request rate, per policy.
- slo_control.png: under load that rises and falls, the SLO controller's batch cap beside each run's
  batch size, and every request's TPOT at the time it finished against the target.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from conveyor.bench.offline import OfflineResult
    from conveyor.bench.results import RunResult

COLORS = {"static": "tab:red", "continuous": "tab:blue", "continuous-naive": "tab:orange",
          "continuous-chunked": "tab:green", "continuous-slo": "tab:purple"}


def _plt():  # noqa: ANN202 - matplotlib.pyplot
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _rate_label(rate: float) -> str:
    return "all at once" if math.isinf(rate) else f"{rate:g} req/s"


def _rates(results: Sequence["RunResult"]) -> list[float]:
    return list(dict.fromkeys(r.rate for r in results))


def _pick(results: Sequence["RunResult"], policy: str, rate: float) -> "RunResult | None":
    return next((r for r in results if r.policy == policy and r.rate == rate), None)


def plot_occupancy(results: Sequence["RunResult"], path: Path) -> Path | None:
    continuous = [p for p in ("continuous", "continuous-chunked", "continuous-naive")
                  if any(r.policy == p for r in results)]
    if not any(r.policy == "static" for r in results) or not continuous:
        return None
    plt = _plt()
    rates = _rates(results)
    fig, axes = plt.subplots(len(rates), 1, figsize=(10, 3.2 * len(rates)), squeeze=False)
    for ax, rate in zip(axes[:, 0], rates):
        static, cont = _pick(results, "static", rate), _pick(results, continuous[0], rate)
        for run, held in ((static, True), (cont, False)):
            if run is None:
                continue
            trace, cap = run.offline.trace, run.offline.max_num_seqs
            if not trace:
                continue
            t = [s.t - s.duration for s in trace] + [trace[-1].t]  # each value spans its step

            def series(values: list[int], cap: int = cap) -> list[float]:
                return [v / cap for v in values] + [values[-1] / cap]

            ax.step(t, series([s.running for s in trace]), where="post", color=COLORS[run.policy],
                    label=f"{run.policy}: computing")
            if held:
                ax.step(t, series([s.held for s in trace]), where="post", color=COLORS[run.policy],
                        linestyle="--", alpha=0.6, label=f"{run.policy}: slots held (incl. finished)")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("running / max_num_seqs")
        ax.set_title(f"Batch occupancy per iteration ({_rate_label(rate)})")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("time since start (s)")
    return _save(fig, path)


def plot_itl_over_time(results: Sequence["RunResult"], path: Path) -> Path | None:
    pair = ("continuous-naive", "continuous-chunked")
    rates = [rate for rate in _rates(results) if all(_pick(results, p, rate) for p in pair)]
    if not rates:
        return None
    plt = _plt()
    fig, axes = plt.subplots(len(rates), 1, figsize=(10, 3.4 * len(rates)), squeeze=False)
    for ax, rate in zip(axes[:, 0], rates):
        for policy in pair:
            run = _pick(results, policy, rate)
            times: list[float] = []
            gaps: list[float] = []
            for rec in run.offline.records:  # type: ignore[union-attr]
                token_times = rec.token_times()
                times += token_times[1:]
                gaps += rec.itl
            p99 = np.percentile(np.asarray(gaps) * 1000, 99) if gaps else 0.0
            ax.scatter(times, np.asarray(gaps) * 1000, s=4, alpha=0.5, color=COLORS[policy],
                       label=f"{policy} (P99 ITL {p99:.0f} ms)")
        ax.set_yscale("log")
        ax.set_ylabel("inter-token latency (ms)")
        ax.set_title(f"Per-token latency over time ({_rate_label(rate)})")
        ax.legend(loc="upper right", fontsize=8, markerscale=3)
    axes[-1, 0].set_xlabel("time since start (s)")
    return _save(fig, path)


def plot_latency_cdfs(results: Sequence["RunResult"], path: Path) -> Path | None:
    if not results:
        return None
    plt = _plt()
    rates = _rates(results)
    fig, axes = plt.subplots(len(rates), 2, figsize=(11, 3.4 * len(rates)), squeeze=False)
    for row, rate in zip(axes, rates):
        for run in (r for r in results if r.rate == rate):
            ok = [r for r in run.offline.records if r.success]
            for ax, values in ((row[0], [r.ttft for r in ok]), (row[1], [t for t in (r.tpot for r in ok) if t])):
                if values:
                    xs = np.sort(np.asarray(values) * 1000)
                    ys = np.arange(len(xs) + 1) / len(xs)  # the empirical CDF, from 0 at the smallest value
                    ax.step(np.concatenate([xs[:1], xs]), ys, where="post", color=COLORS.get(run.policy),
                            label=run.policy)
        for ax, name in zip(row, ("TTFT", "TPOT")):
            ax.set_ylim(0, 1.02)
            ax.set_xlabel(f"{name} (ms)")
            ax.set_ylabel("fraction of requests")
            ax.set_title(f"{name} CDF ({_rate_label(rate)})")
            ax.legend(loc="lower right", fontsize=8)
    return _save(fig, path)


def plot_vs_rate(results: Sequence["RunResult"], path: Path) -> Path | None:
    if not results:
        return None
    plt = _plt()
    rates = _rates(results)
    xs = np.arange(len(rates))
    fig, (ax_tp, ax_tpot) = plt.subplots(1, 2, figsize=(11, 3.8))
    for policy in dict.fromkeys(r.policy for r in results):
        runs = [_pick(results, policy, rate) for rate in rates]
        tput = [r.metrics.output_throughput if r else np.nan for r in runs]
        mean = [r.metrics.stats["tpot"].mean if r else np.nan for r in runs]
        p99 = [dict(r.metrics.stats["tpot"].percentiles)[99.0] if r else np.nan for r in runs]
        color = COLORS.get(policy)
        ax_tp.plot(xs, tput, marker="o", color=color, label=policy)
        ax_tpot.plot(xs, mean, marker="o", color=color, label=f"{policy} mean")
        ax_tpot.plot(xs, p99, marker="^", linestyle="--", color=color, label=f"{policy} P99")
    for ax, ylabel in ((ax_tp, "output tokens/s"), (ax_tpot, "TPOT (ms)")):
        ax.set_xticks(xs, ["inf" if math.isinf(r) else f"{r:g}" for r in rates])
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    ax_tp.set_title("Output throughput vs request rate")
    ax_tpot.set_title("TPOT vs request rate")
    return _save(fig, path)


def plot_slo_control(runs: Sequence[tuple[str, "OfflineResult"]], tpot_target_s: float, path: Path,
                     colors: Sequence[str] = ("tab:red", "tab:orange", "tab:purple", "tab:blue", "tab:green")
                     ) -> Path | None:
    """Load, batch size / cap and per-request TPOT over time, one colour per (label, run)."""
    if not runs:
        return None
    plt = _plt()
    fig, (ax_load, ax_batch, ax_tpot) = plt.subplots(3, 1, figsize=(10, 9.5), sharex=True)
    starts = np.sort([r.start for r in runs[0][1].records])
    if len(starts):
        width = max(1.0, float(starts[-1]) / 40)
        bins = np.arange(0.0, float(starts[-1]) + width, width)
        counts, edges = np.histogram(starts, bins=bins)
        ax_load.step(edges[:-1], counts / width, where="post", color="black")
    ax_load.set_ylabel("arrivals (req/s)")
    ax_load.set_title("Offered load")
    for (label, run), color in zip(runs, colors):
        t = [s.t for s in run.trace]
        ax_batch.plot(t, [s.running for s in run.trace], color=color, alpha=0.45, linewidth=0.8,
                      label=f"{label}: running")
        if any(s.slo_batch_cap is not None for s in run.trace):
            ax_batch.step(t, [s.slo_batch_cap for s in run.trace], where="post", color=color, linewidth=2,
                          label=f"{label}: controller's cap")
        ok = sorted((r.start + r.latency, r.tpot * 1000) for r in run.records if r.tpot is not None)
        if ok:
            ends, tpots = np.array(ok).T
            p99 = np.percentile(tpots, 99)
            ax_tpot.scatter(ends, tpots, s=5, alpha=0.5, color=color, label=f"{label} (P99 {p99:.0f} ms)")
    ax_tpot.axhline(tpot_target_s * 1000, color="black", linestyle="--", label=f"target {tpot_target_s * 1000:.0f} ms")
    ax_batch.set_ylabel("requests in the batch")
    ax_batch.set_title("Batch size per step, and the SLO controller's cap")
    ax_tpot.set_ylabel("TPOT (ms)")
    ax_tpot.set_title("Each request's TPOT, at the time it finished")
    ax_tpot.set_xlabel("time since start (s)")
    for ax in (ax_batch, ax_tpot):
        ax.legend(loc="upper right", fontsize=7, markerscale=2)
    return _save(fig, path)


def _slo_figure(results: Sequence["RunResult"], path: Path) -> Path | None:
    slo = next((r for r in results if r.engine_kwargs.get("slo_tpot_ms")), None)
    if slo is None:
        return None
    runs = [(r.policy, r.offline) for r in results if r.rate == slo.rate]
    return plot_slo_control(runs, slo.engine_kwargs["slo_tpot_ms"] / 1000, path,
                            [COLORS.get(label, "tab:gray") for label, _ in runs])


def _save(fig, path: Path) -> Path:  # noqa: ANN001 - a matplotlib Figure
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def write_plots(results: Sequence["RunResult"], out_dir: Path) -> list[Path]:
    """Writes every figure the results support; returns the files written."""
    makers = ((plot_occupancy, "occupancy.png"), (plot_itl_over_time, "itl_over_time.png"),
              (plot_latency_cdfs, "latency_cdf.png"), (plot_vs_rate, "vs_rate.png"), (_slo_figure, "slo_control.png"))
    return [p for fn, name in makers if (p := fn(results, out_dir / name)) is not None]
