"""What `conveyor simulate --output-dir` writes: the files `conveyor bench compare` writes
(a table, a JSON with the per-iteration trace and per-request lists, the PNG figures)."""
from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from conveyor.bench.compare import format_table
from conveyor.bench.metrics import per_request_dict
from conveyor.sim.config import SimConfig, SimRun


def _clean(x: Any) -> Any:
    return "inf" if isinstance(x, float) and math.isinf(x) else x


def write_outputs(cfg: SimConfig, runs: Sequence[SimRun], out_dir: str | Path, plots: bool = True,
                  extra: dict[str, Any] | None = None) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = [r.result for r in runs]
    table = format_table(results)
    (out / "table.txt").write_text(table + "\n")
    config = asdict(cfg)
    config["request_rate"] = _clean(cfg.request_rate)
    payload = {"config": config, "table": table, **(extra or {}), "runs": [
        {**r.result.summary(), "request_rate": _clean(r.result.rate), "engine": r.result.engine_kwargs,
         "cost_model": r.cost_model, "num_kv_blocks": r.num_kv_blocks,
         "window_kv_blocks": r.kv_window.num_blocks - 1 if r.kv_window else None, "num_steps": r.num_steps,
         "wall_s": r.wall_s, **({"deployment": r.result.offline.extra} if r.workers else {}),
         "trace": r.result.offline.trace_dict(), **per_request_dict(r.result.offline.records)}
        for r in runs
    ]}
    (out / "sim.json").write_text(json.dumps(payload, indent=1))
    written = [out / "table.txt", out / "sim.json"]
    if plots:
        from conveyor.bench.plots import write_plots

        written += write_plots(results, out)
    return written
