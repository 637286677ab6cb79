"""Router and KV handover without Ray: two in-process engines stand for the two workers."""
from __future__ import annotations

import asyncio
import dataclasses
import pickle
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from conveyor.distributed.deploy import DeploymentConfig
from conveyor.distributed.handover import (
    blocks_needed,
    cached_prefix_blocks,
    export_request,
    import_request,
    request_blocks,
)
from conveyor.distributed.client import RayEngineClient
from conveyor.distributed.messages import PollResult, RequestError, TokenEvent, WorkerInfo, WorkerLoadReport
from conveyor.distributed.router import PrefixIndex, Router, WorkerHandle, outstanding_tokens, pick
from conveyor.distributed.worker import EngineWorker
from conveyor.engine.async_engine import Failed
from conveyor.engine.llm_engine import LLMEngine
from conveyor.kv import NULL_BLOCK
from conveyor.errors import ConfigError, InvalidRequestError, ModelLoadError, NoAllowedTokenError, WorkerDiedError
from conveyor.sampling.params import SamplingParams
from tests.distributed.conftest import make_prompts, reference_outputs, tiny_config
from tests.distributed.test_client_units import _FakeActor, _tracked
from tests.helpers import make_tiny_hf_checkpoint


@dataclass
class _Req:
    worker: WorkerHandle | None
    load: int

    def outstanding_tokens(self) -> int:
        return self.load


def test_router_picks_least_outstanding_live_worker() -> None:
    a, b, c = (WorkerHandle(name, "replica", actor=None) for name in "abc")
    d = WorkerHandle("d", "decode", actor=None)
    requests = [_Req(a, 500), _Req(b, 3), _Req(b, 4), _Req(c, 1), _Req(d, 0)]
    assert pick([a, b, c, d], "replica", requests) is c
    assert outstanding_tokens(b, requests) == 7
    c.alive = False
    assert pick([a, b, c, d], "replica", requests) is b
    assert pick([a, b, c, d], "replica", []) is a  # ties: the first
    assert pick([a, b, c, d], "prefill", requests) is None
    assert pick([a, b, c, d], "replica", requests, exclude=b) is a


def test_deployment_config_rejects_half_a_disaggregation() -> None:
    with pytest.raises(ConfigError):
        DeploymentConfig(prefill_workers=1)
    with pytest.raises(ConfigError):
        DeploymentConfig(replicas=2, prefill_workers=1, decode_workers=1)
    assert DeploymentConfig(prefill_workers=2, decode_workers=1).roles() == [
        ("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode")]
    assert not DeploymentConfig().distributed


