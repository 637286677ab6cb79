"""The slow outer loop: correct the step-time target from the TPOT that requests actually got.

The step model predicts steps, but a request's TPOT is what the SLO is about: the mean of the steps
it lived through plus whatever the model misses (time between steps, prefill chunks unevenly
spread, the spread of TPOT over requests that makes P99 sit above the mean). So the controller aims
its steps at `a + gain x (TPOT target - a)` (a: the empty-batch step) and this loop moves `gain` so
that a high quantile of recent finished requests' TPOT sits at the target.

Anti-windup: a request that lived mostly in an unsaturated engine (nobody waiting: the cap was not
what limited the batch) says nothing about whether the cap could be higher, so it may only pull the
gain down (when it was too slow), never push it up.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile of a non-empty list (numpy's default method)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class FeedbackConfig:
    initial_gain: float = 0.9  # start with a 10% margin under the target
    min_gain: float = 0.5
    max_gain: float = 1.3
    window: int = 64  # recent finished requests whose TPOT is looked at
    min_samples: int = 16
    update_every: int = 8  # new samples between two corrections, so one sample is not counted 8 times
    quantile: float = 0.95  # of the window, steered to setpoint x target (P99 of a 64-window is its max: noise)
    setpoint: float = 0.95
    exponent: float = 0.5  # how much of the measured ratio one correction applies
    max_step_up: float = 1.08
    max_step_down: float = 0.85


class TpotFeedback:
    def __init__(self, target_s: float, config: FeedbackConfig | None = None) -> None:
        self.target_s = target_s
        self.config = config or FeedbackConfig()
        self.gain = self.config.initial_gain
        self.samples: deque[float] = deque(maxlen=self.config.window)
        self._new = 0
        self.last_quantile_s = 0.0

    def observe(self, tpot_s: float, saturated_fraction: float) -> None:
        """One finished request's TPOT and the fraction of its steps in which someone was waiting."""
        c = self.config
        if saturated_fraction < 0.5 and tpot_s <= c.setpoint * self.target_s:
            return  # fast only because the load was light: no evidence the cap could be higher
        self.samples.append(tpot_s)
        self._new += 1
        if len(self.samples) < c.min_samples or self._new < c.update_every:
            return
        self._new = 0
        self.last_quantile_s = quantile(list(self.samples), c.quantile)
        if self.last_quantile_s <= 0:
            return
        ratio = (c.setpoint * self.target_s / self.last_quantile_s) ** c.exponent
        ratio = min(c.max_step_up, max(c.max_step_down, ratio))
        self.gain = min(c.max_gain, max(c.min_gain, self.gain * ratio))
