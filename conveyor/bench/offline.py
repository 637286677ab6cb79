"""Drive an in-process LLMEngine in real time over a workload, recording what a client would see.

Requests join the engine when their arrival time has passed (an idle engine sleeps until the next
arrival); the engine steps until everything has finished. Each request's arrival is its scheduled
time, so time spent queued behind a running step counts in its TTFT, as it would for a client.
Besides per-request timestamps it records one sample per iteration: how many requests ran, how
many batch slots were held (the static policy keeps finished members' slots until its batch
ends), tokens computed, waiting count and the step's duration.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from conveyor.bench.metrics import RequestRecord, prefix_reuse
from conveyor.bench.workloads import BenchRequest, followers, next_turn_prompt
from conveyor.engine.llm_engine import LLMEngine
from conveyor.errors import ConfigError, InvalidRequestError
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
    queries_before, hits_before = engine.scheduler.prefix_cache_queries, engine.scheduler.prefix_cache_hits
    times: dict[str, RequestTimes] = {}
    rejected: dict[str, RequestRecord] = {}
    trace: list[IterationSample] = []
    start = clock()
    # (send time, index): first turns at their arrival; a later turn once its predecessor finished.
    due = [(arrivals[i], i) for i, r in enumerate(requests) if r.follows is None]
    heapq.heapify(due)
    released_by = followers(list(requests))
    prompts = {i: r.prompt_token_ids for i, r in enumerate(requests) if r.follows is None}
    cached: dict[str, int] = {}
    sent = 0

    def release(index: int, output: list[int], at: float) -> None:
        for k in released_by.get(index, []):
            prompts[k] = next_turn_prompt(prompts[index], output, requests[k])
            heapq.heappush(due, (at - start + requests[k].think_time, k))

    while sent < len(requests) or engine.has_unfinished_requests:
        now = clock()
        while due and start + due[0][0] <= now:
            at, i = heapq.heappop(due)
            req, sent = requests[i], sent + 1
            params = SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
            arrival = start + at
            try:
                engine.add_request(prompts[i], params, request_id=str(i), arrival_time=arrival)
            except InvalidRequestError as exc:  # e.g. longer than the KV cache: a failed request, as a server's 400
                rejected[str(i)] = RequestRecord(len(prompts[i]), start=arrival - start, success=False, error=str(exc))
                release(i, [], arrival)
                if bar is not None:
                    bar.update(1)
        if not engine.has_unfinished_requests:
            if due:
                sleep(max(0.0, start + due[0][0] - clock()))
            elif sent < len(requests):
                raise RuntimeError("requests wait for a turn that never ran")
            continue
        t0 = clock()
        outputs = engine.step()
        t1 = clock()
        stats = engine.last_step
        if stats.num_requests == 0:
            if not due:
                raise RuntimeError("the engine has unfinished requests but scheduled nothing")
            sleep(max(0.0, min(0.001, start + due[0][0] - clock())))
            continue
        finished = [o for o in outputs if o.finished]
        for o in finished:
            times[o.request_id] = o.times  # type: ignore[assignment]
            cached[o.request_id] = o.num_cached_tokens
            release(int(o.request_id), list(o.token_ids), t1)
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
    records = [rejected.get(str(i)) or record_from_times(len(prompts[i]), times[str(i)], start)
               for i in range(len(requests))]
    for i, record in enumerate(records):
        record.cached_tokens = cached.get(str(i))
    require_served(records)
    duration = max((r.start + r.latency for r in records if r.success), default=clock() - start)
    return OfflineResult(
        records=records,
        trace=trace,
        duration=duration,
        max_num_seqs=engine.config.scheduler.max_num_seqs,
        num_preemptions=engine.scheduler.num_preemptions - preempted_before,
        extra={**prefix_reuse(requests, records),
               "prefix_cache_hit_rate": hit_rate(engine.scheduler.prefix_cache_queries - queries_before,
                                                 engine.scheduler.prefix_cache_hits - hits_before)},
    )


def require_served(records: Sequence[RequestRecord]) -> None:
    """A run whose every request was refused measures nothing: say why instead of a table of zeros."""
    if records and not any(r.success for r in records):
        raise ConfigError(f"every one of the {len(records)} requests was refused; the first: {records[0].error}")


def hit_rate(queries: int, hits: int) -> float:
    """Over every lookup of the prefix cache (a preempted request's restart looks up again)."""
    return hits / queries if queries else 0.0


def _progress_bar(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="req", leave=False)