def _prefill(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """Run every request to its first token, then detach it (blocks kept), as a prefill worker does."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(prompt, p, f"r{i}")
    parked = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            assert not out.finished
            parked[out.request_id] = engine.detach_request(out.request_id)
    return parked


def _drain(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list[list[int]]]:
    """Step until every request is done (bounded: a stalled engine would step without end); each
    request's tokens, as reference_outputs gives them."""
    got = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests:
            break
        for out in engine.step():
            if out.finished:
                got[out.request_id] = [list(out.token_ids)]
    return got


def test_handover_between_engines_matches_one_engine_and_frees_every_block(tiny_model) -> None:
    config = tiny_config(tiny_model)
    prompts = make_prompts(8)
    params = [SamplingParams(max_tokens=9, temperature=0, ignore_eos=True) for _ in prompts]
    params[3] = SamplingParams(max_tokens=9, temperature=0.9, seed=7, ignore_eos=True)  # its draws move along
    expected = reference_outputs(config, prompts, params)
    prefill, decode = LLMEngine.from_config(config), LLMEngine.from_config(config)
    parked = _prefill(prefill, prompts, params)
    assert prefill.scheduler.kv.pool.num_used == sum(len(request_blocks(prefill, r)) for r in parked.values())
    for request_id, request in parked.items():
        payload = export_request(prefill, request)
        assert payload.kv.shape[2] == blocks_needed(decode, payload) == len(request_blocks(prefill, request))
        import_request(decode, payload)
        prefill.scheduler.release_handover(request_id)
    assert prefill.scheduler.kv.pool.num_used == 0
    assert _drain(decode) == expected
    assert decode.scheduler.kv.pool.num_used == 0 and not decode.scheduler.kv.block_tables


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3", num_layers=3, tie_word_embeddings=True,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def test_a_handover_moves_the_window_pools_blocks_too(tiny_gemma3: Path) -> None:
    """Gemma 3's sliding-window layers (window 8, blocks of 4) in a pool of their own on both
    engines: the export carries what the prefill engine's window pool holds (nothing of the blocks
    it gave back), the import keeps what was held (a later import of the same prefix takes its
    cached blocks from both pools). Outputs are one engine's; both pools end empty."""
    config = tiny_config(tiny_gemma3, block_size=4, num_kv_blocks=256)
    shared = [(7 * j + 3) % 1900 + 50 for j in range(24)]
    prompts = [shared + [100 + i] * (3 + 9 * i) for i in range(3)] + [[(11 * j) % 1500 + 60 for j in range(41)]]
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True) for _ in prompts]
    params[1] = SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True)
    expected = reference_outputs(config, prompts, params)
    prefill, decode = LLMEngine.from_config(config), LLMEngine.from_config(config)
    assert decode.scheduler.kv.window is not None and decode.scheduler.kv.window.tokens == 8
    parked = _prefill(prefill, prompts, params)
    skipped, exported_holes = [], []
    for request_id, request in sorted(parked.items()):
        window = prefill.scheduler.handover_window_blocks(request)
        assert window is not None
        exported_holes.append(window.count(NULL_BLOCK))
        skip = cached_prefix_blocks(decode, request.prompt_token_ids, request.sampling_params)
        payload = export_request(prefill, request, skip)
        blocks = len(request_blocks(prefill, request))
        # Layer 1 sees the whole context; layers 0 and 2 only their blocks still held.
        assert payload.window_layers == (0, 2) and payload.kv.shape[:3] == (1, 2, blocks - skip)
        assert payload.window_kv.shape[:3] == (2, 2, blocks - max(skip, exported_holes[-1]))
        assert payload.window_kv.any(axis=(1, 3, 4, 5)).all(), "no block of zeros travels"
        # What the decode engine's cache spared is what a whole export would have added.
        assert payload.nbytes + payload.cached_nbytes == export_request(prefill, request).nbytes
        import_request(decode, payload)
        skipped.append(skip)
        prefill.scheduler.release_handover(request_id)
        imported = decode.scheduler.kv.window_tables[request_id]
        first = decode.scheduler.kv.first_visible_block(request.num_computed_tokens)
        assert NULL_BLOCK not in imported[first:], "what the next query sees was imported"
        assert imported[: exported_holes[-1]] == [NULL_BLOCK] * exported_holes[-1], "no block of zeros kept"
    assert skipped[0] == 0 and skipped[1] == skipped[2] == 6, "the shared 24 tokens: 6 blocks of 4"
    # Prompts that took two steps (a budget of 32), or started from a prefix hit on the prefill
    # engine, had given back window blocks before their export.
    assert sum(1 for holes in exported_holes if holes) >= 2
    assert prefill.scheduler.kv.usage().used_blocks == prefill.scheduler.kv.usage().window_used_blocks == 0
    assert _drain(decode) == expected
    assert decode.scheduler.kv.usage().used_blocks == decode.scheduler.kv.usage().window_used_blocks == 0


def test_a_window_pools_export_is_refused_by_an_engine_keeping_the_whole_context(tiny_gemma3: Path) -> None:
    """Its sliding-window layers' first blocks are zeros: an engine keeping the whole context on every
    layer would key them as real KV, so it refuses the import by name of the setting."""
    prefill = LLMEngine.from_config(tiny_config(tiny_gemma3, block_size=4, num_kv_blocks=256))
    decode = LLMEngine.from_config(tiny_config(tiny_gemma3, block_size=4, num_kv_blocks=256, window_kv_pool=False))
    parked = _prefill(prefill, [[(11 * j) % 1500 + 60 for j in range(41)]],
                      [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)])
    payload = export_request(prefill, parked["r0"])
    assert payload.window_held_from > 0
    with pytest.raises(InvalidRequestError, match="no-window-kv-pool"):
        import_request(decode, payload)
    assert not decode.scheduler.kv.block_tables and not decode.scheduler.requests
    # Nor does an engine with a window pool take a payload claiming blocks in sight were given back.
    with pytest.raises(InvalidRequestError, match="past what its next query sees"):
        import_request(prefill, dataclasses.replace(payload, request_id="r9", window_held_from=10**6))
    assert "r9" not in prefill.scheduler.kv.block_tables


