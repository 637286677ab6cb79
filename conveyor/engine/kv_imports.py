"""Prefilled requests waiting to enter the engine that takes them over (prefill/decode disaggregation).

One rule, for the Ray decode workers (conveyor/distributed/worker.py) and the simulator's decode
workers (conveyor/sim/disagg.py): requests enter in arrival order and the head waits for blocks
rather than being overtaken (no starvation); an import may take only the free blocks the
scheduler has not promised to its own requests (Scheduler.import_fits); one that
could never fit this engine's pool is refused at once instead of waiting forever. The leading
blocks of an import that this engine's prefix cache holds (a shared system prompt, an earlier
turn) are taken from it, not written again, and need no free block unless they are evictable.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Generic, Iterator, Protocol, TypeVar

from conveyor.engine.llm_engine import LLMEngine
from conveyor.errors import InvalidRequestError
from conveyor.kv import SequenceKey, blocks_for


class Importable(Protocol):
    @property
    def request_id(self) -> str: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def sequence_key(self) -> SequenceKey: ...

    @property
    def window_held_from(self) -> int:
        """The first block the exporter's sliding-window pool still held (0 without one)."""
        ...


Item = TypeVar("Item", bound=Importable)


def blocks_to_run(num_computed_tokens: int, block_size: int) -> int:
    """What an imported request needs to run: its KV and the slot of its next token."""
    return blocks_for(num_computed_tokens + 1, block_size)


class ImportQueue(Generic[Item]):
    def __init__(self) -> None:
        self._items: deque[Item] = deque()

    def push(self, item: Item) -> None:
        self._items.append(item)

    def remove(self, request_id: str) -> list[Item]:
        """Take the request's items out (it was aborted before it got in)."""
        gone = [item for item in self._items if item.request_id == request_id]
        for item in gone:
            self._items.remove(item)
        return gone

    def clear(self) -> list[Item]:
        items = list(self._items)
        self._items.clear()
        return items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Item]:
        return iter(self._items)

    def take(self, engine: LLMEngine, admit: Callable[[Item, list[int]], None],
             refuse: Callable[[Item, InvalidRequestError], None]) -> None:
        """Admit the head while it fits: `admit(item, cached)` queues it in `engine` with the
        leading blocks of it that the engine's prefix cache holds (LLMEngine.add_prefilled_request)."""
        scheduler = engine.scheduler
        block_size, num_blocks = scheduler.kv.block_size, scheduler.kv.num_blocks
        while self._items:
            item = self._items[0]
            needed = blocks_to_run(item.num_computed_tokens, block_size)
            held_from = item.window_held_from
            window_pool = scheduler.kv.window_pool
            window_needed = scheduler.kv.window_blocks_to_start(
                item.num_computed_tokens + 1, (), scheduler.kv.import_window_start(item.num_computed_tokens, held_from))
            if needed > num_blocks or (window_pool is not None and window_needed > window_pool.num_blocks - 1):
                self._items.popleft()  # it would wait forever
                refuse(item, InvalidRequestError(f"request {item.request_id!r} needs {needed} KV blocks; "
                                                 f"this engine has {num_blocks}"))
                continue
            cached = scheduler.cached_import_prefix(item.sequence_key, item.num_computed_tokens)
            if not scheduler.import_fits(item.num_computed_tokens, cached, held_from):
                return
            self._items.popleft()
            admit(item, cached)
