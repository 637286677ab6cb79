"""The waiting queue: requests in the order they will be admitted.

fcfs: arrival order, and a preempted request goes back to the front (it has waited longest).
priority (vLLM's `--scheduling-policy priority`): the lowest `priority` value first, then the
earliest arrival, and a preempted request goes back by that same key; preemption then takes the
running request with the highest key first (the least urgent, the latest among equals).
"""
from __future__ import annotations

from bisect import bisect_right
from collections import deque
from typing import Iterator

from conveyor.config import SCHEDULING_POLICIES
from conveyor.request import Request


def priority_key(request: Request) -> tuple[int, float]:
    return request.sampling_params.priority, request.arrival_time


class WaitingQueue:
    def __init__(self, scheduling_policy: str = SCHEDULING_POLICIES[0]) -> None:
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}, not {scheduling_policy!r}")
        self.by_priority = scheduling_policy == "priority"
        self._items: deque[Request] = deque()

    def add(self, request: Request) -> None:
        """A new arrival."""
        if self.by_priority:
            self._items.insert(bisect_right(self._items, priority_key(request), key=priority_key), request)
        else:
            self._items.append(request)

    def requeue(self, request: Request) -> None:
        """A preempted request, back to wait for its turn again."""
        if self.by_priority:
            self.add(request)
        else:
            self._items.appendleft(request)

    def popleft(self) -> Request:
        return self._items.popleft()

    def remove(self, request: Request) -> None:
        self._items.remove(request)

    def __getitem__(self, index: int) -> Request:
        return self._items[index]

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def __reversed__(self) -> Iterator[Request]:
        return reversed(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request: object) -> bool:
        return request in self._items