def test_a_handover_leaves_out_the_blocks_the_decode_engines_cache_holds(tiny_model) -> None:
    """Requests sharing a 48-token prefix (3 blocks of 16): once the first is imported, the others'
    exports start at block 3, their decode tables share those blocks, and every output is one
    engine's. An import whose promised blocks were evicted meanwhile recomputes the gap."""
    config = tiny_config(tiny_model)
    shared = [(7 * j + 3) % 1900 + 50 for j in range(48)]
    prompts = [shared + [100 + i] * (5 + 7 * i) for i in range(4)]
    params = [SamplingParams(max_tokens=9, temperature=0, ignore_eos=True) for _ in prompts]
    params[2] = SamplingParams(max_tokens=9, temperature=0.9, seed=3, ignore_eos=True)
    expected = reference_outputs(config, prompts, params)
    prefill, decode = LLMEngine.from_config(config), LLMEngine.from_config(config)
    parked = _prefill(prefill, prompts, params)
    skipped = []
    for i, (request_id, request) in enumerate(sorted(parked.items())):
        skip = cached_prefix_blocks(decode, request.prompt_token_ids, request.sampling_params)
        payload = export_request(prefill, request, skip)
        assert payload.first_block == skip and payload.kv.shape[2] == len(request_blocks(prefill, request)) - skip
        if i == 3:  # the decode engine loses what it promised before the KV arrives
            decode.scheduler.kv.lookup_prefix = lambda *args: []  # type: ignore[method-assign]
        import_request(decode, payload)
        skipped.append(skip)
        prefill.scheduler.release_handover(request_id)
    assert skipped == [0, 3, 3, 3]
    tables = [decode.scheduler.kv.block_tables[f"r{i}"] for i in range(3)]
    assert tables[0][:3] == tables[1][:3] == tables[2][:3]
    assert [decode.scheduler.kv.pool.ref_count(b) for b in tables[0][:3]] == [3, 3, 3]
    assert decode.scheduler.requests["r3"].num_computed_tokens == 0  # the gap: recomputed here
    assert "r3" not in decode.scheduler.kv.block_tables, "holding nothing, it waits as a new request does"
    assert _drain(decode) == expected
    assert decode.scheduler.kv.pool.num_used == 0 and not decode.scheduler.kv.block_tables


def test_imports_that_fill_the_pool_do_not_stall_the_decode_engine(tiny_model) -> None:
    # Prompts of exactly two blocks: each import holds 2 blocks and needs a third for its next
    # token. Four fill an 8-block pool, nothing runs, so no block would ever be freed unless the
    # scheduler evicts a waiting import (recomputed later).
    config = tiny_config(tiny_model)
    prompts = [[(13 * i + 7 * j) % 2000 + 10 for j in range(32)] for i in range(4)]
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True) for _ in prompts]
    expected = reference_outputs(config, prompts, params)
    prefill, decode = LLMEngine.from_config(config), LLMEngine.from_config(tiny_config(tiny_model, num_kv_blocks=8))
    for request in _prefill(prefill, prompts, params).values():
        import_request(decode, export_request(prefill, request))
    assert decode.scheduler.kv.num_free_blocks == 0
    assert decode.scheduler.uncommitted_free_blocks() == -4  # a worker would not have taken the last ones yet
    assert _drain(decode, max_steps=500) == expected
    assert decode.scheduler.num_preemptions > 0
    assert decode.scheduler.kv.pool.num_used == 0 and not decode.scheduler.kv.block_tables


def test_a_dead_worker_loop_answers_its_callers_and_looks_dead(tiny_model) -> None:
    worker = EngineWorker("w", "replica", tiny_config(tiny_model))

    def broken() -> None:
        raise RuntimeError("boom")

    worker._drain = broken  # type: ignore[method-assign]  # the first command kills the loop

    async def main() -> list[BaseException]:
        await worker.start()
        errors = []
        for call in (worker.add("r0", [5, 6, 7], SamplingParams(max_tokens=2), False), worker.ping(),
                     worker.poll(0, 0.1), worker.accounting()):
            try:
                await asyncio.wait_for(call, 10)
            except (WorkerDiedError, TimeoutError) as exc:
                errors.append(exc)
        return errors

    errors = asyncio.run(main())
    assert len(errors) == 4 and all(isinstance(e, WorkerDiedError) for e in errors), errors


