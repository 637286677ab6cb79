"""Several simulated engines on one virtual timeline: colocated replicas, or prefill/decode
disaggregation as conveyor/distributed runs it.

Each worker is a whole device (or tp group) of the described hardware with its own LLMEngine, KV
pool and SimRunner, so 1 prefill + 1 decode worker use twice the hardware of one colocated engine;
`--replicas 2` (two colocated engines) is the equal-hardware baseline. Work flows one way, so
disaggregation runs in two passes over the same clock origin:

1. Prefill workers. An arrival goes to the worker with the fewest outstanding tokens (the front
   end's rule, conveyor/distributed/router.py; ties: the worker free soonest, then the first). The
   request runs with its real max_tokens until its first token, then is detached with its blocks
   parked until the handover ends, as EngineWorker does (a one-token request just finishes there).
2. Decode workers. Each request arrives at first token + KV transfer time (its computed blocks'
   bytes / (tp x kv_transfer_bandwidth): each shard moves its slice over its own link), goes to the
   decode worker with the fewest outstanding tokens, waits in its import queue until the blocks fit
   (Scheduler.import_fits, the Ray workers' rule), takes its own blocks from that worker's
   scheduler (the leading ones its prefix cache holds shared, as on Ray) and enters
   through LLMEngine.add_prefilled_request: prompt computed, first token known. The transfer time
   counts every block: the prefill pass runs before the decode workers' caches exist, so the
   blocks a Ray handover leaves out (those the decode worker holds) are not known then.

A client's record joins the two: TTFT from the prefill worker, later tokens from the decode worker,
so the first inter-token gap carries the transfer and any wait for the decode worker.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from conveyor.bench.metrics import RequestRecord, compute_metrics
from conveyor.bench.offline import IterationSample, OfflineResult, record_from_times, require_served
from conveyor.bench.results import RunResult
from conveyor.bench.workloads import BenchRequest, arrival_times, generate_requests, parse_rate_schedule
from conveyor.config import EngineConfig
from conveyor.engine.kv_imports import ImportQueue
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.outputs import RequestOutput
from conveyor.errors import ConfigError, InvalidRequestError
from conveyor.kv import SequenceKey, blocks_for, leading_null_blocks
from conveyor.request import Request, RequestStatus, RequestTimes
from conveyor.sampling.params import SamplingParams
from conveyor.sim.config import SimConfig, SimRun, build_cost_model, kv_pools, max_model_len, policy_label
from conveyor.sim.runner import SimProposer, SimRunner, VirtualClock


@dataclass(eq=False)
class SimImport:
    """A handed-over request as a decode lane takes it in: no KV moves, but where the exporter's
    sliding-window layers had given back their blocks, as a payload's window_held_from says."""

    request: Request
    window_held_from: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_computed_tokens(self) -> int:
        return self.request.num_computed_tokens

    @property
    def sequence_key(self) -> SequenceKey:
        return self.request.sequence_key


@dataclass(eq=False)
class Lane:
    """One simulated worker: an engine on its own clock (all clocks share the origin 0)."""

    name: str
    engine: LLMEngine
    runner: SimRunner
    trace: list[IterationSample] = field(default_factory=list)
    imports: ImportQueue[SimImport] = field(default_factory=ImportQueue)  # decode: handed over, waiting for blocks
    parked: list[tuple[float, str]] = field(default_factory=list)  # prefill: (handover end, request id)
    num_requests: int = 0

    @property
    def clock(self) -> VirtualClock:
        return self.runner.clock

    @property
    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests or bool(self.imports)

    def outstanding_tokens(self) -> int:
        """router.py's load: prompt tokens still short of a first token, plus one per decoding request."""
        load = len(self.imports)
        for r in self.engine.scheduler.requests.values():
            load += 1 if r.output_token_ids else r.num_prompt_tokens - r.num_computed_tokens
        return load

    def release_parked(self, until: float = math.inf) -> None:
        keep = []
        for release, request_id in self.parked:
            if release <= until:
                self.engine.scheduler.release_handover(request_id)
            else:
                keep.append((release, request_id))
        self.parked = keep


def take_imports(lane: Lane) -> None:
    engine = lane.engine

    def admit(item: SimImport, cached: list[int]) -> None:
        # The prefill worker validated the same limits.
        engine.add_prefilled_request(item.request, cached, window_held_from=item.window_held_from)

    def refuse(item: SimImport, error: InvalidRequestError) -> None:
        raise error  # both sides share one engine configuration: this cannot happen

    lane.imports.take(engine, admit, refuse)


OnOutputs = Callable[[Lane, list[RequestOutput]], None]


