"""What crosses the wire between the front end and the engine workers (all picklable, no Ray)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from conveyor.errors import ConveyorError
from conveyor.model.facts import ModelFacts
from conveyor.sampling.params import SamplingParams
from conveyor.sampling.pooling import PoolingParams

ROLES = ("replica", "prefill", "decode")  # replica: prefill and decode together (colocated)


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's engine as the front end needs to know it."""

    name: str
    role: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    kv_block_bytes: int
    max_num_seqs: int = 0  # its running-batch cap (admission counts free seats as not waiting)
    default_pooling: PoolingParams = PoolingParams()  # what its embeddings pool by (LLMEngine.default_pooling)
    embedding_size: int | None = None
    model_facts: ModelFacts | None = None  # what its file is (LLMEngine.model_facts)


@dataclass(frozen=True)
class TokenEvent:
    """One sample's progress in one step: a slim RequestOutput (no prompt, no full token list)."""

    request_id: str
    index: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str | None = None
    logprobs: list[dict[int, float]] | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV the worker's prefix cache held
    ended_on_stop_token: bool = False  # RequestOutput's
    # With prompt_logprobs, on a request's first event (from the prefill worker under P/D).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    embedding: list[float] | None = None  # an embedding request's vector, on its final event


@dataclass(frozen=True)
class HandoverReady:
    """A prefill worker computed the prompt and the first token; its KV blocks wait for a taker."""

    request_id: str


@dataclass(frozen=True)
class KVImported:
    """A decode worker took a request's KV over (before any token of it from there): bytes that
    came, and bytes left out because its prefix cache held those blocks."""

    request_id: str
    num_bytes: int
    num_cached_bytes: int


@dataclass(frozen=True)
class RequestError:
    """The worker's engine ended this request with an error (a step raised with it in the batch, or
    its own constraints left no token); nothing more will come. The error keeps its type (and a
    refusal its `param`), so the front end answers as a single engine would: a 400 for the
    request's own constraints, a 500 for the engine's failure."""

    request_id: str
    error: ConveyorError


@dataclass
class WorkerLoadReport:
    """The worker's own view after its last iteration, for /metrics."""

    num_running: int = 0
    num_waiting: int = 0
    num_parked: int = 0  # prefilled requests whose KV waits for a decode worker
    kv_usage: float = 0.0
    num_preemptions: int = 0
    # (requests, tokens, StepStats.extra: e.g. the SLO controller's state) per step since the last poll
    steps: list[tuple[int, int, dict[str, float]]] = field(default_factory=list)


@dataclass
class PollResult:
    events: list[Any]  # TokenEvent | HandoverReady | KVImported | RequestError, in the order they happened
    load: WorkerLoadReport
    last_seq: int  # the number of the last event: the next poll passes it as `after`


@dataclass
class KVPayload:
    """A request in the middle of its life: its tokens, where it stands, and its KV blocks' content."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    num_computed_tokens: int
    # numpy array [layers, 2, num_blocks, block_size, kv_heads, head_dim] (zero-copy in Ray): the
    # request's blocks from `first_block` on (the importer said its prefix cache holds those before),
    # of every layer but `window_layers`
    kv: Any
    kv_dtype: str  # "float32" or "float16": the exporter's KV cache (numpy's dtype name)
    sampler_state: Any = None  # the request's own generator state when it samples with a seed
    first_block: int = 0
    # Sliding-window layers with a pool of their own on the exporter: it had given back their blocks
    # before `window_held_from` (out of sight); `window_kv` holds those layers' blocks from
    # max(first_block, window_held_from) on, in the order of `window_layers`.
    window_held_from: int = 0
    window_layers: tuple[int, ...] = ()
    window_kv: Any = None

    @property
    def nbytes(self) -> int:
        return int(self.kv.nbytes) + (int(self.window_kv.nbytes) if self.window_kv is not None else 0)

    @property
    def cached_nbytes(self) -> int:
        """What the blocks before first_block would have added (the importer's prefix cache held
        them); of the window layers, only those the exporter still held."""
        def block_bytes(array: Any) -> int:
            return int(array.dtype.itemsize) * math.prod(array.shape[:2]) * math.prod(array.shape[3:])

        window = 0 if self.window_kv is None else max(0, self.first_block - self.window_held_from)
        return self.first_block * block_bytes(self.kv) + (window * block_bytes(self.window_kv) if window else 0)

    @property
    def window_first_block(self) -> int:
        """The first block `window_kv` holds."""
        return max(self.first_block, self.window_held_from)