def test_worker_steps_carry_the_slo_state(tiny_model) -> None:
    worker = EngineWorker("w", "replica", tiny_config(tiny_model, slo_tpot_ms=50.0))

    async def main() -> list:
        await worker.start()
        await worker.add("r0", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), False)
        steps, seen = [], 0
        for _ in range(50):  # its three steps, whatever polls they come in
            result = await worker.poll(seen, 1.0)
            seen, steps = result.last_seq, steps + result.load.steps
            if len(steps) >= 3:
                break
        await worker.stop()
        return steps

    steps = asyncio.run(main())
    assert steps and all("slo_batch_cap" in extra for _, _, extra in steps)


def test_a_worker_builds_its_engine_on_the_thread_that_steps_it(tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:
    # One thread doing all of a worker's torch work keeps libgomp to one team of threads.
    threads: dict[str, set[int]] = {"build": set(), "step": set()}
    build, step = LLMEngine.from_config, LLMEngine.step

    def recording_build(config):  # type: ignore[no-untyped-def]
        threads["build"].add(threading.get_ident())
        return build(config)

    def recording_step(self):  # type: ignore[no-untyped-def]
        threads["step"].add(threading.get_ident())
        return step(self)

    monkeypatch.setattr(LLMEngine, "from_config", staticmethod(recording_build))
    monkeypatch.setattr(LLMEngine, "step", recording_step)
    worker = EngineWorker("w", "replica", tiny_config(tiny_model))

    async def main() -> None:
        await worker.start()
        await worker.add("r0", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), False)
        seen, finished = 0, False
        for _ in range(50):
            result = await worker.poll(seen, 1.0)
            seen = result.last_seq
            finished = finished or any(getattr(e, "finished", False) for e in result.events)
            if finished:
                break
        await worker.stop()
        assert finished

    asyncio.run(main())
    assert len(threads["build"]) == 1 and threads["build"] == threads["step"]
    assert threading.get_ident() not in threads["build"]


