"""RayEngineClient: the front end's side of a Ray deployment, a drop-in for AsyncEngine.

It keeps a table of the requests in flight (which worker holds each, what has been streamed),
routes new ones with the router, long-polls every worker for outputs, orchestrates the KV
handover of disaggregated requests (prefill worker -> object store -> decode worker), and
turns a worker's death into a retry (nothing streamed yet, first death) or a clear error.
Everything here runs on the front end's event loop; Ray object refs are awaited, never blocked on.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any, Callable, Sequence

from conveyor.distributed.messages import (
    HandoverReady,
    KVImported,
    PollResult,
    RequestError,
    TokenEvent,
)
from conveyor.distributed.router import ROUTING_POLICIES, Router, WorkerHandle, pick
from conveyor.distributed.stats import ClusterStats, WorkerTotals, step_stats, summarize
from conveyor.distributed.tracking import TrackedRequest
from conveyor.engine.async_engine import Aborted, Failed, StepReport
from conveyor.engine.outputs import RequestOutput
from conveyor.errors import (
    ConveyorError,
    EngineStoppedError,
    InvalidRequestError,
    QueueFullError,
    WorkerDiedError,
)
from conveyor.model.facts import ModelFacts
from conveyor.sampling.params import SamplingParams
from conveyor.sampling.pooling import PoolingParams

log = logging.getLogger("conveyor.distributed")
POLL_TIMEOUT_S = 1.0
MAX_ATTEMPTS = 2  # a request whose worker died before it streamed anything is retried once


async def _answer(call: Any) -> Any:
    """Await a remote call's answer (an ObjectRef is awaitable, not a coroutine)."""
    return await call


def _abort_when_added(worker: WorkerHandle, request_id: str, added: asyncio.Future) -> None:
    if not added.cancelled() and added.exception() is None:  # a refused add placed nothing to abort
        worker.tell("abort", request_id)


