"""What the HTTP front end needs from an engine: the local AsyncEngine and the Ray deployment
(conveyor/distributed) both provide it, so conveyor/api does not know which one it talks to.

Events put into a request's sink: RequestOutput per progress, then the finished output; or
`Aborted` / `Failed` (conveyor.engine.async_engine) as the last event of a request that did not
finish normally.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Protocol, Sequence

from conveyor.model.facts import ModelFacts
from conveyor.sampling.params import SamplingParams
from conveyor.sampling.pooling import PoolingParams


class EngineClient(Protocol):
    on_report: Callable[[Any], None] | None  # gets a StepReport per engine iteration (metrics)

    @property
    def tokenizer(self) -> Any: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def capacity(self) -> int:
        """Most tokens (prompt + output) one request can hold: the context or the whole KV cache."""
        ...

    @property
    def is_running(self) -> bool: ...

    @property
    def default_pooling(self) -> PoolingParams:
        """What an embedding request pools by unless it says (LLMEngine.default_pooling)."""
        ...

    @property
    def embedding_size(self) -> int | None:
        """How many numbers an embedding has (LLMEngine.embedding_size)."""
        ...

    @property
    def model_facts(self) -> ModelFacts | None:
        """What the served file is (LLMEngine.model_facts)."""
        ...

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None: ...

    def stop(self, timeout: float = 10.0) -> None: ...

    async def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                          sink: asyncio.Queue, arrival_time: float | None = None) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def abort_all(self) -> None: ...

    def stop_sample(self, request_id: str, index: int, stop_reason: str | None = None) -> None:
        """End sample `index` of a request whose text reached a stop string (found by the front
        end, where the text is made), so that its KV is freed at once."""
        ...