def test_a_worker_whose_engine_cannot_be_built_raises_from_start(tmp_path) -> None:
    # start(), not the constructor: an actor's constructor error reaches the front end only as Ray's
    # ActorDiedError text, a task's as the error itself (deploy.start_deployment re-raises it)
    worker = EngineWorker("w", "replica", tiny_config(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match="missing"):
        asyncio.run(worker.start())


def _worker(name: str, num_kv_blocks: int = 64, block_size: int = 4) -> WorkerHandle:
    info = WorkerInfo(name, "replica", max_model_len=256, num_kv_blocks=num_kv_blocks, block_size=block_size,
                      kv_block_bytes=1)
    return WorkerHandle(name, "replica", actor=None, info=info)


def test_cache_aware_router_sends_a_conversation_back_to_its_history_unless_that_is_far_busier() -> None:
    a, b = _worker("a"), _worker("b")
    router = Router("cache-aware")
    history = list(range(100, 140))  # 40 tokens: 10 blocks of 4
    first = router.route([a, b], "replica", [], history)
    assert first is not None and first.worker is a and first.expected_cached_tokens == 0  # ties: the first
    router.record(a, history + [7, 8, 9, 10])  # the answer is cached too
    turn = history + [7, 8, 9, 10] + [55, 56, 57]
    # b is idle, a has 30 outstanding tokens: 30 + 3 to compute on a beats 47 on b.
    again = router.route([a, b], "replica", [_Req(a, 30)], turn)
    assert again is not None and again.worker is a and again.expected_cached_tokens == 44
    # Behind by more than the history is long: recomputing on b is cheaper.
    away = router.route([a, b], "replica", [_Req(a, 60)], turn)
    assert away is not None and away.worker is b and away.expected_cached_tokens == 0
    # A hit never covers the whole prompt: its last token is computed.
    whole = router.route([a, b], "replica", [], history)
    assert whole is not None and whole.worker is a and whole.expected_cached_tokens == len(history) - 1
    # Another cache_salt shares no block with the unsalted history, as in the workers' caches.
    salted = router.route([a, b], "replica", [_Req(a, 30)], turn, SamplingParams(cache_salt="tenant"))
    assert salted is not None and salted.worker is b and salted.expected_cached_tokens == 0


def test_a_new_history_goes_where_fewest_histories_are_live_unless_that_worker_is_far_behind() -> None:
    a, b = _worker("a"), _worker("b")
    now = [0.0]
    router = Router("cache-aware", clock=lambda: now[0])

    def route(prompt: list[int], *requests: _Req) -> WorkerHandle:
        now[0] += 1.0
        placed = router.route([a, b], "replica", list(requests), prompt)
        assert placed is not None
        return placed.worker

    x = list(range(100, 140))
    for turn in range(3):  # a conversation on a, three turns: one history however many requests
        assert route(x + [7] * 8 * turn) is a
    # b holds no history but is behind the least loaded by more than the prompt is long: a.
    assert route([300 + i for i in range(40)], _Req(b, 41)) is a
    # a holds two, b none, and b is behind by less than the prompt is long: b, although a is idle.
    assert route([500 + i for i in range(40)], _Req(b, 39)) is b
    assert router._live_histories(a, now[0], None) == pytest.approx(2.0, rel=0.1)
    # A conversation that moves (its worker far busier) takes its history along: a 1, b 2.
    assert route(x + [7] * 24, _Req(a, 1000)) is b
    assert router._live_histories(a, now[0], None) == pytest.approx(1.0, rel=0.1)
    assert router._live_histories(b, now[0], None) == pytest.approx(2.0, rel=0.1)
    assert route([700 + i for i in range(40)], _Req(a, 5)) is a  # so the next new one goes to a
    now[0] += 300.0  # long ago: every history has decayed to nothing, and is forgotten at the next route
    assert router._live_histories(a, now[0], None) < 1e-3 and router._live_histories(b, now[0], None) < 1e-3
    route([900 + i for i in range(40)])
    assert len(router._histories["a"]) + len(router._histories["b"]) == 1


def test_least_load_router_ignores_caches_and_a_dead_workers_cache_is_forgotten() -> None:
    a, b = _worker("a"), _worker("b")
    prompt = list(range(200, 240))
    least = Router("least-load")
    least.record(a, prompt)
    route = least.route([a, b], "replica", [_Req(a, 1)], prompt)
    assert route is not None and route.worker is b and route.expected_cached_tokens == 0
    aware = Router("cache-aware")
    aware.record(b, prompt)
    b.alive = False
    aware.forget(b)
    b.alive = True  # (as if a new worker took its name)
    route = aware.route([a, b], "replica", [], prompt)
    assert route is not None and route.worker is a and route.expected_cached_tokens == 0
    with pytest.raises(ValueError):
        Router("random")


def test_prefix_index_holds_at_most_the_workers_blocks_least_recently_used_out_first() -> None:
    index = PrefixIndex(capacity=3)
    index.add([b"k1", b"k2", b"k3"])
    assert index.match([b"k1"]) == 1  # touched: now the most recent
    index.add([b"k4"])
    assert len(index) == 3
    assert index.match([b"k2"]) == 0  # the least recently used went
    assert index.match([b"k1", b"k3", b"k4"]) == 3
    assert index.match([b"k3", b"k9", b"k4"]) == 1  # a prefix: it stops at the first miss



def test_a_request_whose_constraints_leave_no_token_reaches_the_front_end_as_that_refusal(tiny_model) -> None:
    # Through Ray the event is pickled: the error must arrive with its type and param (the server
    # answers NoAllowedTokenError with a 400 naming the field, as with a single engine, not a 500).
    worker = EngineWorker("w", "replica", tiny_config(tiny_model))
    a, b = 11, 12  # "a" may not follow "a" and "b" is banned: the second token has nothing left
    stuck = SamplingParams(allowed_token_ids=[a, b], bad_words_token_ids=[[b], [a, a]], max_tokens=5, temperature=1.0)

    async def main() -> list:
        await worker.start()
        await worker.add("plain", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), False)
        await worker.add("stuck", [5, 6, 7], stuck, False)
        events, seen, ended = [], 0, set()
        while ended != {"plain", "stuck"}:
            result = await worker.poll(seen, 1.0)
            seen, events = result.last_seq, events + result.events
            ended |= {e.request_id for e in result.events
                      if isinstance(e, RequestError) or (isinstance(e, TokenEvent) and e.finished)}
        await worker.stop()
        return events

    events = pickle.loads(pickle.dumps(asyncio.run(asyncio.wait_for(main(), 60.0))))
    errors = [e for e in events if isinstance(e, RequestError)]
    assert [e.request_id for e in errors] == ["stuck"]
    assert isinstance(errors[0].error, NoAllowedTokenError) and errors[0].error.param == "allowed_token_ids"
    assert sum(len(e.new_token_ids) for e in events if isinstance(e, TokenEvent) and e.request_id == "plain") == 4

    # The front end hands the worker's error to the request's stream as it came.
    replica = WorkerHandle("replica-0", "replica", _FakeActor())
    client = RayEngineClient([replica], tokenizer=None)
    t = client._tracked["stuck"] = _tracked("stuck", replica, "replica")
    client._handle(replica, PollResult([errors[0]], WorkerLoadReport(), 1), 0)
    failed = t.sink.get_nowait()
    assert isinstance(failed, Failed) and isinstance(failed.error, NoAllowedTokenError)
    assert failed.error.param == "allowed_token_ids"


