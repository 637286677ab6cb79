"""SLO controller: the running-batch cap and the per-step token budget that hold a TPOT target at the
highest throughput it allows (pure Python, no torch; time comes from the engine's clock, so the
simulator runs it on virtual time unchanged).

Why a model and not only feedback: a request's TPOT is the mean of the steps it lived through, and
a step's time is nearly linear in what it holds (conveyor/control/step_model.py). So the cap can be
*computed*: in a steady state each admitted request brings its prompt, so a step of B decode rows
also carries about B x r prefill tokens, r = prefill tokens per decode token measured over recent
steps (Little's law: prompts arrive as fast as outputs finish). The mean step at cap B is then

    a + B x (b + c x r + d x mean_context)

and the cap is the largest B whose prediction stays under the step target, `a + gain x (TPOT
target - a)`: the margin applies to the headroom above the empty-batch step `a`, so a target a
few % above it (a GPU far below its roofline knee) still leaves room. The budget bounds the worst
step instead of the mean: B decode rows plus a prefill chunk may reach `spike_tolerance` x the step
target (a chunk lands on one step, TPOT averages it over a request's life), and never drops under
B + `min_prefill_chunk`, so prompts keep flowing.

Three corrections close the loop:
- `bias`: a fast running ratio of measured to predicted step time. A machine that slows down (or
  a neighbour that takes the cores) lowers the cap within ~10 steps; once the bias is off by 10%
  it is folded into the model by rescaling its history (which keeps the slope it has learnt,
  where a refit on new data at one batch size would not).
- probing: a full batch (someone waiting) whose steps come in well under the target means the
  model overrates a row's cost (it saw too few batch sizes): the cap goes up by one to find out.
- `gain`, a slow loop on the TPOT of finished requests (conveyor/control/feedback.py): it catches
  what step times miss (time between steps, P99 over requests sitting above the mean step).

Safety: the cap never exceeds the configured max_num_seqs nor what the KV cache holds (its tokens
over the mean `prompt + max_tokens` of recent requests) and never falls under 1; it rises by at
most `growth` per step (the model is never trusted far beyond what it has seen) and falls at once.
Lowering it preempts nobody: the scheduler admits no one until the batch shrinks under it. A TTFT
target is watched, not enforced: misses are counted and the oldest request's queue wait is
published; no request is ever dropped.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

from conveyor.config import SchedulerConfig
from conveyor.control.feedback import FeedbackConfig, TpotFeedback
from conveyor.control.step_model import StepFeatures, StepTimeModel, step_features
from conveyor.request import Request
from conveyor.scheduler import Scheduler, SchedulerOutput


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000.0


@dataclass
class ControllerConfig:
    tpot_target_s: float | None
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill: bool = True
    ttft_target_s: float | None = None
    kv_capacity_tokens: int | None = None  # KV blocks x block size
    initial_cap: int = 4
    initial_budget: int = 256
    growth: float = 1.25
    spike_tolerance: float = 1.3
    min_prefill_chunk: int = 32
    forgetting: float = 0.995  # of the step model: ~200 steps of memory (the bias follows fast changes)
    stats_forgetting: float = 0.99  # of the load statistics (context, prefill ratio, request size)
    bias_rate: float = 0.15
    bias_absorb: float = 0.1
    hysteresis: float = 0.03
    probe: float = 0.25  # of the headroom: a full batch this far under the step target probes one more
    feedback: FeedbackConfig = field(default_factory=FeedbackConfig)


@dataclass(frozen=True)
class SloState:
    """What the controller decided after the last step (published in /metrics and the bench trace)."""

    batch_cap: int
    token_budget: int
    step_target_s: float  # what the mean step is aimed at: floor + gain x (TPOT target - floor)
    planned_step_s: float  # predicted mean step at the cap, under the current load
    predicted_step_s: float  # the model's prediction for the last step, made before it ran
    measured_step_s: float  # the last step, as the engine's clock measured it
    gain: float
    bias: float
    kv_seq_limit: int
    queue_wait_s: float  # how long the oldest waiting request has waited
    ttft_misses: int  # requests whose first token came later than the TTFT target
    tpot_quantile_s: float  # the feedback's last view of recent TPOT (its quantile)

    def as_extra(self) -> dict[str, float]:
        return {f"slo_{k}": float(v) for k, v in asdict(self).items()}


class SloController:
    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.model = StepTimeModel(config.forgetting)
        self.feedback = TpotFeedback(config.tpot_target_s or 1.0, config.feedback)
        self.cap = max(1, min(config.initial_cap, config.max_num_seqs))
        self.budget = self._clamp_budget(max(config.initial_budget, self.cap + config.min_prefill_chunk))
        self.bias = 1.0
        self.ttft_misses = 0
        self._features = StepFeatures()
        self._predicted = self._measured = self._planned = self._queue_wait = 0.0
        self._step_target = self.feedback.gain * (config.tpot_target_s or 0.0)
        self._measured_ew = 0.0
        self._saturated = False
        self._context = 0.0  # EW mean of the decode rows' mean context per step
        self._prefill_sum = self._decode_sum = 0.0  # EW sums, for prefill tokens per decode token
        self._request_tokens = 0.0  # EW mean of prompt + max_tokens of admitted requests
        self._lived: dict[str, list[int]] = {}  # request id -> [steps, steps with someone waiting]
        self._num_steps = 0

    @classmethod
    def from_scheduler_config(cls, sched: SchedulerConfig, kv_capacity_tokens: int | None) -> "SloController | None":
        """None when no SLO target is set."""
        if sched.slo_tpot_ms is None and sched.slo_ttft_ms is None:
            return None
        return cls(ControllerConfig(
            tpot_target_s=_seconds(sched.slo_tpot_ms), ttft_target_s=_seconds(sched.slo_ttft_ms),
            max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
            chunked_prefill=sched.chunked_prefill, kv_capacity_tokens=kv_capacity_tokens,
        ))

    # --- engine hooks, in step order ----------------------------------------------------------------
    def before_schedule(self, scheduler: Scheduler, now: float) -> None:
        self._queue_wait = now - scheduler.waiting[0].arrival_time if scheduler.waiting else 0.0
        if self.config.tpot_target_s is not None:
            scheduler.set_limits(self.cap, self.budget if self.config.chunked_prefill else None)

    def on_scheduled(self, out: SchedulerOutput, scheduler: Scheduler) -> None:
        features = self._features = step_features(out)
        self._predicted = self.model.predict(features) * self.bias if self.model.ready else 0.0
        self._saturated = scheduler.num_waiting > 0
        saturated = int(self._saturated)
        lam = self.config.stats_forgetting
        for request, _ in out.scheduled:
            lived = self._lived.setdefault(request.request_id, [0, 0])
            lived[0] += 1
            lived[1] += saturated
            if request.num_computed_tokens == 0:
                self._request_tokens = self._ew(self._request_tokens, request.max_total_tokens)
        if features.decode_rows:
            self._context = self._ew(self._context, features.decode_context)
        self._prefill_sum = lam * self._prefill_sum + features.prefill_tokens
        self._decode_sum = lam * self._decode_sum + features.decode_rows

    def after_step(self, seconds: float, sampled: Sequence[Request], finished: Sequence[Request],
                   scheduler: Scheduler) -> None:
        """`seconds`: the step's duration on the engine's clock; `sampled`: requests that got a token."""
        self._measured = seconds
        self._measured_ew = seconds if self._measured_ew == 0 else self._measured_ew + 0.2 * (seconds - self._measured_ew)
        if self._predicted > 0:
            error = min(1.6, max(0.6, seconds / self._predicted))  # one stray step moves it little
            self.bias += self.config.bias_rate * (error * self.bias - self.bias)
            if abs(self.bias - 1.0) > self.config.bias_absorb:
                # A lasting miss: take it as the whole machine getting slower or faster, so rescale the
                # model's history instead of refitting it on new data alone (which, at one batch size,
                # would keep the level and lose the slope).
                self.model.rescale(self.bias)
                self.bias = 1.0
        self.model.observe(self._features, seconds)
        ttft = self.config.ttft_target_s
        for request in sampled:
            t = request.times
            if ttft is not None and request.sample_index == 0 and len(request.output_token_ids) == 1 \
                    and t.first_token is not None and t.first_token - t.arrival > ttft:
                self.ttft_misses += 1
        for request in finished:
            lived = self._lived.pop(request.request_id, None)
            t = request.times
            if lived and len(request.output_token_ids) > 1 and t.finished is not None and t.first_token is not None:
                tpot = (t.finished - t.first_token) / (len(request.output_token_ids) - 1)
                self.feedback.observe(tpot, lived[1] / lived[0])
        self._num_steps += 1
        if self._num_steps % 512 == 0:  # aborted requests never finish here: forget them
            self._lived = {k: v for k, v in self._lived.items() if k in scheduler.requests}
        self._plan(scheduler.num_running)

    # --- decisions ----------------------------------------------------------------------------------
    def _plan(self, running: int) -> None:
        c = self.config
        if c.tpot_target_s is None:
            return
        limit = self.kv_seq_limit
        if self.model.ready:
            a, b, p, d = self.model.coef
            floor_s = a * self.bias  # the step of an empty batch: no cap can go under it
            # The margin applies to the headroom above that floor, not to the whole target: with a
            # target a few % over the floor (a GPU far below its knee) a margin on the whole would
            # leave no room at all.
            self._step_target = floor_s + self.feedback.gain * max(0.0, c.tpot_target_s - floor_s)
            per_row = b + p * self.prefill_per_decode + d * self._context
            room = self._step_target / self.bias - a
            cap = limit if per_row <= 0 else math.floor(room / per_row)
            if cap < self.cap and (a + self.cap * per_row) * self.bias <= self._step_target * (1 + c.hysteresis):
                cap = self.cap  # a hair over the target: hold, or noise would make the cap flicker
            headroom = self._step_target - floor_s
            if self._saturated and running >= self.cap and self._measured_ew < self._step_target - c.probe * headroom:
                # A full batch whose steps come in well under the target: the model overrates the cost
                # of a row (it has seen too few batch sizes). Try one more; its steps will tell.
                cap = max(cap, self.cap + 1)
            self._planned = (a + max(1, min(cap, limit)) * per_row) * self.bias
        else:
            cap = self.cap
        cap = min(cap, math.floor(self.cap * c.growth) + 1)  # rise gradually, fall at once
        self.cap = max(1, min(limit, cap))
        if self.model.ready and c.chunked_prefill:
            a, b, p, d = self.model.coef
            rows = max(self.cap, running)
            spike_room = c.spike_tolerance * self._step_target / self.bias - a - rows * (b + d * self._context)
            prefill = c.max_num_batched_tokens if p <= 0 else math.floor(spike_room / p)
            budget = rows + max(c.min_prefill_chunk, prefill)
            budget = min(budget, math.floor(self.budget * c.growth) + c.min_prefill_chunk)
            self.budget = self._clamp_budget(max(budget, rows + c.min_prefill_chunk))

    def _clamp_budget(self, budget: int) -> int:
        return max(1, min(self.config.max_num_batched_tokens, budget))

    def _ew(self, mean: float, value: float) -> float:
        return value if mean == 0.0 else mean + (1.0 - self.config.stats_forgetting) * (value - mean)

    @property
    def prefill_per_decode(self) -> float:
        return self._prefill_sum / self._decode_sum if self._decode_sum >= 1.0 else 0.0

    @property
    def kv_seq_limit(self) -> int:
        """Requests of the recent mean size that the KV cache holds at once (at most max_num_seqs)."""
        c = self.config
        if not c.kv_capacity_tokens or self._request_tokens <= 0:
            return c.max_num_seqs
        return max(1, min(c.max_num_seqs, int(c.kv_capacity_tokens // self._request_tokens)))

    @property
    def state(self) -> SloState:
        target = self.config.tpot_target_s
        return SloState(
            batch_cap=self.cap if target is not None else self.config.max_num_seqs,
            token_budget=self.budget if target is not None and self.config.chunked_prefill
            else self.config.max_num_batched_tokens,
            step_target_s=self._step_target,
            planned_step_s=self._planned, predicted_step_s=self._predicted, measured_step_s=self._measured,
            gain=self.feedback.gain, bias=self.bias, kv_seq_limit=self.kv_seq_limit,
            queue_wait_s=self._queue_wait, ttft_misses=self.ttft_misses,
            tpot_quantile_s=self.feedback.last_quantile_s,
        )
