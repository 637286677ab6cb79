"""Drive an in-process LLMEngine in real time over a workload, recording what a client would see.

Requests join the engine when their arrival time has passed (an idle engine sleeps until the next
arrival); the engine steps until everything has finished. Each request's arrival is its scheduled
time, so time spent queued behind a running step counts in its TTFT, as it would for a client.
Besides per-request timestamps it records one sample per iteration: how many requests ran, how
many batch slots were held (the static policy keeps finished members' slots until its batch
ends), tokens computed, waiting count and the step's duration.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from conveyor.bench.metrics import RequestRecord
from conveyor.bench.workloads import FIRST_REGULAR_ID, BenchRequest
from conveyor.engine.llm_engine import LLMEngine
from conveyor.errors import InvalidRequestError
from conveyor.request import RequestTimes
from conveyor.sampling.params import SamplingParams


@dataclass
class IterationSample:
    t: float  # end of the step, seconds since the run started
    duration: float  # the step's wall time
    running: int  # requests in the running batch during the step (computing)
    held: int  # batch slots held: = running for continuous; static counts finished members too
    waiting: int  # queued after the step
    num_tokens: int  # tokens computed in the step (prefill chunks + decodes)
    num_preempted: int
    model_s: float  # of which inside the model's forward
    # The SLO controller's state after the step (conveyor/control/); None without an SLO target.
    slo_batch_cap: int | None = None
    slo_token_budget: int | None = None
    slo_planned_step_s: float | None = None  # predicted mean step at the cap
    slo_predicted_step_s: float | None = None  # predicted for this step, before it ran
    slo_measured_step_s: float | None = None


@dataclass
class OfflineResult:
    records: list[RequestRecord]  # in workload order; times relative to the run's start
    trace: list[IterationSample]
    duration: float  # run start to the last request's last token
    max_num_seqs: int
    num_preemptions: int
    extra: dict[str, Any] = field(default_factory=dict)

    def trace_dict(self) -> dict[str, list]:
        """Column-wise trace, for JSON."""
        rows = [asdict(s) for s in self.trace]
        return {key: [row[key] for row in rows] for key in IterationSample.__dataclass_fields__}


def record_from_times(prompt_len: int, times: RequestTimes, origin: float = 0.0) -> RequestRecord:
    """A client-side record from the engine's timestamps (relative to `origin`)."""
    if times.first_token is None or not times.tokens:
        return RequestRecord(prompt_len, start=times.arrival - origin, success=False, error="no token produced")
    tokens = times.tokens
    end = times.finished if times.finished is not None else tokens[-1]
    return RequestRecord(
        prompt_len=prompt_len,
        output_len=len(tokens),
        start=times.arrival - origin,
        ttft=times.first_token - times.arrival,
        itl=np.diff(tokens).tolist(),
        latency=end - times.arrival,
    )


def _slo_fields(extra: dict[str, float]) -> dict[str, Any]:
    if "slo_batch_cap" not in extra:
        return {}
    return dict(slo_batch_cap=int(extra["slo_batch_cap"]), slo_token_budget=int(extra["slo_token_budget"]),
                slo_planned_step_s=extra["slo_planned_step_s"], slo_predicted_step_s=extra["slo_predicted_step_s"],
                slo_measured_step_s=extra["slo_measured_step_s"])


def _held_slots(engine: LLMEngine, running: int) -> int:
    batch_size = getattr(engine.scheduler, "batch_size", None)
    return running if batch_size is None else int(batch_size)


def run_offline(
    engine: LLMEngine,
    requests: Sequence[BenchRequest],
    arrivals: Sequence[float],
    *,
    sleep: Callable[[float], None] = time.sleep,
    progress: bool = False,
) -> OfflineResult:
    """Runs the workload to completion on `engine` (whose clock times everything)."""
    if len(arrivals) != len(requests):
        raise ValueError("one arrival time per request")
    clock = engine.clock
    bar = _progress_bar(len(requests)) if progress else None
    preempted_before = engine.scheduler.num_preemptions
    times: dict[str, RequestTimes] = {}
    rejected: dict[str, RequestRecord] = {}
    trace: list[IterationSample] = []
    start = clock()
    next_i = 0
    while next_i < len(requests) or engine.has_unfinished_requests:
        now = clock()
        while next_i < len(requests) and start + arrivals[next_i] <= now:
            req = requests[next_i]
            params = SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
            arrival = start + arrivals[next_i]
            try:
                engine.add_request(req.prompt_token_ids, params, request_id=str(next_i), arrival_time=arrival)
            except InvalidRequestError as exc:  # e.g. longer than the KV cache: a failed request, as a server's 400
                rejected[str(next_i)] = RequestRecord(req.prompt_len, start=arrival - start, success=False,
                                                      error=str(exc))
                if bar is not None:
                    bar.update(1)
            next_i += 1
        if not engine.has_unfinished_requests:
            if next_i < len(requests):
                sleep(max(0.0, start + arrivals[next_i] - clock()))
            continue
        t0 = clock()
        outputs = engine.step()
        t1 = clock()
        stats = engine.last_step
        if stats.num_requests == 0:
            if next_i >= len(requests):
                raise RuntimeError("the engine has unfinished requests but scheduled nothing")
            sleep(max(0.0, min(0.001, start + arrivals[next_i] - clock())))
            continue
        finished = [o for o in outputs if o.finished]
        for o in finished:
            times[o.request_id] = o.times  # type: ignore[assignment]
        running = engine.scheduler.num_running + len(finished)
        trace.append(IterationSample(
            t=t1 - start, duration=t1 - t0, running=running, held=_held_slots(engine, running),
            waiting=engine.scheduler.num_waiting, num_tokens=stats.num_tokens,
            num_preempted=stats.num_preempted, model_s=stats.model_s, **_slo_fields(stats.extra),
        ))
        if bar is not None and finished:
            bar.update(len(finished))
    if bar is not None:
        bar.close()
    records = [rejected.get(str(i)) or record_from_times(r.prompt_len, times[str(i)], start)
               for i, r in enumerate(requests)]
    duration = max((r.start + r.latency for r in records if r.success), default=clock() - start)
    return OfflineResult(
        records=records,
        trace=trace,
        duration=duration,
        max_num_seqs=engine.config.scheduler.max_num_seqs,
        num_preemptions=engine.scheduler.num_preemptions - preempted_before,
    )


def warm_up(engine: LLMEngine, prompt_len: int = 32, output_len: int = 4) -> None:
    """One small request through the engine, so first-call costs stay out of the measurement."""
    ids = [FIRST_REGULAR_ID + (7 * i) % (engine.vocab_size - FIRST_REGULAR_ID) for i in range(prompt_len)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.add_request(ids, params, request_id="warmup")
    while engine.has_unfinished_requests:
        engine.step()


def _progress_bar(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="req", leave=False)