def step(lane: Lane, next_arrival: float, on_outputs: OnOutputs) -> None:
    lane.release_parked(lane.clock.now)
    take_imports(lane)
    t0 = lane.clock.now
    outputs = lane.engine.step()
    stats = lane.engine.last_step
    if stats.num_requests == 0:  # e.g. blocks held by parked handovers: wait a little, as run_offline
        if not lane.parked and math.isinf(next_arrival):
            raise RuntimeError(f"{lane.name} has unfinished requests but scheduled nothing")
        lane.clock.advance(min([0.001, next_arrival - t0] + [r - t0 for r, _ in lane.parked if r > t0]))
        return
    on_outputs(lane, outputs)
    scheduler = lane.engine.scheduler
    lane.trace.append(IterationSample(
        t=lane.clock.now, duration=lane.clock.now - t0, running=stats.num_requests, held=stats.num_requests,
        waiting=scheduler.num_waiting + len(lane.imports), num_tokens=stats.num_tokens,
        num_preempted=stats.num_preempted, model_s=stats.model_s,
    ))


def drive(lanes: list[Lane], arrivals: list[tuple[float, int]], admit: Callable[[Lane, float, int], None],
          on_outputs: OnOutputs) -> None:
    """Discrete events over all lanes: step the lane that is furthest behind until every lane with
    work has reached the next arrival, then route that arrival. A lane whose step straddles the
    arrival is seen as it will be after that step (a step is the router's resolution)."""
    i = 0
    while True:
        t_next = arrivals[i][0] if i < len(arrivals) else math.inf
        busy = [lane for lane in lanes if lane.has_work]
        behind = min(busy, key=lambda lane: lane.clock.now, default=None)
        if behind is not None and behind.clock.now < t_next:
            step(behind, t_next, on_outputs)
            continue
        if i == len(arrivals):
            return
        for lane in lanes:
            if not lane.has_work and lane.clock.now < t_next:  # idle until now: its next step starts here
                lane.clock.advance(t_next - lane.clock.now)
        target = min(lanes, key=lambda lane: (lane.outstanding_tokens(), lane.clock.now))  # first on ties
        target.num_requests += 1
        admit(target, t_next, arrivals[i][1])
        i += 1


@dataclass
class Handover:
    record_times: dict[int, RequestTimes] = field(default_factory=dict)  # prefill side: arrival, first token
    decode_times: dict[int, RequestTimes] = field(default_factory=dict)
    pending: list[tuple[float, int]] = field(default_factory=list)  # (decode arrival, request index)
    requests: dict[int, SimImport] = field(default_factory=dict)  # as the decode worker will import them
    bytes: int = 0
    seconds: float = 0.0


