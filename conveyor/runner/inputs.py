"""Turns a scheduler decision into the flat arrays one forward pass needs (int64 numpy arrays).

Row order: single-token rows (decodes) first, so attention can take them in one batched call,
then multi-token prefill chunks. Logits rows follow the scheduler's order of sampling requests.

A decode with speculative tokens is as many decode rows as it has tokens, each attending to the
request's blocks up to its own position (a row reads only earlier positions and its own, which the
layer's run of rows holding it, or an earlier run, has written: llama.row_runs): each row is
computed exactly as a step of one token at that position would compute it, so verifying a proposal
changes no result.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from conveyor.kv import blocks_for
from conveyor.model.attention import AttentionMetadata, PrefillChunk
from conveyor.request import Request
from conveyor.scheduler import SchedulerOutput


@dataclass
class ModelInputs:
    input_ids: np.ndarray
    positions: np.ndarray
    meta: AttentionMetadata
    # The rows of each sampling request, in out.sampling_requests() order (one, or 1 + its
    # speculative tokens: sampling_rows), then the prompt rows below.
    logits_indices: np.ndarray
    # Requests asking for prompt logprobs: (request, first position, count) of each one's run of
    # rows that follows the sampling rows in logits_indices; the row at position p scores the
    # prompt token at p + 1. Only positions whose logprobs the request does not have yet.
    prompt_logprob_rows: list[tuple[Request, int, int]] = field(default_factory=list)
    # Per sampling request: its logits rows (1 + the speculative tokens it verifies).
    sampling_rows: list[int] = field(default_factory=list)
    # Embedding requests: (request, count) of each one's run of rows at the end of logits_indices,
    # the positions it pools this step that it has not pooled before (Request.pooled_positions).
    pooled_rows: list[tuple[Request, int]] = field(default_factory=list)

    @property
    def num_pooled_rows(self) -> int:
        return sum(n for _, n in self.pooled_rows)

    @property
    def num_sampling_rows(self) -> int:
        return len(self.logits_indices) - sum(n for _, _, n in self.prompt_logprob_rows) - self.num_pooled_rows


def _int64(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def build_inputs(out: SchedulerOutput, block_size: int) -> ModelInputs:
    """The step's rows; each request's KV slots from its table in `out.block_tables` (blocks of
    block_size tokens), and for a model's sliding-window layers from `out.window_tables`
    (meta.window_group)."""
    bs = block_size
    # A request verifying speculative tokens is scheduled all of them with its last sampled token.
    # A prompt's tokens are always a prefill chunk, its last one alone too (what a prefix hit or a
    # chunk leaves): the two attention kernels sum in different orders, and a token's result should
    # not depend on how much of its prompt the cache held.
    decodes = [(r, n) for r, n in out.scheduled if r.decodes(n)]
    decoding = {r.request_id for r, _ in decodes}
    prefills = [(r, n) for r, n in out.scheduled if r.request_id not in decoding]
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    windowed = bool(out.window_tables)
    window_slots: list[int] = []
    window_chunks: list[PrefillChunk] = []
    window_decode_tables: list[list[int]] = []
    last_row: dict[str, int] = {}
    first_row: dict[str, int] = {}

    # Rows computing prompt tokens, as ranges: a chunk's, or the prompt part of a recompute after
    # preemption (which covers prompt then output tokens).
    prompt_rows: list[tuple[int, int]] = []

    def add_prompt_rows(first: int, start: int, n: int, num_prompt: int) -> None:
        count = min(n, num_prompt - start)
        if count <= 0:
            return
        if prompt_rows and prompt_rows[-1][1] == first:
            prompt_rows[-1] = (prompt_rows[-1][0], first + count)
        else:
            prompt_rows.append((first, first + count))

    decode_tables: list[list[int]] = []
    context_lens: list[int] = []
    for request, n in decodes:
        start = request.num_computed_tokens
        table = out.block_tables[request.request_id]
        first_row[request.request_id] = len(input_ids)
        add_prompt_rows(len(input_ids), start, n, request.num_prompt_tokens)
        for pos in range(start, start + n):
            input_ids.append(request.token_at(pos))
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            decode_tables.append(table)
            context_lens.append(pos + 1)
        if windowed:
            window = out.window_tables[request.request_id]
            window_slots.extend(window[pos // bs] * bs + pos % bs for pos in range(start, start + n))
            window_decode_tables.extend([window] * n)
        last_row[request.request_id] = len(input_ids) - 1

    chunks: list[PrefillChunk] = []
    for request, n in prefills:
        start = request.num_computed_tokens
        table = out.block_tables[request.request_id]
        chunks.append(PrefillChunk(len(input_ids), n, start, _int64(table[: blocks_for(start + n, bs)])))
        first_row[request.request_id] = len(input_ids)
        add_prompt_rows(len(input_ids), start, n, request.num_prompt_tokens)
        input_ids.extend(request.token_slice(start, start + n))
        positions.extend(range(start, start + n))
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
        last_row[request.request_id] = len(input_ids) - 1
        if windowed:
            window = out.window_tables[request.request_id]
            window_chunks.append(PrefillChunk(chunks[-1].token_start, n, start,
                                              _int64(window[: blocks_for(start + n, bs)])))
            window_slots.extend(window[p // bs] * bs + p % bs for p in range(start, start + n))

    width = max((blocks_for(c, bs) for c in context_lens), default=0)
    decode_context_lens = _int64(context_lens) if decodes else None

    def metadata(slots: list[int], tables: list[list[int]], chunks: list[PrefillChunk],
                 window_group: AttentionMetadata | None = None) -> AttentionMetadata:
        """One KV pool's view of the step: its slots and its block tables, padded with block 0."""
        padded = np.array([t[:width] + [0] * (width - min(len(t), width)) for t in tables],
                          dtype=np.int64).reshape(len(tables), width) if decodes else None
        return AttentionMetadata(slot_mapping=_int64(slots), num_decode_tokens=len(context_lens),
                                 decode_block_tables=padded, decode_context_lens=decode_context_lens, prefills=chunks,
                                 prompt_rows=tuple(prompt_rows), window_group=window_group)

    for parent, child in out.forks:  # a new sample reads its parent's logits
        last_row[child.request_id] = last_row[parent.request_id]
    logits_rows: list[int] = []
    sampling_rows: list[int] = []
    for request in out.sampling_requests():
        last = last_row[request.request_id]
        count = 1 + len(request.spec_token_ids)
        logits_rows.extend(range(last - count + 1, last + 1))
        sampling_rows.append(count)
    logprob_rows = []
    for request, n in out.scheduled:
        if request.sampling_params.prompt_logprobs is None:
            continue
        # Positions whose next token is a prompt token not scored yet (a recompute scores none).
        start = max(request.num_computed_tokens, len(request.prompt_logprobs or [None]) - 1)
        end = min(request.num_computed_tokens + n, request.num_prompt_tokens - 1)
        if start < end:
            row = first_row[request.request_id] + start - request.num_computed_tokens
            logits_rows.extend(range(row, row + end - start))
            logprob_rows.append((request, start, end - start))
    pooled_rows = []
    for request, n in out.scheduled:
        pooled = request.pooled_positions
        if pooled is None or request.num_pooled == len(pooled):
            continue
        start = max(request.num_computed_tokens, pooled[request.num_pooled])
        end = min(request.num_computed_tokens + n, pooled.stop)
        if start < end:
            row = first_row[request.request_id] + start - request.num_computed_tokens
            logits_rows.extend(range(row, row + end - start))
            pooled_rows.append((request, end - start))
    window_group = metadata(window_slots, window_decode_tables, window_chunks) if windowed else None
    return ModelInputs(
        input_ids=_int64(input_ids),
        positions=_int64(positions),
        meta=metadata(slots, decode_tables, chunks, window_group),
        logits_indices=_int64(logits_rows),
        prompt_logprob_rows=logprob_rows,
        sampling_rows=sampling_rows,
        pooled_rows=pooled_rows,
    )
