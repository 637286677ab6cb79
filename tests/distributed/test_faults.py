"""A replica killed mid-run (ray.kill): its requests end with an error (or are retried when they
had streamed nothing), nothing hangs, the router stops sending to it, the others finish exactly."""
from __future__ import annotations

import asyncio

import pytest

from conveyor.distributed.client import RayEngineClient
from conveyor.distributed.deploy import DeploymentConfig, start_deployment
from conveyor.errors import WorkerDiedError
from conveyor.sampling.params import SamplingParams
from tests.distributed.conftest import (
    collect,
    local_ray,
    make_prompts,
    reference_outputs,
    tiny_config,
)


@pytest.fixture(scope="module")
def replicas(tiny_model):
    with local_ray():
        config = tiny_config(tiny_model, max_model_len=512, num_kv_blocks=256)
        client = start_deployment(config, DeploymentConfig(replicas=2, worker_num_cpus=0))
        yield config, client
        client.stop()


async def _until_dead(actor, timeout: float = 30.0) -> None:
    import ray

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        try:
            await asyncio.wait_for(actor.ping.remote(), 1.0)
        except ray.exceptions.RayActorError:
            return
        except TimeoutError:
            continue
        await asyncio.sleep(0.01)
    raise AssertionError("the killed actor still answers")


def test_killed_replica_fails_or_retries_its_requests_and_the_rest_finish(replicas) -> None:
    import ray

    config, deployment = replicas
    # Long outputs, so the requests are still decoding when the replica dies.
    prompts = make_prompts(6)
    params = [SamplingParams(max_tokens=400, temperature=0, ignore_eos=True) for _ in prompts]
    late_prompts = make_prompts(3, shortest=30)
    # 128 tokens, so a late request is still running when its placement is read (20 could finish
    # within the next one's add on this machine: a CI failure).
    late_params = [SamplingParams(max_tokens=128, temperature=0, ignore_eos=True) for _ in late_prompts]
    expected = reference_outputs(config, prompts, params)
    expected_late = reference_outputs(config, late_prompts, late_params)

    async def main():
        client = RayEngineClient(deployment.workers, deployment.tokenizer)
        client.start()
        sinks = {f"r{i}": asyncio.Queue() for i in range(len(prompts))}
        await asyncio.gather(*(client.add_request(rid, p, sp, sinks[rid])
                               for (rid, p, sp) in zip(sinks, prompts, params)))
        placed = {rid: client.placement(rid) for rid in sinks}
        first = {rid: await asyncio.wait_for(sinks[rid].get(), 60) for rid in sinks}  # everyone has streamed
        victim = next(w for w in client.workers if w.name == "replica-0")
        # What the assertions below rest on: the victim's requests are still decoding when it dies.
        assert all(client.placement(rid) == name for rid, name in placed.items()), "finished too early"
        ray.kill(victim.actor)
        # ray.kill is asynchronous: until the victim is gone, and the front end knows it, a late
        # request could still be accepted by it (and then fail with it).
        await _until_dead(victim.actor)
        for _ in range(3000):
            if not victim.alive:
                break
            await asyncio.sleep(0.01)
        late = {f"late{i}": asyncio.Queue() for i in range(len(late_prompts))}
        late_placed = {}
        for rid, p, sp in zip(late, late_prompts, late_params):  # each placement read as its add returns
            await client.add_request(rid, p, sp, late[rid])
            late_placed[rid] = client.placement(rid)
        outcomes = await asyncio.gather(*(collect(q, 1) for q in sinks.values()))
        late_outcomes = await asyncio.gather(*(collect(q, 1) for q in late.values()))
        client.detach()
        return placed, first, dict(zip(sinks, outcomes)), late_placed, dict(zip(late, late_outcomes)), client

    placed, first, outcomes, late_placed, late_outcomes, client = asyncio.run(main())
    assert set(placed.values()) == {"replica-0", "replica-1"}
    for rid, outcome in outcomes.items():
        if placed[rid] == "replica-0":  # streamed already, so not retried: a clear error
            assert isinstance(outcome.error, WorkerDiedError), outcome
            assert "replica-0" in str(outcome.error)
        else:
            assert outcome.error is None
            assert first[rid].new_token_ids + outcome.tokens[0][1:] == expected[rid][0]
            assert outcome.tokens == expected[rid]
    assert set(late_placed.values()) == {"replica-1"}  # placed (or retried) on the live replica only
    assert {rid.replace("late", "r"): o.tokens for rid, o in late_outcomes.items()} == expected_late
    assert client.cluster.worker_failures == 1
    assert [w.alive for w in client.workers] == [False, True]


def test_request_sent_to_a_dead_replica_is_retried_on_the_live_one(replicas) -> None:
    import ray

    from conveyor.distributed.router import WorkerHandle

    config, deployment = replicas
    dead = next(w for w in deployment.workers if w.name == "replica-0")
    ray.kill(dead.actor)  # idempotent: the test above may have killed it already
    # A front end that has not noticed yet: both handles alive, so the router's first pick (a tie)
    # is the dead replica, and the add itself discovers the death.
    workers = [WorkerHandle(w.name, w.role, w.actor, w.info) for w in deployment.workers]
    prompts = make_prompts(2, shortest=20)
    # Outputs long enough to be decoding still when the next request is added (8 tokens could end
    # on the live replica within an add, and a finished request has no placement).
    params = [SamplingParams(max_tokens=128, temperature=0, ignore_eos=True) for _ in prompts]
    expected = reference_outputs(config, prompts, params)

    async def main():
        client = RayEngineClient(workers, deployment.tokenizer)
        client.start()  # its pollers run from the first await on; r0's pick happens before that
        sinks = {f"r{i}": asyncio.Queue() for i in range(len(prompts))}
        placed = {}
        for (rid, p, sp) in zip(sinks, prompts, params):
            await client.add_request(rid, p, sp, sinks[rid])
            placed[rid] = client.placement(rid)  # None: already finished (on the live one: see below)
        outcomes = {rid: await collect(q, 1) for rid, q in sinks.items()}
        running = client.is_running  # one replica left is still a service
        client.detach()
        return placed, outcomes, client, running

    placed, outcomes, client, running = asyncio.run(main())
    assert "replica-1" in placed.values() and set(placed.values()) <= {"replica-1", None}
    assert {rid: o.tokens for rid, o in outcomes.items()} == expected
    assert client.cluster.retries == 1 and client.cluster.worker_failures == 1
    assert running


def test_a_worker_that_refuses_its_config_says_so_without_rays_wrapping(tiny_model):
    from conveyor.errors import ConfigError

    # Two blocks hold 32 tokens: a max_model_len of 64 is refused where each worker builds its engine
    # (on this module's Ray instance, or one start_deployment starts and stops).
    config = tiny_config(tiny_model, max_model_len=64, num_kv_blocks=2)
    with pytest.raises(ConfigError, match="more tokens than the KV cache holds") as refused:
        start_deployment(config, DeploymentConfig(replicas=2, worker_num_cpus=0))
    assert type(refused.value) is ConfigError and "Traceback" not in str(refused.value)