def test_a_step_that_raises_after_isolating_a_request_still_ends_that_request(tiny_model) -> None:
    # Failure isolation takes "bad" out of the engine and makes its final output; if the step then
    # raises, that output is lost with the step, and the worker must still tell the front end that
    # "bad" ended (with "good", failed as the whole step's requests are), or its client waits forever.
    worker = EngineWorker("w", "replica", tiny_config(tiny_model))
    engine = worker.engine
    execute, isolate, update = engine.runner.execute, engine._execute_isolating, engine.scheduler.update_from_output
    isolated: list[str] = []

    def failing_execute(out, *args, **kwargs):  # type: ignore[no-untyped-def]
        if any(r.group_id == "bad" for r, _ in out.scheduled):
            raise RuntimeError("bad input")
        return execute(out, *args, **kwargs)

    def recording_isolate(out, stats):  # type: ignore[no-untyped-def]
        sampled, kept, failed = isolate(out, stats)
        isolated.extend(o.request_id for o in failed)
        return sampled, kept, failed

    def update_then_raise(*args, **kwargs):  # type: ignore[no-untyped-def]
        if isolated:
            raise RuntimeError("a bug after failure isolation")
        return update(*args, **kwargs)

    engine.runner.execute, engine._execute_isolating = failing_execute, recording_isolate
    engine.scheduler.update_from_output = update_then_raise

    async def main() -> dict[str, RequestError]:
        await worker.start()
        await worker.add("good", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True), False)
        await worker.add("bad", [8, 9], SamplingParams(max_tokens=5), False)
        errors: dict[str, RequestError] = {}
        seen = 0
        while set(errors) != {"good", "bad"}:
            result = await worker.poll(seen, 1.0)
            seen = result.last_seq
            errors.update({e.request_id: e for e in result.events if isinstance(e, RequestError)})
        await worker.stop()
        return errors

    errors = asyncio.run(asyncio.wait_for(main(), 60.0))
    assert isolated == ["bad"] and not engine.scheduler.requests
    assert all("the engine failed" in str(e.error) for e in errors.values())


