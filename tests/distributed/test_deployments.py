"""Replicas and prefill/decode disaggregation on a local Ray instance: the same greedy tokens as one
engine, streaming unchanged, and exact KV block accounting after many handovers."""
from __future__ import annotations

import asyncio

import pytest

from conveyor.distributed.client import RayEngineClient
from conveyor.distributed.deploy import DeploymentConfig, start_deployment
from conveyor.sampling.params import SamplingParams
from tests.distributed.conftest import (
    local_ray,
    make_prompts,
    reference_outputs,
    run_requests,
    tiny_config,
)


@pytest.fixture(scope="module")
def ray_instance():
    with local_ray():
        yield


@pytest.fixture(scope="module")
def config(tiny_model):
    return tiny_config(tiny_model)


def _deploy(config, deployment: DeploymentConfig):
    client = start_deployment(config, deployment)
    yield client
    client.stop()


# worker_num_cpus=0: Ray reserves nothing, so three workers fit the test instance's CPUs.
@pytest.fixture(scope="module")
def replicas(ray_instance, config):
    yield from _deploy(config, DeploymentConfig(replicas=2, worker_num_cpus=0))


@pytest.fixture(scope="module")
def disaggregated(ray_instance, config):
    yield from _deploy(config, DeploymentConfig(prefill_workers=1, decode_workers=1, worker_num_cpus=0))


def _client(deployment: RayEngineClient) -> RayEngineClient:
    """A fresh front end over the module's workers: each test runs on its own event loop."""
    client = RayEngineClient(deployment.workers, deployment.tokenizer)
    client.start()
    return client


def _greedy(count: int, max_tokens: int = 10) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True) for _ in range(count)]


def test_two_replicas_match_one_engine_token_for_token(replicas, config) -> None:
    prompts, params = make_prompts(8), _greedy(8)
    expected = reference_outputs(config, prompts, params)

    async def main():
        client = _client(replicas)
        run = asyncio.ensure_future(run_requests(client, prompts, params))
        await asyncio.sleep(0)
        while not client.placement("r7") and not run.done():
            await asyncio.sleep(0.001)
        placed = {client.placement(f"r{i}") for i in range(8)} - {None}
        outcomes = await run
        client.detach()
        return outcomes, placed

    outcomes, placed = asyncio.run(main())
    assert {rid: o.tokens for rid, o in outcomes.items()} == expected
    assert placed == {"replica-0", "replica-1"}  # the router spread them
    for o in outcomes.values():  # streamed one token per event, in order, nothing lost or repeated
        assert [t for event in o.streamed for t in event] == o.tokens[0]
        assert all(len(event) == 1 for event in o.streamed)


def test_prefill_decode_workers_match_one_engine_token_for_token(disaggregated, config) -> None:
    prompts = make_prompts(9)
    params = _greedy(9)
    params[4] = SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True)  # seeded: draws move along
    params[5] = SamplingParams(max_tokens=1, temperature=0)  # ends on the prefill worker: nothing to hand over
    params[6] = SamplingParams(max_tokens=6, temperature=0, n=2, ignore_eos=True)  # n > 1 runs whole on decode
    params[7] = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2, ignore_eos=True)  # scored on prefill
    expected = reference_outputs(config, prompts, params)

    async def main():
        client = _client(disaggregated)
        outcomes = await run_requests(client, prompts, params, prefix="r")
        client.detach()
        return outcomes, client.cluster

    outcomes, cluster = asyncio.run(main())
    assert {rid: o.tokens for rid, o in outcomes.items()} == expected
    scored = outcomes["r7"].prompt_logprobs
    assert scored is not None and len(scored) == len(prompts[7]) and scored[0] is None
    assert all(prompts[7][i] in scored[i] for i in range(1, len(scored)))
    assert cluster.kv_transfers == 7  # all but the one-token request and the n=2 one
    assert cluster.kv_transfer_bytes > 0


_EMPTY_BOOKS = {"used_blocks": 0, "owned_blocks": 0, "num_owners": 0, "parked": 0, "unfinished": 0}


def _run_and_audit(deployment, prompts, params, prefix: str):
    """Runs the requests, detaches, and returns (outcomes, client, each worker's block books) once
    they are empty or 20 s have passed. A handover's release is told to the prefill worker without
    waiting (RayEngineClient._handover), so its last request can still be parked there for a moment
    after every output has arrived; what must hold is that nothing stays behind."""

    async def main():
        client = _client(deployment)
        outcomes = await run_requests(client, prompts, params, prefix=prefix)
        client.detach()
        for _ in range(400):
            books = await asyncio.gather(*(w.actor.accounting.remote() for w in client.workers))
            if all(book == _EMPTY_BOOKS for book in books):
                break
            await asyncio.sleep(0.05)
        return outcomes, client, books

    return asyncio.run(main())


