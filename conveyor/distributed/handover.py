"""KV handover between two engines: export a prefilled request's blocks, import them elsewhere.

Only the request's own blocks move (the first `num_computed_tokens` tokens' worth), never the
pool. The importer allocates its own blocks, writes the KV in, and queues the request at the
count it reached, so the scheduler's one rule (computed vs known tokens) resumes it as a decode.
When it may do so is conveyor/engine/imports.py's rule. Runs on the engine's own thread on both
sides (the KV manager is not thread-safe).
"""
from __future__ import annotations

import numpy as np
import torch

from conveyor.distributed.messages import KVPayload
from conveyor.engine.llm_engine import LLMEngine
from conveyor.errors import InvalidRequestError
from conveyor.kv.manager import blocks_for
from conveyor.request import Request, RequestStatus
from conveyor.runner.transfer import kv_transfer


def request_blocks(engine: LLMEngine, request: Request) -> list[int]:
    """The blocks that hold the request's computed tokens."""
    table = engine.kv.block_tables.get(request.request_id, [])
    return table[: blocks_for(request.num_computed_tokens, engine.kv.block_size)]


def export_request(engine: LLMEngine, request: Request) -> KVPayload:
    runner = kv_transfer(engine.runner)
    data = runner.read_kv_blocks(request_blocks(engine, request))
    dtype = "bfloat16" if data.dtype == torch.bfloat16 else "float32"
    array = data.view(torch.int16).numpy() if dtype == "bfloat16" else data.numpy()
    return KVPayload(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        output_token_ids=list(request.output_token_ids),
        params=request.sampling_params,
        num_computed_tokens=request.num_computed_tokens,
        kv=array,
        kv_dtype=dtype,
        sampler_state=runner.sampler.generator_state(request),
    )


def blocks_needed(engine: LLMEngine, payload: KVPayload) -> int:
    return blocks_for(payload.num_computed_tokens, engine.kv.block_size)


def import_request(engine: LLMEngine, payload: KVPayload) -> Request:
    """Allocate, write, queue; when the import queue (conveyor/engine/imports.py) lets it in."""
    runner = kv_transfer(engine.runner)
    expected = blocks_needed(engine, payload)
    if payload.kv.shape[2] != expected or payload.kv.shape[3] != engine.kv.block_size:
        raise InvalidRequestError(
            f"KV of {payload.request_id!r} has {payload.kv.shape[2]} blocks of {payload.kv.shape[3]} tokens; "
            f"this engine needs {expected} blocks of {engine.kv.block_size}"
        )
    request = Request(payload.request_id, payload.prompt_token_ids, payload.params, engine.clock())
    request.output_token_ids = list(payload.output_token_ids)
    request.num_computed_tokens = payload.num_computed_tokens
    request.status = RequestStatus.WAITING
    array = np.ascontiguousarray(payload.kv)
    # What Ray hands over is a read-only view of the object store: copy it, torch wants to own it.
    data = torch.from_numpy(array if array.flags.writeable else array.copy())
    if payload.kv_dtype == "bfloat16":
        data = data.view(torch.bfloat16)
    engine.kv.allocate(request.request_id, request.num_computed_tokens)
    try:
        runner.write_kv_blocks(engine.kv.block_tables[request.request_id], data)
        engine.add_prefilled_request(request)
    except BaseException:
        engine.kv.free(request.request_id)
        raise
    if payload.sampler_state is not None:
        runner.sampler.set_generator_state(request, payload.sampler_state)
    request.times.first_token = request.times.first_scheduled = request.arrival_time
    return request