def test_an_import_whose_promised_blocks_were_evicted_recomputes_its_window_from_its_own_cache(tiny_gemma3: Path) -> None:
    """The decode engine promised the 6 blocks of a shared prefix; one was evicted before the KV
    came, so the import recomputes from block 5 and writes nothing of the payload. The window
    blocks its recompute sees are the decode engine's own cached ones, not the exporter's
    window_held_from's NULL_BLOCKs (zeros: wrong tokens)."""
    config = tiny_config(tiny_gemma3, block_size=4, num_kv_blocks=256)
    shared = [(7 * j + 3) % 1900 + 50 for j in range(24)]
    prompts = [shared + [100] * 3, shared + [101] * 21]
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True) for _ in prompts]
    expected = reference_outputs(config, prompts, params)
    prefill, decode = LLMEngine.from_config(config), LLMEngine.from_config(config)
    parked = _prefill(prefill, prompts, params)
    import_request(decode, export_request(prefill, parked["r0"]))
    prefill.scheduler.release_handover("r0")
    request = parked["r1"]
    skip = cached_prefix_blocks(decode, request.prompt_token_ids, request.sampling_params)
    payload = export_request(prefill, request, skip)
    kept = decode.scheduler.cached_import_prefix(request.sequence_key, request.num_computed_tokens)[: skip - 1]
    assert skip == 6 and payload.window_held_from > decode.scheduler.kv.first_visible_block(len(kept) * 4)
    imported = import_request(decode, payload, kept)
    prefill.scheduler.release_handover("r1")
    assert imported.num_computed_tokens == len(kept) * 4
    assert _drain(decode) == expected
    assert decode.scheduler.kv.usage().used_blocks == decode.scheduler.kv.usage().window_used_blocks == 0


def test_an_import_with_a_broken_sampler_state_is_refused_and_leaves_nothing(tiny_model) -> None:
    config = tiny_config(tiny_model)
    prefill, decode = LLMEngine.from_config(config), LLMEngine.from_config(config)
    seeded = SamplingParams(max_tokens=4, temperature=0.9, seed=3, ignore_eos=True)
    payload = export_request(prefill, _prefill(prefill, make_prompts(1), [seeded])["r0"])
    assert payload.sampler_state is not None
    broken = dataclasses.replace(payload, sampler_state=payload.sampler_state[:7])
    with pytest.raises(InvalidRequestError, match="sampler state"):
        import_request(decode, broken)
    assert not decode.scheduler.requests and decode.scheduler.kv.pool.num_used == 0
    with pytest.raises(InvalidRequestError, match="kv_dtype"):
        import_request(decode, dataclasses.replace(payload, kv=payload.kv.astype("float64")))
    import_request(decode, payload)  # the same request, whole, still goes in
    assert len(_drain(decode)["r0"][0]) == 4


def test_prompt_logprobs_travel_with_a_workers_first_event_to_the_front_end(tiny_model) -> None:
    # They were refused under Ray: the workers' events did not carry them.
    config = tiny_config(tiny_model)
    prompt = make_prompts(3)[2]
    scored = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2)
    local = LLMEngine.from_config(config)
    local.add_request(prompt, scored, "local")
    expected = None
    while expected is None and local.has_unfinished_requests:  # on the request's first output
        expected = next((o.prompt_logprobs for o in local.step() if o.prompt_logprobs is not None), None)
    worker = EngineWorker("w", "replica", config)

    async def main() -> list:
        await worker.start()
        await worker.add("scored", prompt, scored, False)
        events, seen = [], 0
        while not any(isinstance(e, TokenEvent) and e.finished for e in events):
            result = await worker.poll(seen, 1.0)
            seen, events = result.last_seq, events + result.events
        await worker.stop()
        return events

    events = pickle.loads(pickle.dumps(asyncio.run(asyncio.wait_for(main(), 60.0))))
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert tokens[0].prompt_logprobs == expected and len(expected) == len(prompt) and expected[0] is None
    assert all(e.prompt_logprobs is None for e in tokens[1:])
    replica = WorkerHandle("replica-0", "replica", _FakeActor())
    client = RayEngineClient([replica], tokenizer=None)
    t = client._tracked["scored"] = _tracked("scored", replica, "replica")
    client._handle(replica, PollResult([tokens[0]], WorkerLoadReport(), 1), 0)
    assert t.sink.get_nowait().prompt_logprobs == expected


def test_a_refusal_keeps_its_param_and_code_through_pickling() -> None:
    """A worker's refusal reaches the front end pickled: the 400 must still name the field and
    carry OpenAI's code (clients trim a conversation on context_length_exceeded)."""
    from conveyor.errors import CONTEXT_LENGTH_EXCEEDED

    refusal = pickle.loads(pickle.dumps(InvalidRequestError("too long", "max_tokens", CONTEXT_LENGTH_EXCEEDED)))
    assert (str(refusal), refusal.param, refusal.code) == ("too long", "max_tokens", CONTEXT_LENGTH_EXCEEDED)
