"""Profiled cost model: step time as a linear function of the step's shape, fitted by least squares
to step times the real engine measured on this machine (`conveyor simulate fit`).

The features are what a step's work grows with in conveyor's CPU runner: tokens through the
matmuls (prefill and decode rows apart, since decode rows also pay the batched-attention
gather), logits rows (the LM head is a fifth of SmolLM2's weights), one attention call per
prefill chunk, the chunks' causal attention work, the extra work of chunks that continue a
cached prefix (conveyor attends them over the whole context with an explicit mask, not the
causal kernel), and decode attention both as the sum of
contexts and as rows x the longest context (conveyor pads every decode row to the longest in the
batch). Nothing assumes which of the last two dominates: the fit decides, from measurement, so
a paged kernel that reads only each row's own context is picked up by re-profiling.

The fit is non-negative (a feature whose coefficient comes out negative is dropped and the
rest refitted), so the model never predicts that more work takes less time.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from conveyor.errors import ConfigError
from conveyor.sim.shape import StepShape

FEATURES = ("const", "prefill_tokens", "decode_tokens", "sampled", "prefill_chunks", "prefill_attention",
            "cached_chunk_pairs", "decode_context", "decode_padded_context")
DEFAULT_PROFILE = "out/sim/profile.json"


def features(s: StepShape) -> list[float]:
    return [1.0, s.prefill_tokens, s.decode_tokens, s.sampled, s.prefill_chunks, s.prefill_attention,
            s.cached_chunk_pairs, s.decode_context, s.decode_tokens * s.max_decode_context]


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Least squares with coefficients >= 0: drop the most negative one and refit until none is."""
    w = np.ones(len(y)) if weights is None else weights
    xw, yw = x * w[:, None], y * w
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(xw[:, active], yw, rcond=None)
        if sol.min() >= 0:
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


@dataclass
class Profile:
    """Fitted coefficients (seconds per unit of each feature) and where they came from."""

    coefficients: dict[str, float]
    num_samples: int = 0
    r2: float = 0.0
    median_abs_rel_error: float = 0.0
    meta: dict[str, object] = field(default_factory=dict)  # model, dtype, threads, machine, date...

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"profile {path} not found: run `conveyor simulate fit --output {path}` first")
        data = json.loads(path.read_text())
        unknown = set(data.get("coefficients", {})) - set(FEATURES)
        if unknown:
            raise ConfigError(f"profile {path} has unknown features {sorted(unknown)}")
        return cls(**data)


def fit_profile(shapes: Sequence[StepShape], step_s: Sequence[float], meta: dict | None = None) -> Profile:
    """Fits relative error (each sample weighted by 1/its time, since steps span 50 ms to seconds),
    then refits once without outliers (relative residual beyond 3x the median one and 15%): on a
    shared machine a step now and then stalls behind another process, which is not the engine's cost."""
    if len(shapes) < len(FEATURES):
        raise ConfigError(f"need at least {len(FEATURES)} measured steps to fit, got {len(shapes)}")
    x = np.array([features(s) for s in shapes], dtype=float)
    y = np.asarray(step_s, dtype=float)
    coef = nonnegative_lstsq(x, y, 1.0 / y)
    rel = np.abs(x @ coef - y) / y
    keep = rel <= max(3 * float(np.median(rel)), 0.15)
    if keep.sum() >= len(FEATURES) and not keep.all():
        coef = nonnegative_lstsq(x[keep], y[keep], 1.0 / y[keep])
    pred = x @ coef
    r2 = 1.0 - float(np.sum((y - pred) ** 2) / max(np.sum((y - y.mean()) ** 2), 1e-30))
    meta = {**(meta or {}), "outliers_dropped": int((~keep).sum()),
            "samples": {"features": list(FEATURES), "rows": x.tolist(), "step_s": y.tolist()}}
    return Profile(
        coefficients={name: float(c) for name, c in zip(FEATURES, coef)},
        num_samples=len(y), r2=r2, median_abs_rel_error=float(np.median(np.abs(pred - y) / y)), meta=meta,
    )


class ProfiledCostModel:
    name = "profiled"

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        c = profile.coefficients
        (self._const, self._prefill, self._decode, self._sampled, self._chunks, self._attention,
         self._cached_pairs, self._context, self._padded) = (float(c.get(name, 0.0)) for name in FEATURES)

    @classmethod
    def load(cls, path: str | Path) -> "ProfiledCostModel":
        return cls(Profile.load(path))

    def step_time(self, s: StepShape) -> float:
        return (self._const + self._prefill * s.prefill_tokens + self._decode * s.decode_tokens
                + self._sampled * s.sampled + self._chunks * s.prefill_chunks + self._attention * s.prefill_attention
                + self._cached_pairs * s.cached_chunk_pairs
                + self._context * s.decode_context + self._padded * s.decode_tokens * s.max_decode_context)

    def describe(self) -> str:
        meta = self.profile.meta
        terms = ", ".join(f"{k} {v * 1e3:.4g} ms" for k, v in self.profile.coefficients.items() if v)
        return (f"profiled ({meta.get('model', '?')}, {meta.get('num_threads', '?')} threads, "
                f"{self.profile.num_samples} steps, R^2 {self.profile.r2:.3f}): {terms}")
