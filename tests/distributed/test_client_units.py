"""The front end's bookkeeping without Ray workers: fake actors record what they were told, so the
tests can check that no request the front end lets go of keeps a worker's blocks or its time."""
from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import generate_latest

from conveyor.api.metrics import Metrics
from conveyor.distributed.client import RayEngineClient
from conveyor.distributed.messages import HandoverReady, PollResult, WorkerLoadReport
from conveyor.distributed.router import WorkerHandle
from conveyor.distributed.tracking import TrackedRequest
from conveyor.sampling.params import SamplingParams


class _Method:
    def __init__(self, actor: _FakeActor, name: str) -> None:
        self.actor, self.name = actor, name

    def remote(self, *args: Any) -> Any:
        self.actor.calls.append((self.name, args))
        gate = self.actor.gates.get(self.name)
        if gate is None:
            return _Ready()
        return asyncio.ensure_future(gate.wait())  # answers once the test opens the gate


class _Ready:
    """An answer already there (a plain object: fire-and-forget calls never await it)."""

    def __await__(self) -> Any:
        return iter(())


class _FakeActor:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.gates: dict[str, asyncio.Event] = {}

    def __getattr__(self, name: str) -> _Method:
        return _Method(self, name)

    def told(self, method: str) -> list[tuple]:
        return [args for name, args in self.calls if name == method]


def _tracked(request_id: str, worker: WorkerHandle, role: str = "prefill") -> TrackedRequest:
    return TrackedRequest(request_id, [5, 6, 7], SamplingParams(max_tokens=4), asyncio.Queue(), 0.0, role,
                          worker=worker)


def test_handover_ready_of_an_untracked_request_releases_its_blocks() -> None:
    prefill = WorkerHandle("prefill-0", "prefill", _FakeActor())
    client = RayEngineClient([prefill, WorkerHandle("decode-0", "decode", _FakeActor())], tokenizer=None)
    client._handle(prefill, PollResult([HandoverReady("gone")], WorkerLoadReport(), 1), 0)
    assert prefill.actor.told("release") == [("gone",)]


def test_detach_aborts_what_it_fails_on_the_workers() -> None:
    prefill, decode = WorkerHandle("prefill-0", "prefill", _FakeActor()), WorkerHandle("decode-0", "decode", _FakeActor())

    async def main():
        client = RayEngineClient([prefill, decode], tokenizer=None)
        client._tracked = {"a": _tracked("a", prefill), "b": _tracked("b", decode, "decode")}
        client.detach()
        return client

    client = asyncio.run(main())
    assert not client._tracked
    assert prefill.actor.told("abort") == [("a",)] and decode.actor.told("abort") == [("b",)]


def test_cancelled_handover_still_releases_the_prefill_blocks() -> None:
    prefill, decode = WorkerHandle("prefill-0", "prefill", _FakeActor()), WorkerHandle("decode-0", "decode", _FakeActor())
    decode.actor.gates["import_kv"] = asyncio.Event()  # the import never finishes

    async def main():
        client = RayEngineClient([prefill, decode], tokenizer=None)
        t = _tracked("r", prefill)
        t.streamed = True
        client._tracked["r"] = t
        task = asyncio.ensure_future(client._handover(t, prefill))
        while not decode.actor.told("import_kv"):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return t

    t = asyncio.run(main())
    assert prefill.actor.told("release") == [("r",)]
    assert not t.busy


def test_abort_during_submission_stops_retries_and_reaches_the_worker() -> None:
    replica = WorkerHandle("replica-0", "replica", _FakeActor())

    async def main():
        gate = replica.actor.gates["add"] = asyncio.Event()
        client = RayEngineClient([replica], tokenizer=None)
        client._started = True
        sink: asyncio.Queue = asyncio.Queue()
        adding = asyncio.ensure_future(client.add_request("r", [5, 6], SamplingParams(max_tokens=2), sink))
        while not replica.actor.told("add"):
            await asyncio.sleep(0)
        client.abort("r")  # the abort may reach the worker before the add does
        gate.set()
        await adding
        # An aborted request is not submitted again.
        t = _tracked("s", replica, "replica")
        t.aborted = True
        await client._submit(t)

    asyncio.run(main())
    assert len(replica.actor.told("add")) == 1
    assert replica.actor.told("abort") == [("r",), ("r",)]  # the second one after the add landed


def test_a_submission_cancelled_mid_add_aborts_the_request_once_the_add_lands() -> None:
    """The client went away while the add was on its way: an abort sent at once may reach the
    worker first, so another follows the add, or the worker would run the request for nobody."""
    replica = WorkerHandle("replica-0", "replica", _FakeActor())

    async def main() -> tuple[int, int]:
        gate = replica.actor.gates["add"] = asyncio.Event()
        client = RayEngineClient([replica], tokenizer=None)
        client._started = True
        adding = asyncio.ensure_future(client.add_request("r", [5, 6], SamplingParams(max_tokens=2), asyncio.Queue()))
        while not replica.actor.told("add"):
            await asyncio.sleep(0)
        adding.cancel()
        await asyncio.gather(adding, return_exceptions=True)
        before = len(replica.actor.told("abort"))
        gate.set()  # the add lands on the worker now
        for _ in range(5):
            await asyncio.sleep(0)
        assert "r" not in client._tracked
        return before, len(replica.actor.told("abort"))

    before, after = asyncio.run(main())
    assert (before, after) == (1, 2)


def test_slo_state_of_the_workers_reaches_metrics() -> None:
    a, b = WorkerHandle("replica-0", "replica", _FakeActor()), WorkerHandle("replica-1", "replica", _FakeActor())
    metrics = Metrics("tiny")
    client = RayEngineClient([a, b], tokenizer=None)
    client.on_report = metrics.on_report
    state = {"slo_batch_cap": 7.0, "slo_token_budget": 64.0, "slo_ttft_misses": 2.0}
    client._handle(a, PollResult([], WorkerLoadReport(steps=[(3, 3, state), (3, 3, state)]), 0), 0)
    client._handle(b, PollResult([], WorkerLoadReport(steps=[(1, 1, {**state, "slo_ttft_misses": 1.0})]), 0), 0)
    text = generate_latest(metrics.registry).decode()
    assert 'conveyor:slo_batch_cap{model_name="tiny"} 7.0' in text
    assert 'conveyor:slo_ttft_misses_total{model_name="tiny"} 3.0' in text  # summed over the workers


def test_a_burst_fills_the_free_seats_then_the_waiting_bound() -> None:
    """Issue 18, case 8, on the Ray front end: requests about to take a free running seat are not
    counted as waiting, so max_num_seqs + max_waiting_requests of a burst get in."""
    from conveyor.distributed.messages import WorkerInfo
    from conveyor.errors import QueueFullError

    info = WorkerInfo("replica-0", "replica", max_model_len=128, num_kv_blocks=64, block_size=16,
                      kv_block_bytes=1000, max_num_seqs=4)
    worker = WorkerHandle("replica-0", "replica", _FakeActor(), info=info)

    async def main() -> list[bool]:
        client = RayEngineClient([worker], tokenizer=None, max_waiting_requests=2)
        client._started = True
        accepted = []
        for i in range(10):
            try:
                await client.add_request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=2), asyncio.Queue())
                accepted.append(True)
            except QueueFullError:
                accepted.append(False)
        return accepted

    assert asyncio.run(main()) == [True] * 6 + [False] * 4
