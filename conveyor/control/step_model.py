"""An online model of one engine step's duration, fitted as the engine runs (pure Python).

    step_seconds ~ a + b * decode_rows + c * prefill_tokens + d * decode_rows * mean_decode_context

- `a`: what a step costs whatever it holds: reading every weight once (decode is bandwidth-bound),
  scheduling and launch overheads.
- `b`, `c`: per-token compute through the layers; a decode row also pays the LM head and sampling, a
  prefill token mostly does not, so the two get their own slopes.
- `d`: decode attention, which reads each row's own context: rows x mean context = the sum of the
  contexts (conveyor's C++ decode kernel reads blocks in place, conveyor/model/attention.py). The
  numpy fallback (no compiler, or CONVEYOR_KERNELS=0) pads rows to the longest context and so costs
  a little more than this predicts; the controller's measured/predicted bias absorbs that.

The fit is exponentially weighted least squares (old samples fade with `forgetting`, so the model
follows a machine that slows down or speeds up), with a small ridge scaled by each feature's own
energy (so units do not matter and a feature that never varied does not blow up; none on the
intercept, so a fit from too little variety errs toward a cheaper batch), and non-negative
coefficients (a cost that shrinks as the batch grows is noise, and would invite an unbounded cap).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from conveyor.scheduler import SchedulerOutput

FEATURES = ("intercept", "decode_rows", "prefill_tokens", "decode_kv_reads")


@dataclass(frozen=True, slots=True)
class StepFeatures:
    decode_rows: float = 0.0
    prefill_tokens: float = 0.0
    decode_context: float = 0.0  # mean context of the decode rows

    @property
    def vector(self) -> tuple[float, float, float, float]:
        return (1.0, self.decode_rows, self.prefill_tokens, self.decode_rows * self.decode_context)

    @property
    def num_tokens(self) -> float:
        return self.decode_rows + self.prefill_tokens


def step_features(out: SchedulerOutput) -> StepFeatures:
    """Features of a scheduled step, read before its results are applied: decode rows as the runner
    batches them (Request.decodes)."""
    rows = prefill = context = 0
    for request, n in out.scheduled:
        if request.decodes(n):
            rows += n
            context += n * request.num_computed_tokens + n * (n + 1) // 2
        else:
            prefill += n
    return StepFeatures(rows, prefill, context / rows if rows else 0.0)


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(rhs)
    a = [row[:] + [rhs[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            if f:
                for c in range(col, n + 1):
                    a[r][c] -= f * a[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][c] * x[c] for c in range(r + 1, n))) / a[r][r]
    return x


class StepTimeModel:
    def __init__(self, forgetting: float = 0.98, ridge: float = 1e-3, outlier_ratio: float = 2.0) -> None:
        if not 0.0 < forgetting <= 1.0:
            raise ValueError("forgetting must be in (0, 1]")
        n = len(FEATURES)
        self.forgetting = forgetting
        self.ridge = ridge
        self.outlier_ratio = outlier_ratio  # a sample above ratio x prediction is clipped to it
        self.gram = [[0.0] * n for _ in range(n)]
        self.moment = [0.0] * n
        self.weight = 0.0  # effective number of samples (1 / (1 - forgetting) at most)
        self.num_samples = 0
        self.coef = [0.0] * n

    @property
    def ready(self) -> bool:
        return self.num_samples >= 8

    def predict(self, features: StepFeatures) -> float:
        return sum(c * x for c, x in zip(self.coef, features.vector))

    def observe(self, features: StepFeatures, seconds: float) -> None:
        """Adds one measured step and refits."""
        if seconds < 0:
            raise ValueError("a step cannot take negative time")
        x = features.vector
        if self.ready:
            # One step slowed by something outside the engine (another process, a GC pause) must not
            # drag the fit; a lasting slowdown still gets in, clipped, and the fit follows it.
            seconds = min(seconds, self.outlier_ratio * max(self.predict(features), 1e-9))
        lam = self.forgetting
        for i, xi in enumerate(x):
            self.moment[i] = lam * self.moment[i] + xi * seconds
            row = self.gram[i]
            for j, xj in enumerate(x):
                row[j] = lam * row[j] + xi * xj
        self.weight = lam * self.weight + 1.0
        self.num_samples += 1
        self.coef = self._fit()

    def rescale(self, factor: float) -> None:
        """Every past step as if it had taken `factor` times as long (the fit scales with it)."""
        self.moment = [m * factor for m in self.moment]
        self.coef = [c * factor for c in self.coef]

    def _fit(self) -> list[float]:
        """Non-negative ridge least squares by active set: drop the most negative coefficient, refit."""
        n = len(FEATURES)
        free = list(range(n))
        while free:
            # No ridge on the intercept: when the data cannot tell a fixed cost from a per-row one
            # (every step at the same batch size), the fixed cost takes it, and the cap errs high,
            # where the next steps' measurements will show the truth; erring low would never learn.
            matrix = [[self.gram[i][j] + (self.ridge * max(self.gram[i][i], 1e-12) if i == j and i else 0.0)
                       for j in free] for i in free]
            solution = _solve(matrix, [self.moment[i] for i in free])
            if solution is None:
                break
            worst = min(range(len(free)), key=lambda k: solution[k])
            if solution[worst] >= 0.0:
                coef = [0.0] * n
                for k, i in enumerate(free):
                    coef[i] = solution[k]
                return coef
            free.pop(worst)
        return [0.0] * n

    def coefficients(self) -> dict[str, float]:
        return dict(zip(FEATURES, self.coef))


def fit_once(samples: Sequence[tuple[StepFeatures, float]], forgetting: float = 1.0) -> StepTimeModel:
    """A model fitted to a list of samples (tests, offline analysis)."""
    model = StepTimeModel(forgetting=forgetting)
    for features, seconds in samples:
        model.observe(features, seconds)
    return model