def run_deployment(cfg: SimConfig, requests: list[BenchRequest] | None = None) -> SimRun:
    wall0 = time.perf_counter()
    disagg = bool(cfg.prefill_workers or cfg.decode_workers)
    if disagg and (cfg.prefill_workers < 1 or cfg.decode_workers < 1 or cfg.replicas != 1):
        raise ConfigError("disaggregation needs --prefill-workers >= 1 and --decode-workers >= 1, without --replicas")
    if cfg.replicas < 1:
        raise ConfigError("--replicas must be at least 1")
    cost_model, model, hardware = build_cost_model(cfg)
    engine_config = EngineConfig.from_kwargs(**cfg.engine)
    if disagg and engine_config.scheduler.policy == "static":
        raise ConfigError("disaggregation hands requests between continuous-batching engines: use --policy continuous")
    blocks, window = kv_pools(cfg, model, hardware, engine_config)
    if requests is None:
        cfg.workload.vocab_size = model.vocab_size
        requests = generate_requests(cfg.workload)
    if any(r.follows is not None for r in requests):
        raise ConfigError("conversations (the multi-turn workload) run on one simulated engine, not a deployment")
    schedule = parse_rate_schedule(cfg.rate_schedule) if cfg.rate_schedule else None
    arrivals = arrival_times(len(requests), cfg.request_rate, cfg.burstiness, cfg.workload.seed, schedule)
    max_len, block_size = max_model_len(cfg, model), engine_config.block_size

    def lanes(role: str, n: int) -> list[Lane]:  # each its own engine, KV pool and clock; one cost model
        runners = [SimRunner(cost_model, VirtualClock(), cfg.spec_acceptance, cfg.workload.seed + k,
                             model.sliding_window, window) for k in range(n)]
        return [Lane(f"{role}{k}", LLMEngine(engine_config, r, num_kv_blocks=blocks, max_model_len=max_len,
                                             vocab_size=model.vocab_size, clock=r.clock, proposer=SimProposer()), r)
                for k, r in enumerate(runners)]

    ho = Handover()
    rejected: dict[int, RequestRecord] = {}
    bandwidth = cfg.kv_transfer_bandwidth or (hardware.kv_transfer_bandwidth if hardware else 10e9)

    def admit(lane: Lane, t: float, i: int) -> None:
        params = SamplingParams(max_tokens=requests[i].output_len, temperature=0.0, ignore_eos=True)
        try:
            lane.engine.add_request(requests[i].prompt_token_ids, params, request_id=str(i), arrival_time=t)
        except InvalidRequestError as exc:  # as run_offline: a failed request, like a server's 400
            rejected[i] = RequestRecord(requests[i].prompt_len, start=t, success=False, error=str(exc))

    def first_tokens(lane: Lane, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            i = int(out.request_id)
            ho.record_times[i] = out.times  # type: ignore[assignment]
            if out.finished or not disagg:  # done here (a one-token request, or a colocated engine)
                continue
            request = lane.engine.detach_request(out.request_id)
            assert request is not None and out.times is not None and out.times.first_token is not None
            # Whole blocks move, as export_request reads them (of the sliding-window layers only those
            # still held); the tp shards move their slices in parallel.
            num_blocks = blocks_for(request.num_computed_tokens, block_size)
            given_back = leading_null_blocks(lane.engine.scheduler.handover_window_blocks(request))
            nbytes = block_size * (num_blocks * model.kv_bytes_per_token - given_back * model.window_kv_bytes_per_token)
            seconds = nbytes / (bandwidth * cfg.tp)
            ho.bytes, ho.seconds = ho.bytes + nbytes, ho.seconds + seconds
            release = out.times.first_token + seconds
            lane.parked.append((release, out.request_id))  # the prefill side frees them once the copy lands
            moved = Request(request.request_id, request.prompt_token_ids, request.sampling_params, release)
            moved.output_token_ids = list(request.output_token_ids)
            moved.num_computed_tokens, moved.status = request.num_computed_tokens, RequestStatus.WAITING
            moved.times.first_token = moved.times.first_scheduled = release  # as import_request
            ho.requests[i] = SimImport(moved, given_back)
            ho.pending.append((release, i))

    def decoded(lane: Lane, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                ho.decode_times[int(out.request_id)] = out.times  # type: ignore[assignment]

    def hand_in(lane: Lane, t: float, i: int) -> None:
        lane.imports.push(ho.requests[i])

    first = lanes("prefill" if disagg else "replica", cfg.prefill_workers if disagg else cfg.replicas)
    drive(first, [(float(t), i) for i, t in enumerate(arrivals)], admit, first_tokens)
    for lane in first:
        lane.release_parked()  # every handover has landed by the end of virtual time
    second = lanes("decode", cfg.decode_workers) if disagg else []
    drive(second, sorted(ho.pending), hand_in, decoded)
    workers = first + second

    records = [rejected.get(i) or _record(r.prompt_len, ho.record_times[i], ho.decode_times.get(i))
               for i, r in enumerate(requests)]
    duration = max((r.start + r.latency for r in records if r.success), default=0.0)
    label = policy_label(engine_config)
    label = f"{cfg.prefill_workers}P+{cfg.decode_workers}D {label}" if disagg else f"{cfg.replicas}x {label}"
    handovers = len(ho.pending)
    offline = OfflineResult(
        records=records, trace=sorted((s for w in workers for s in w.trace), key=lambda s: s.t), duration=duration,
        max_num_seqs=engine_config.scheduler.max_num_seqs,
        num_preemptions=sum(w.engine.scheduler.num_preemptions for w in workers),
        extra={"deployment": label, "devices": len(workers) * cfg.tp, "handovers": handovers,
               "kv_transfer_bytes": ho.bytes, "kv_transfer_ms_mean": 1e3 * ho.seconds / max(1, handovers),
               "kv_transfer_gbs": bandwidth / 1e9,
               "workers": [{"name": w.name, "requests": w.num_requests, "steps": w.runner.num_steps,
                            "busy_s": w.runner.busy_s} for w in workers]},
    )
    require_served(records)
    metrics = compute_metrics(records, duration, cfg.percentiles, cfg.goodput or None)
    result = RunResult(label, cfg.request_rate, dict(cfg.engine), offline, metrics)
    return SimRun(result, time.perf_counter() - wall0, sum(w.runner.num_steps for w in workers), blocks,
                           cost_model.describe(), workers, window)


def _record(prompt_len: int, prefill: RequestTimes, decode: RequestTimes | None) -> RequestRecord:
    """One client-side record: the first token from the prefill worker, the rest from the decode one."""
    if decode is None:
        return record_from_times(prompt_len, prefill)
    joined = RequestTimes(prefill.arrival, prefill.first_scheduled, prefill.first_token,
                          [*prefill.tokens, *decode.tokens], decode.finished)
    return record_from_times(prompt_len, joined)