def test_block_accounting_exact_after_100_handovers(disaggregated) -> None:
    # 100 requests at once into 64-block pools: imports wait for blocks, prefill blocks wait for takers.
    prompts = make_prompts(100, shortest=17, step=7)
    outcomes, client, books = _run_and_audit(disaggregated, prompts, _greedy(100, max_tokens=4), "acct")
    assert all(o.error is None and len(o.tokens[0]) == 4 for o in outcomes.values())
    assert client.cluster.kv_transfers == 100
    for book in books:
        assert book == _EMPTY_BOOKS


def test_long_outputs_through_a_small_decode_pool_all_finish(disaggregated) -> None:
    # Outputs that outgrow the 64-block decode pool: imports queue for blocks, decodes preempt one
    # another, and the decode worker must never keep a head it cannot admit with nothing running.
    # 24 requests of up to ~250 tokens each want several times the pool at once.
    prompts = make_prompts(24, shortest=17, step=7)
    outcomes, client, books = _run_and_audit(disaggregated, prompts, _greedy(24, max_tokens=150), "long")
    assert all(o.error is None and len(o.tokens[0]) == 150 for o in outcomes.values())
    assert client.cluster.kv_transfers == 24
    assert books == [_EMPTY_BOOKS, _EMPTY_BOOKS]


def test_detach_mid_run_leaves_no_blocks_behind(disaggregated) -> None:
    prompts = make_prompts(12, shortest=17, step=7)
    params = _greedy(12, max_tokens=200)

    async def main():
        client = _client(disaggregated)
        sinks = {f"gone{i}": asyncio.Queue() for i in range(len(prompts))}
        await asyncio.gather(*(client.add_request(rid, p, sp, sinks[rid])
                               for (rid, p, sp) in zip(sinks, prompts, params)))
        await asyncio.wait_for(sinks["gone0"].get(), 60)  # some are decoding, others parked or queued
        client.detach()  # without aborts the prefill worker would keep the parked blocks for good
        for _ in range(400):
            books = await asyncio.gather(*(w.actor.accounting.remote() for w in client.workers))
            if books == [_EMPTY_BOOKS, _EMPTY_BOOKS]:
                break
            await asyncio.sleep(0.05)
        return books

    assert asyncio.run(main()) == [_EMPTY_BOOKS, _EMPTY_BOOKS]


class _Borrowed(RayEngineClient):
    """The app stops its engine at shutdown; here that must leave the module's workers running."""

    def stop(self, timeout: float = 10.0) -> None:
        self.detach()


