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

from conveyor.distributed.messages import KVPayload
from conveyor.engine.llm_engine import LLMEngine
from conveyor.errors import InvalidRequestError
from conveyor.kv import blocks_for, leading_null_blocks
from conveyor.request import Request, RequestStatus, sequence_key
from conveyor.runner.transfer import kv_transfer
from conveyor.sampling.params import SamplingParams
from conveyor.sampling.sampler import check_generator_state


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
    """The request's KV from block `first_block` on (the importer holds the blocks before it); of
    sliding-window layers with a pool of their own, only the blocks the exporter still held."""
    runner = kv_transfer(engine.runner)
    blocks = request_blocks(engine, request)
    window = engine.scheduler.handover_window_blocks(request)
    first_block = max(0, min(first_block, len(blocks)))
    main_layers, window_layers = runner.kv_layer_groups()
    held_from = leading_null_blocks(window)
    window_first = max(first_block, held_from)
    data = runner.read_kv_layers(main_layers, blocks[first_block:])
    window_data = runner.read_kv_layers(window_layers, window[window_first:]) if window is not None and window_layers else None
    return KVPayload(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        output_token_ids=list(request.output_token_ids),
        params=request.sampling_params,
        num_computed_tokens=request.num_computed_tokens,
        kv=data,
        kv_dtype=data.dtype.name,
        first_block=first_block,
        sampler_state=runner.sampler.generator_state(request),
        window_held_from=held_from,
        window_layers=tuple(window_layers) if window_data is not None else (),
        window_kv=window_data,
    )


# The KV caches conveyor holds (conveyor.runner.model_runner.kv_cache_dtype): numpy's own dtypes.
_CARRIED_AS = {"float16": np.dtype(np.float16), "float32": np.dtype(np.float32)}


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
    main_layers, window_layers = runner.kv_layer_groups()
    num_layers = len(main_layers) + len(window_layers)
    window_kv = payload.window_kv
    carried = _CARRIED_AS.get(payload.kv_dtype)
    if carried is None or any(a is not None and (a.dtype != carried or a.ndim != 6 or a.shape[1] != 2)
                              for a in (payload.kv, window_kv)):
        raise InvalidRequestError(f"KV of {payload.request_id!r} is not [layers, 2, blocks, block_size, heads, "
                                  f"head_dim] arrays of its kv_dtype {payload.kv_dtype!r}")
    if (payload.kv.shape[0] + len(payload.window_layers) != num_layers
            or not set(payload.window_layers) <= set(range(num_layers))
            or len(set(payload.window_layers)) != len(payload.window_layers)
            or (window_kv is None) != (not payload.window_layers)
            or (window_kv is not None and (window_kv.shape[0] != len(payload.window_layers)
                                           or window_kv.shape[2] != expected - min(payload.window_first_block, expected)
                                           or window_kv.shape[3:] != payload.kv.shape[3:]))):
        raise InvalidRequestError(f"KV of {payload.request_id!r} does not hold this model's {num_layers} layers' "
                                  f"blocks {first} to {expected}")
    request = Request(payload.request_id, payload.prompt_token_ids, payload.params, engine.clock())
    request.output_token_ids = list(payload.output_token_ids)
    request.num_computed_tokens = payload.num_computed_tokens
    request.status = RequestStatus.WAITING
    if cached is None:
        cached = engine.scheduler.cached_import_prefix(request.sequence_key, request.num_computed_tokens)
    cached = cached[:expected]
    held_from = payload.window_held_from
    if len(cached) < first:  # evicted since the front end asked: recompute from the last one held
        request.num_computed_tokens = len(cached) * block_size
        held_from = 0  # nothing of the payload is written: the window blocks in sight are this engine's
    if payload.sampler_state is not None:  # checked before the request is queued: a bad one must not leave it there
        try:
            check_generator_state(payload.sampler_state)
        except (TypeError, ValueError) as e:
            raise InvalidRequestError(f"KV of {payload.request_id!r} carries a sampler state that is not one: {e}") from e

    # Where each layer's blocks are in the payload: (array, its row, the block its data starts at).
    exporter_main = [layer for layer in range(num_layers) if layer not in payload.window_layers]
    rows = {layer: (payload.kv, row, first) for row, layer in enumerate(exporter_main)}
    rows.update({layer: (window_kv, row, payload.window_first_block) for row, layer in enumerate(payload.window_layers)})

    def tensor(layers: list[int], start: int, count: int) -> np.ndarray:
        """Those layers' blocks start .. start + count - 1 from the payload, as the runner takes them."""
        parts = []
        for layer in layers:
            array, row, array_first = rows[layer]
            if start < array_first:  # the exporter had given them back: no KV to write
                raise InvalidRequestError(f"KV of {payload.request_id!r} lacks layer {layer}'s blocks from {start}")
            parts.append(array[row, :, start - array_first : start - array_first + count])
        # What Ray hands over is a read-only view of the object store: np.stack copies it.
        return np.stack(parts)

    def write_kv(blocks: list[int], window_blocks: list[int] | None) -> None:
        if not blocks:
            return
        start = len(cached)
        main = main_layers if window_blocks is not None else main_layers + window_layers
        runner.write_kv_layers(main, blocks, tensor(main, start, len(blocks)))
        if window_blocks is not None and window_layers:
            held = leading_null_blocks(window_blocks)
            if held < len(window_blocks):
                runner.write_kv_layers(window_layers, window_blocks[held:],
                                       tensor(window_layers, start + held, len(window_blocks) - held))

    engine.add_prefilled_request(request, cached, write_kv, held_from)
    if payload.sampler_state is not None:
        runner.sampler.set_generator_state(request, payload.sampler_state)
    request.times.first_token = request.times.first_scheduled = request.arrival_time
    return request
