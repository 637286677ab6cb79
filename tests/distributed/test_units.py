"""Router and KV handover without Ray: two in-process engines stand for the two workers."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from conveyor.distributed.deploy import DeploymentConfig
from conveyor.distributed.handover import (
    blocks_needed,
    export_request,
    import_request,
    request_blocks,
)
from conveyor.distributed.router import WorkerHandle, outstanding_tokens, pick
from conveyor.engine.llm_engine import LLMEngine
from conveyor.errors import ConfigError
from conveyor.sampling.params import SamplingParams
from tests.distributed.conftest import make_prompts, reference_outputs, tiny_config


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


def test_handover_between_engines_matches_one_engine_and_frees_every_block(tiny_model) -> None:
    config = tiny_config(tiny_model)
    prompts = make_prompts(8)
    params = [SamplingParams(max_tokens=9, temperature=0, ignore_eos=True) for _ in prompts]
    params[3] = SamplingParams(max_tokens=9, temperature=0.9, seed=7, ignore_eos=True)  # its draws move along
    expected = reference_outputs(config, prompts, params)
    prefill, decode = LLMEngine.from_config(config), LLMEngine.from_config(config)
    parked = _prefill(prefill, prompts, params)
    assert prefill.kv.pool.num_used == sum(len(request_blocks(prefill, r)) for r in parked.values())
    for request_id, request in parked.items():
        payload = export_request(prefill, request)
        assert payload.kv.shape[2] == blocks_needed(decode, payload) == len(request_blocks(prefill, request))
        import_request(decode, payload)
        prefill.kv.free(request_id)
    assert prefill.kv.pool.num_used == 0
    got = {}
    while decode.has_unfinished_requests:
        for out in decode.step():
            if out.finished:
                got[out.request_id] = [list(out.token_ids)]
    assert got == expected
    assert decode.kv.pool.num_used == 0 and not decode.kv.block_tables