def test_http_front_end_over_disaggregated_workers(disaggregated, config) -> None:
    import json

    from fastapi.testclient import TestClient

    from conveyor.api.app import ServerState, build_app
    from conveyor.api.metrics import Metrics

    prompts = make_prompts(3, shortest=40)
    expected = reference_outputs(config, prompts, _greedy(3, max_tokens=6))
    engine = _Borrowed(disaggregated.workers, disaggregated.tokenizer)
    state = ServerState(engine, ["tiny"], Metrics("tiny"))
    with TestClient(build_app(state)) as http:
        whole = http.post("/v1/completions", json={"prompt": prompts[0], "max_tokens": 6, "temperature": 0,
                                                   "ignore_eos": True})
        streamed = http.post("/v1/completions", json={"prompt": prompts[1], "max_tokens": 6, "temperature": 0,
                                                      "ignore_eos": True, "stream": True})
        metrics = http.get("/metrics").text
    assert whole.status_code == 200 and streamed.status_code == 200
    tokenizer = disaggregated.tokenizer
    assert whole.json()["choices"][0]["text"] == tokenizer.decode(expected["r0"][0])
    chunks = [line[len("data: "):] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    text = "".join(json.loads(c)["choices"][0]["text"] for c in chunks[:-1])
    assert text == tokenizer.decode(expected["r1"][0])
    assert 'conveyor:kv_transfers_total{model_name="tiny"} 2.0' in metrics
    assert 'conveyor:worker_alive{model_name="tiny",role="decode",worker="decode-0"} 1.0' in metrics


def test_embeddings_over_disaggregated_workers_end_on_the_prefill_worker(disaggregated, config) -> None:
    """An embedding is computed where prompts are (the prefill worker) and ends there: its vector
    comes back with its only event, equal to one engine's, and no KV is handed over for it."""
    from fastapi.testclient import TestClient

    from conveyor.api.app import ServerState, build_app
    from conveyor.api.metrics import Metrics
    from conveyor.engine.llm import LLM
    from conveyor.engine.llm_engine import LLMEngine

    prompts = make_prompts(3, shortest=40)
    expected = [o.outputs.embedding for o in LLM.from_engine(LLMEngine.from_config(config)).embed(prompts)]
    engine = _Borrowed(disaggregated.workers, disaggregated.tokenizer)
    state = ServerState(engine, ["tiny"], Metrics("tiny"))
    with TestClient(build_app(state)) as http:
        before = http.get("/metrics").text
        reply = http.post("/v1/embeddings", json={"input": prompts})
        after = http.get("/metrics").text
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    for got, want in zip((d["embedding"] for d in body["data"]), expected):
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5

    def transfers(page: str) -> float:
        return sum(float(line.split()[-1]) for line in page.splitlines() if line.startswith("conveyor:kv_transfers_total"))

    assert transfers(before) == transfers(after)


def test_cache_aware_replicas_send_each_turn_back_to_its_history(replicas, config) -> None:
    """Four conversations of three turns on two replicas, each turn's requests sent in another
    order: each later turn lands where its history is cached and finds it there (the worker
    reports the hit), and the conversations are spread. (Least-load routing fails this.)"""
    first = make_prompts(4, shortest=40, step=7)
    params = _greedy(4, max_tokens=12)
    block = config.block_size
    orders = [[0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2]]

    async def main():
        client = _client(replicas)
        seen: list[dict[int, set[str]]] = []
        cached: list[list[tuple[int, int]]] = []  # per turn: (cached tokens, history length before it)
        histories = first
        for turn, order in enumerate(orders):
            prompts = [histories[i] + [11 + turn, 12 + i] for i in order]
            run = asyncio.ensure_future(run_requests(client, prompts, params, prefix=f"t{turn}-"))
            placed: dict[int, set[str]] = {}
            while not run.done():
                for k, i in enumerate(order):
                    where = client.placement(f"t{turn}-{k}")
                    if where is not None:
                        placed.setdefault(i, set()).add(where)
                await asyncio.sleep(0.001)
            outcomes = await run
            seen.append(placed)
            cached.append([(outcomes[f"t{turn}-{k}"].cached_tokens, len(histories[i])) for k, i in enumerate(order)])
            histories = list(histories)
            for k, i in enumerate(order):
                histories[i] = prompts[k] + outcomes[f"t{turn}-{k}"].tokens[0]
        totals = dict(client.cluster.totals)
        client.detach()
        return seen, cached, totals

    seen, cached, totals = asyncio.run(main())
    homes = [seen[0][i] for i in range(4)]
    assert all(len(h) == 1 for h in homes)
    assert {next(iter(h)) for h in homes} == {"replica-0", "replica-1"}  # spread
    for turn in (1, 2):
        assert [seen[turn][i] for i in range(4)] == homes  # back where the history is
        for hit, history in cached[turn]:
            assert hit >= history // block * block - block  # its history's blocks, bar the last
    assert sum(t.requests for t in totals.values()) == 12
    assert sum(t.cached_tokens for t in totals.values()) == sum(hit for turn in cached for hit, _ in turn)


def test_prefill_decode_with_a_shared_prefix_hits_the_prefill_cache_and_changes_no_output(disaggregated,
                                                                                           config) -> None:
    """Two waves of requests sharing a 48-token prefix: the second wave's prompts come out of the
    prefill worker's prefix cache, are handed over without the prefix's blocks (the decode worker
    holds them since the first wave), and decode to the same tokens as one engine."""
    shared = [(7 * j + 3) % 1900 + 50 for j in range(48)]  # unlike every other test's prompts
    prompts = [shared + [100 + i, 200 + i, 300 + i] for i in range(6)]
    params = _greedy(6, max_tokens=8)
    params[3] = SamplingParams(max_tokens=8, temperature=0.8, seed=5, ignore_eos=True)
    expected = reference_outputs(config, prompts, params)

    async def main():
        client = _client(disaggregated)
        first = await run_requests(client, prompts[:1], params[:1], prefix="w0-")
        rest = await run_requests(client, prompts[1:], params[1:], prefix="w1-")
        client.detach()
        return first, rest, client.cluster

    first, rest, cluster = asyncio.run(main())
    got = {"r0": first["w0-0"].tokens} | {f"r{i + 1}": o.tokens for i, o in enumerate(rest.values())}
    assert got == expected
    assert first["w0-0"].cached_tokens == 0
    assert all(o.cached_tokens == 48 for o in rest.values())  # three full blocks of 16
    assert cluster.kv_transfers == 6
    block_bytes = disaggregated.workers[0].info.kv_block_bytes
    # 51-token prompts: 4 blocks each. The first moves whole; the rest move only their last block.
    assert cluster.kv_transfer_bytes == (4 + 5 * 1) * block_bytes
    assert cluster.kv_transfer_cached_bytes == 5 * 3 * block_bytes
