"""What a cost model sees of one step: token counts and attention work, from the scheduler's decision.

Computed before the step's results are applied, so `num_computed_tokens` is each request's
context before this step's tokens. A scheduled entry of one token is a decode row, as the real
runner treats it (conveyor/runner/inputs.py): decode rows are attended in one padded batch. So is
each row of a decode that verifies speculative tokens (each attends up to its own position), and
all of its rows are sampled. With a sliding window (a model whose some layers see only the last
`window` positions) the window_ fields count what those layers attend: each query at most `window`
keys, itself included.
"""
from __future__ import annotations

from dataclasses import dataclass

from conveyor.scheduler import SchedulerOutput


@dataclass(slots=True)
class StepShape:
    prefill_tokens: int = 0  # tokens of multi-token chunks
    decode_tokens: int = 0  # single-token rows
    prefill_chunks: int = 0
    sampled: int = 0  # rows whose logits are computed and sampled (incl. forked samples)
    prefill_attention: float = 0.0  # query-key pairs of the prefill chunks (causal, over their cache)
    prefill_cached: int = 0  # cached tokens the prefill chunks read back
    # Query-key pairs of the chunks that continue a cached prefix, unhalved: conveyor attends those
    # with an explicit mask over the whole context (a fresh prompt takes the causal kernel).
    cached_chunk_pairs: int = 0
    decode_context: int = 0  # sum of the decode rows' context lengths (keys each one reads)
    max_decode_context: int = 0  # the longest: conveyor pads every decode row to it
    # The same in a sliding-window layer, as `of`, decode_shape and prefill_shape set them (equal to
    # the above without a window; a shape built by hand for a window model must set them too).
    window_prefill_attention: float = 0.0
    window_prefill_cached: int = 0
    window_decode_context: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    @property
    def decode_padded_context(self) -> int:
        return self.decode_tokens * self.max_decode_context

    @classmethod
    def of(cls, out: SchedulerOutput, window: int | None = None) -> "StepShape":
        shape = cls(sampled=len(out.forks))
        for request, n in out.scheduled:
            start = request.num_computed_tokens
            in_window = keys_in_window(start, n, window)
            if start + n == request.num_known_tokens:
                shape.sampled += 1 + len(request.spec_token_ids)
            if request.decodes(n):
                shape.decode_tokens += n
                shape.decode_context += n * start + n * (n + 1) // 2
                shape.window_decode_context += in_window
                if start + n > shape.max_decode_context:
                    shape.max_decode_context = start + n
            else:
                shape.prefill_tokens += n
                shape.prefill_chunks += 1
                shape.prefill_cached += start
                shape.prefill_attention += n * (start + (n + 1) / 2)
                shape.window_prefill_cached += start if window is None else min(start, window - 1)
                shape.window_prefill_attention += in_window
                if start:
                    shape.cached_chunk_pairs += n * (start + n)
        return shape


def keys_in_window(start: int, n: int, window: int | None) -> int:
    """Keys the queries at positions start .. start + n - 1 read: the query at p reads p + 1, or at
    most `window` (None: no window)."""
    first, last = start + 1, start + n
    if window is None or last <= window:
        return (first + last) * n // 2
    if first > window:
        return window * n
    return (first + window) * (window - first + 1) // 2 + window * (last - window)


def decode_shape(contexts: list[int], window: int | None = None) -> StepShape:
    """A step of decode rows only, at the given context lengths (for knee and unit arithmetic)."""
    return StepShape(decode_tokens=len(contexts), sampled=len(contexts), decode_context=sum(contexts),
                     max_decode_context=max(contexts, default=0),
                     window_decode_context=sum(contexts if window is None else (min(c, window) for c in contexts)))


def prefill_shape(num_tokens: int, cached: int = 0, sampled: bool = True, window: int | None = None) -> StepShape:
    """One prefill chunk of `num_tokens` after `cached` tokens already in the cache."""
    return StepShape(prefill_tokens=num_tokens, prefill_chunks=1, sampled=int(sampled), prefill_cached=cached,
                     prefill_attention=num_tokens * (cached + (num_tokens + 1) / 2),
                     cached_chunk_pairs=num_tokens * (cached + num_tokens) if cached else 0,
                     window_prefill_attention=keys_in_window(cached, num_tokens, window),
                     window_prefill_cached=cached if window is None else min(cached, window - 1))