class RayEngineClient:
    def __init__(self, workers: Sequence[WorkerHandle], tokenizer: Any, max_waiting_requests: int | None = None,
                 on_stop: Callable[[], None] | None = None, routing: str = ROUTING_POLICIES[0]) -> None:
        self.workers = list(workers)
        self.router = Router(routing)
        self._tokenizer = tokenizer
        self.max_waiting_requests = max_waiting_requests
        self.on_report: Callable[[StepReport], None] | None = None
        self.on_stop = on_stop
        self.cluster = ClusterStats()
        self.disaggregated = any(w.role == "prefill" for w in self.workers)
        self._tracked: dict[str, TrackedRequest] = {}
        self._slo_misses: dict[str, float] = {}  # worker name -> its SLO controller's TTFT misses so far
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False
        self._started = False

    # --- EngineClient ---------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return min(w.info.max_model_len for w in self.workers)

    @property
    def capacity(self) -> int:
        return min(min(w.info.max_model_len, w.info.num_kv_blocks * w.info.block_size) for w in self.workers)

    @property
    def default_pooling(self) -> PoolingParams:
        return self.workers[0].info.default_pooling  # one model, one configuration on every worker

    @property
    def embedding_size(self) -> int | None:
        return self.workers[0].info.embedding_size

    @property
    def model_facts(self) -> ModelFacts | None:
        return self.workers[0].info.model_facts

    @property
    def is_running(self) -> bool:
        roles = ("prefill", "decode") if self.disaggregated else ("replica",)
        alive = {w.role for w in self.workers if w.alive}
        return self._started and not self._stopping and all(r in alive for r in roles)

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._started = True
        for worker in self.workers:
            self._spawn(self._poll_forever(worker))

    def stop(self, timeout: float = 10.0) -> None:
        import ray

        self.detach()
        for worker in self.workers:
            try:
                ray.kill(worker.actor)
            except Exception:  # already gone
                pass
        if self.on_stop is not None:
            self.on_stop()

    def detach(self) -> None:
        """Stop polling and fail what is in flight, but leave the workers running (they can serve
        another client: tests reuse one deployment across event loops)."""
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        for t in list(self._tracked.values()):
            # Abort on the worker too: a prefill worker would otherwise keep a parked request's
            # blocks for good, and a worker of another client would run it for nobody.
            t.aborted = True
            if t.worker is not None:
                t.worker.tell("abort", t.request_id)
            self._fail(t, EngineStoppedError("the server is shutting down"))

    def _free_seats(self) -> int:
        """Running seats free on the live workers that take new requests, at their last report:
        requests about to fill them are not waiting for a slot."""
        entry = "prefill" if self.disaggregated else "replica"
        return sum(max(0, w.info.max_num_seqs - (w.last_load.num_running if w.last_load else 0))
                   for w in self.workers if w.alive and w.role == entry and w.info is not None)

    def placement(self, request_id: str) -> str | None:
        """The name of the worker holding the request now (None once it is done)."""
        t = self._tracked.get(request_id)
        return t.worker.name if t is not None and t.worker is not None else None

    async def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                          sink: asyncio.Queue, arrival_time: float | None = None) -> None:
        if not self.is_running:
            raise EngineStoppedError("the engine is not running")
        if request_id in self._tracked:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        bound = self.max_waiting_requests
        if bound is not None and sum(1 for t in self._tracked.values() if not t.streamed) - self._free_seats() >= bound:
            raise QueueFullError(f"the waiting queue is full ({bound} requests); retry later")
        ids = self._tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        role = "replica" if not self.disaggregated else ("prefill" if params.n == 1 else "decode")
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        t = TrackedRequest(request_id, ids, params, sink, arrival, role, unfinished=params.n)
        self._tracked[request_id] = t
        try:
            await self._submit(t)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            self._tracked.pop(request_id, None)
            raise
        self._report(StepReport(0, 0, 0.0, 0, None, num_prompt_tokens=len(ids)))

    def abort(self, request_id: str) -> None:
        t = self._tracked.pop(request_id, None)
        if t is None:
            return
        t.aborted = True
        t.sink.put_nowait(Aborted(request_id))
        self._report(StepReport(0, 0, 0.0, 0, None, num_aborted=1))
        # Mid-handover the handover task aborts it on the decode side once that side has it.
        if t.worker is not None and not (t.busy and t.streamed):
            t.worker.tell("abort", request_id)

    def abort_all(self) -> None:
        for request_id in list(self._tracked):
            self.abort(request_id)

    def stop_sample(self, request_id: str, index: int, stop_reason: str | None = None) -> None:
        """A stop string ended the output: a single-sample request is aborted on its worker (its KV
        freed at once; the metrics count it as aborted). A sample of n > 1 runs on to its own end,
        its text already cut by the front end: the workers end requests, not samples."""
        t = self._tracked.get(request_id)
        if t is not None and t.params.n == 1:
            self.abort(request_id)

    # --- submission, handover, faults -----------------------------------------------------------
    async def _submit(self, t: TrackedRequest) -> None:
        """Place the request on a live worker of its role, trying another if that one is dead."""
        import ray

        t.busy = True
        try:
            while not t.aborted:  # an abort (or a detach) ends the retries: nobody waits for it
                route = self.router.route(self.workers, t.role, self._tracked.values(), t.prompt, t.params)
                if route is None:
                    raise EngineStoppedError(f"no live {t.role} worker")
                worker = route.worker
                t.worker, t.attempts, t.expected_cached_tokens = worker, t.attempts + 1, route.expected_cached_tokens
                # Its own task: cancelling the submission (the client went away) leaves the add in
                # flight to the worker, which would then run it for nobody unless told once it lands
                # (an async actor runs an abort sent now before or after the add, in no set order).
                added = asyncio.ensure_future(_answer(worker.actor.add.remote(t.request_id, t.prompt, t.params,
                                                                              t.role == "prefill")))
                try:
                    await asyncio.shield(added)
                except asyncio.CancelledError:
                    added.add_done_callback(functools.partial(_abort_when_added, worker, t.request_id))
                    raise
                except ray.exceptions.RayError as exc:  # a refusal (InvalidRequestError) or a death
                    if isinstance(exc, ray.exceptions.RayTaskError) and not isinstance(exc.cause, WorkerDiedError):
                        raise exc.cause if isinstance(exc.cause, BaseException) else exc from None
                    self._worker_died(worker)
                    if t.attempts >= MAX_ATTEMPTS:
                        raise EngineStoppedError(f"worker {worker.name} died before accepting the request") from None
                    self.cluster.retries += 1
                else:
                    if t.aborted:  # the abort may have reached the worker before the add did
                        worker.tell("abort", t.request_id)
                    return
        finally:
            t.busy = False

    async def _resubmit(self, t: TrackedRequest) -> None:
        try:
            await self._submit(t)
        except Exception as exc:
            self._fail(t, exc)

    async def _handover(self, t: TrackedRequest, source: WorkerHandle) -> None:
        """Export from the prefill worker straight into a decode worker (the front end only passes
        the object ref), then let the prefill worker free its blocks."""
        if t.aborted:  # the abort reached the prefill worker, which freed the blocks (release: idempotent)
            source.tell("release", t.request_id)
            return
        t.busy = True
        try:
            error = await self._move_kv(t, source)
        finally:  # cancelled (detach) or not: the parked blocks must not outlive the handover
            t.busy = False
            source.tell("release", t.request_id)
        if error is not None:
            self._fail(t, error if isinstance(error, ConveyorError) else WorkerDiedError(f"KV handover failed: {error}"))
            return
        if t.aborted:
            t.worker.tell("abort", t.request_id)

    async def _move_kv(self, t: TrackedRequest, source: WorkerHandle) -> BaseException | None:
        """Import the request's KV into a live decode worker (a second one if the first died),
        leaving out the leading blocks that worker's prefix cache holds. The worker reports the
        import (KVImported) in its outbox, where the transfer is counted."""
        import ray

        tried: WorkerHandle | None = None
        error: BaseException | None = None
        for _ in range(MAX_ATTEMPTS):
            target = pick(self.workers, "decode", self._tracked.values(), exclude=tried)
            if target is None:
                return WorkerDiedError("no live decode worker to take the request over")
            t.worker, tried = target, target
            try:
                cached = await target.actor.cached_prefix_blocks.remote(t.prompt, t.params)
                await target.actor.import_kv.remote(source.actor.export_kv.remote(t.request_id, cached))
                return None
            except ray.exceptions.RayError as exc:
                if not source.alive or not await self._responds(source):
                    self._worker_died(source)
                    return exc  # the KV is gone with it
                if await self._responds(target):
                    return exc  # not a death: the import itself failed
                self._worker_died(target)
                error = exc
        return error

    async def _responds(self, worker: WorkerHandle) -> bool:
        try:
            return await asyncio.wait_for(worker.actor.ping.remote(), 10.0)
        except Exception:
            return False

    def _worker_died(self, worker: WorkerHandle) -> None:
        if not worker.alive:
            return
        worker.alive = False
        self.router.forget(worker)
        self.cluster.worker_failures += 1
        log.error("worker %s died; failing or retrying the requests it held", worker.name)
        for t in list(self._tracked.values()):
            if t.worker is not worker or t.busy:
                continue
            if not t.streamed and t.attempts < MAX_ATTEMPTS and pick(self.workers, t.role, ()) is not None:
                self.cluster.retries += 1
                self._spawn(self._resubmit(t))
            else:
                self._fail(t, WorkerDiedError(f"worker {worker.name} died while serving this request"))

    def _fail(self, t: TrackedRequest, error: BaseException) -> None:
        if self._tracked.pop(t.request_id, None) is not None:
            t.sink.put_nowait(Failed(t.request_id, error))

    # --- outputs --------------------------------------------------------------------------------
    async def _poll_forever(self, worker: WorkerHandle) -> None:
        seen = 0  # events up to this number were handled; they are left out of the next answer
        while not self._stopping and worker.alive:
            try:
                result: PollResult = await worker.actor.poll.remote(seen, POLL_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception:  # RayActorError and kin: the worker is gone
                if not self._stopping:
                    self._worker_died(worker)
                return
            self._handle(worker, result, seen)
            seen = max(seen, result.last_seq)

    def _handle(self, worker: WorkerHandle, result: PollResult, seen: int) -> None:
        worker.last_load = result.load
        outputs: list[RequestOutput] = []
        first_seq = result.last_seq - len(result.events) + 1
        for seq, event in enumerate(result.events, first_seq):
            if seq <= seen:
                continue  # already handled (the worker had not heard our acknowledgement)
            t = self._tracked.get(event.request_id)
            if t is None or t.worker is not worker:  # aborted, failed, or a stale event of a dead attempt
                if isinstance(event, HandoverReady):  # nobody will take it over: free the parked blocks
                    worker.tell("release", event.request_id)
                continue
            if isinstance(event, KVImported):  # it comes before any token of the request from there
                self.cluster.kv_transfers += 1
                self.cluster.kv_transfer_bytes += event.num_bytes
                self.cluster.kv_transfer_cached_bytes += event.num_cached_bytes
            elif isinstance(event, TokenEvent):
                outputs.append(self._deliver(t, event))
            elif isinstance(event, HandoverReady):
                self._spawn(self._handover(t, worker))
            elif isinstance(event, RequestError):
                self._fail(t, event.error)
        stats = step_stats(worker.name, result.load.steps, self._slo_misses)
        for step in stats[:-1]:
            self._report(StepReport(0, 0, 0.0, 0, step))
        self._report(StepReport(0, 0, 0.0, 0, stats[-1] if stats else None, outputs=outputs))

    def _deliver(self, t: TrackedRequest, event: TokenEvent) -> RequestOutput:
        first_event = event.index == 0 and 0 not in t.times
        out = t.deliver(event)
        if first_event and t.worker:
            totals = self.cluster.totals.setdefault(t.worker.name, WorkerTotals())  # where the prompt was computed
            totals.requests += 1
            totals.prompt_tokens += len(t.prompt)
            totals.cached_tokens += t.num_cached_tokens
        if t.unfinished <= 0:
            self._tracked.pop(t.request_id, None)
            if t.worker is not None and t.worker.role == t.role:  # its whole history is in that worker's cache
                for tokens in t.tokens.values():
                    self.router.record(t.worker, t.prompt + tokens, t.params)
        return out

    def _report(self, report: StepReport) -> None:
        summarize(report, self.workers, self._tracked.values(), self.cluster)
        if self.on_report is not None:
            try:
                self.on_report(report)
            except Exception:
                log.exception("metrics update failed")

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

