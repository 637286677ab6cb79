"""KV handover between two engines: export a prefilled request's blocks, import them elsewhere.

Only the request's own blocks move (the first `num_computed_tokens` tokens' worth), never the
pool, and not those the importer's prefix cache already holds: the front end asks the importer
how many leading blocks of the prompt it has cached (`cached_prefix_blocks`) and the export
starts after them. The importer allocates its own blocks (its cached ones head the table), writes
the KV of the rest in, and queues the request at the count it reached, so the scheduler's one rule
(computed vs known tokens) resumes it as a decode. Should the importer have evicted some of the
blocks it said it held before the KV arrives, the request is queued at the end of what it still
holds and the gap is recomputed there: slower, never wrong. When it may enter is
conveyor/engine/kv_imports.py's rule. Every change to either engine's blocks goes through its
scheduler (detach_request, import_prefilled, release_handover). Runs on the engine's own thread on
both sides (the KV manager is not thread-safe), but for cached_prefix_blocks, an estimate that the
import checks again.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from conveyor.distributed.messages import KVPayload
from conveyor.engine.llm_engine import LLMEngine
from conveyor.errors import InvalidRequestError
from conveyor.kv import NULL_BLOCK, blocks_for
from conveyor.request import Request, RequestStatus, sequence_key
from conveyor.runner.transfer import kv_transfer
from conveyor.sampling.params import SamplingParams


def request_blocks(engine: LLMEngine, request: Request) -> list[int]:
    """The blocks that hold the (detached) request's computed tokens."""
    return engine.scheduler.handover_blocks(request)


def cached_prefix_blocks(engine: LLMEngine, token_ids: Sequence[int], params: SamplingParams) -> int:
    """How many leading full blocks of `token_ids` (a request with `params`) the engine's prefix
    cache holds now: an export to this engine may leave them out. Safe off the engine's thread
    (dict reads only); the import looks again."""
    key = sequence_key(params, lambda start, end: token_ids[start:end])
    return len(engine.scheduler.cached_import_prefix(key, len(token_ids)))


def export_request(engine: LLMEngine, request: Request, first_block: int = 0) -> KVPayload:
    """The request's KV from block `first_block` on (the importer holds the blocks before it)."""
    runner = kv_transfer(engine.runner)
    blocks = request_blocks(engine, request)
    window = engine.scheduler.handover_window_blocks(request)
    first_block = max(0, min(first_block, len(blocks)))
    data = runner.read_kv_blocks(blocks[first_block:], None if window is None else window[first_block:])
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
        first_block=first_block,
        sampler_state=runner.sampler.generator_state(request),
        window_held_from=_leading_nulls(window),
    )


def _leading_nulls(window: list[int] | None) -> int:
    return next((i for i, block in enumerate(window) if block != NULL_BLOCK), len(window)) if window else 0


def blocks_needed(engine: LLMEngine, payload: KVPayload) -> int:
    return blocks_for(payload.num_computed_tokens, engine.scheduler.kv.block_size)


def import_request(engine: LLMEngine, payload: KVPayload, cached: list[int] | None = None) -> Request:
    """Allocate, write, queue; when the import queue (conveyor/engine/kv_imports.py) lets it in.
    `cached`: the engine's cached leading blocks of the request (looked up here if None)."""
    runner = kv_transfer(engine.runner)
    expected = blocks_needed(engine, payload)
    first, block_size = payload.first_block, engine.scheduler.kv.block_size
    if not 0 <= first <= expected or payload.kv.shape[2] != expected - first or payload.kv.shape[3] != block_size:
        raise InvalidRequestError(
            f"KV of {payload.request_id!r} has {payload.kv.shape[2]} blocks of {payload.kv.shape[3]} tokens "
            f"from block {first}; this engine needs {expected} blocks of {block_size}"
        )
    kv = engine.scheduler.kv
    if payload.window_held_from and kv.window is None:
        # Its sliding-window layers' first blocks are zeros: this engine would key them as real KV.
        raise InvalidRequestError(
            f"KV of {payload.request_id!r} comes from an engine whose sliding-window layers keep only their window; "
            "this one keeps the whole context (--no-window-kv-pool): give both engines the same setting")
    if not 0 <= payload.window_held_from <= kv.first_visible_block(payload.num_computed_tokens):
        # An exporter never gives back a block its next query sees: past that, the import would read zeros.
        raise InvalidRequestError(f"KV of {payload.request_id!r} says its window blocks start at block "
                                  f"{payload.window_held_from}, past what its next query sees")
    request = Request(payload.request_id, payload.prompt_token_ids, payload.params, engine.clock())
    request.output_token_ids = list(payload.output_token_ids)
    request.num_computed_tokens = payload.num_computed_tokens
    request.status = RequestStatus.WAITING
    if cached is None:
        cached = engine.scheduler.cached_import_prefix(request.sequence_key, request.num_computed_tokens)
    cached = cached[:expected]
    if len(cached) < first:  # evicted since the front end asked: recompute from the last one held
        request.num_computed_tokens = len(cached) * block_size

    def write_kv(blocks: list[int], window_blocks: list[int] | None) -> None:
        if not blocks:
            return
        array = np.ascontiguousarray(payload.kv[:, :, len(cached) - first:])
        # What Ray hands over is a read-only view of the object store: copy it, torch wants to own it.
        data = torch.from_numpy(array if array.flags.writeable else array.copy())
        runner.write_kv_blocks(blocks, data.view(torch.bfloat16) if payload.kv_dtype == "bfloat16" else data,
                               window_blocks)

    engine.add_prefilled_request(request, cached, write_kv, payload.window_held_from)
    if payload.sampler_state is not None:
        runner.sampler.set_generator_state(request, payload.sampler_state)
    request.times.first_token = request.times.first_scheduled = request.arrival_time
    return request
