"""Which worker takes a request.

Least load: the live worker of the right role with the least outstanding tokens. Outstanding
tokens of a worker = prompt tokens its requests still have to compute before their first token
(those the router expects it to find in its prefix cache left out) + one per sample it is
decoding. Counted afresh from the front end's own table of requests at every pick, so the figure
can never drift from what the workers really hold; a long prompt thus steers the next requests
away from the worker that is prefilling it.

Cache-aware (the default for requests that enter a deployment: replicas, prefill workers): the
worker where the request costs least, cost = its outstanding tokens + the prompt tokens it would
have to compute, i.e. the prompt minus the longest prefix of it that worker is expected to hold
in its prefix cache. One number, in tokens, trades a cache hit against a queue: a conversation's
next turn goes back to the replica holding its history unless that replica is behind the others
by more than the history is long. A request that matches nowhere starts a new history, which will
stay where it starts: it goes where the fewest histories are live (a history is named by its first
block's key and counts exp(-age / RECENT_S), age since a request of it was last routed), unless
that worker is behind the least loaded by more than the request is long. Counting histories, not
requests or tokens, is what keeps conversations split evenly: they stick to their replica, so a
split decided by instantaneous load stays uneven for their whole life.

How the router knows what a worker caches: a `PrefixIndex` per worker, the chain keys (the KV
manager's own `iter_block_keys`) of the full blocks of every prompt it sent there and of its
output once finished, least recently used first, at most as many as the worker has KV blocks. It
is an estimate (the worker may have evicted a block sooner); a wrong guess costs a recompute,
never a wrong answer. Per request it hashes the prompt once (one blake2b per block) and looks the
keys up in one dict per worker.
"""
from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence

from conveyor.request import sequence_key
from conveyor.sampling.params import SamplingParams

log = logging.getLogger("conveyor.distributed")

ROUTING_POLICIES = ("cache-aware", "least-load")  # the first is the default
ROUTER_KEYS = "router"  # the chain's root: keys only need to agree with each other, not with a worker's own
_DEFAULT_PARAMS = SamplingParams()  # a prompt routed without its request's parameters
RECENT_S = 30.0  # how long a history counts as live on its worker after its last request (time constant)
FORGOTTEN_AFTER_S = 10 * RECENT_S  # a history idle that long weighs < 1e-4: dropped


@dataclass(eq=False)
class WorkerHandle:
    name: str
    role: str  # replica, prefill or decode
    actor: Any  # a Ray actor handle of conveyor.distributed.worker.EngineWorker
    info: Any = None  # WorkerInfo, once started
    alive: bool = True
    last_load: Any = None  # the worker's last WorkerLoadReport

    def tell(self, method: str, request_id: str) -> None:
        """Fire and forget (abort, release): nothing waits for the answer, and a dead worker holds
        nothing any more."""
        if self.alive:
            try:
                getattr(self.actor, method).remote(request_id)
            except Exception:  # Ray is shutting down: the workers go with it  # noqa: BLE001
                log.debug("could not %s %s on %s", method, request_id, self.name)


class Assignment(Protocol):
    worker: WorkerHandle | None

    def outstanding_tokens(self) -> int: ...


def outstanding_tokens(worker: WorkerHandle, requests: Iterable[Assignment]) -> int:
    return sum(r.outstanding_tokens() for r in requests if r.worker is worker)


def _loads(candidates: Sequence[WorkerHandle], requests: Iterable[Assignment]) -> dict[int, int]:
    loads = {id(w): 0 for w in candidates}
    for r in requests:
        if r.worker is not None and id(r.worker) in loads:
            loads[id(r.worker)] += r.outstanding_tokens()
    return loads


def _candidates(workers: Iterable[WorkerHandle], role: str, exclude: WorkerHandle | None) -> list[WorkerHandle]:
    return [w for w in workers if w.role == role and w.alive and w is not exclude]


def pick(workers: Iterable[WorkerHandle], role: str, requests: Iterable[Assignment],
         exclude: WorkerHandle | None = None) -> WorkerHandle | None:
    """The least loaded live worker of `role` (the first one on ties); None if none is alive."""
    candidates = _candidates(workers, role, exclude)
    if not candidates:
        return None
    loads = _loads(candidates, requests)
    return min(candidates, key=lambda w: loads[id(w)])


class PrefixIndex:
    """The block keys a worker is expected to hold in its prefix cache, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` it holds (those are touched, as a hit refreshes a worker's cache)."""
        n = 0
        for key in keys:
            if key not in self._keys:
                break
            self._keys.move_to_end(key)
            n += 1
        return n


class LiveHistories:
    """The histories routed to a worker, each weighing exp(-age / RECENT_S), age since a request of
    it was last routed there; their sum kept up to date in O(1) per change."""

    def __init__(self) -> None:
        self._last: OrderedDict[bytes, float] = OrderedDict()  # a history's first block key -> when, oldest first
        self._sum, self._at = 0.0, 0.0  # the sum of weights as of `_at`

    def __len__(self) -> int:
        return len(self._last)

    def weight(self, now: float, excluding: bytes | None = None) -> float:
        total = self._sum * math.exp(-(now - self._at) / RECENT_S)
        if excluding is not None and excluding in self._last:
            total -= math.exp(-(now - self._last[excluding]) / RECENT_S)
        return max(total, 0.0)

    def touch(self, history: bytes, now: float) -> None:
        self._set(self.weight(now, history) + 1.0, now)
        self._last[history] = now
        self._last.move_to_end(history)

    def forget_idle(self, now: float) -> None:
        while self._last and now - next(iter(self._last.values())) > FORGOTTEN_AFTER_S:
            self.remove(next(iter(self._last)), now)

    def remove(self, history: bytes, now: float) -> None:
        if history in self._last:
            self._set(self.weight(now, history), now)
            del self._last[history]

    def _set(self, total: float, now: float) -> None:
        self._sum, self._at = total, now


@dataclass(frozen=True)
class Route:
    worker: WorkerHandle
    expected_cached_tokens: int  # the prompt tokens the router expects the worker's cache to hold


class Router:
    """Places requests (see the module docstring); one per front end."""

    def __init__(self, policy: str = ROUTING_POLICIES[0], clock: Callable[[], float] = time.monotonic) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {ROUTING_POLICIES}, not {policy!r}")
        self.policy = policy
        self._clock = clock
        self._indexes: dict[str, PrefixIndex] = {}
        self._histories: dict[str, LiveHistories] = {}

    def _index(self, worker: WorkerHandle) -> PrefixIndex:
        index = self._indexes.get(worker.name)
        if index is None:
            index = self._indexes[worker.name] = PrefixIndex(worker.info.num_kv_blocks)
        return index

    def route(self, workers: Iterable[WorkerHandle], role: str, requests: Iterable[Assignment],
              prompt: Sequence[int], params: SamplingParams | None = None) -> Route | None:
        """Where a new request of `role` goes; None if no worker of that role is alive. The
        request's `params` key its blocks (conveyor/request.py's sequence_key), as the workers'
        caches do."""
        candidates = _candidates(workers, role, None)
        if not candidates:
            return None
        loads = _loads(candidates, requests)
        if self.policy == "least-load" or any(w.info is None for w in candidates):  # (info: once started)
            return Route(min(candidates, key=lambda w: loads[id(w)]), 0)
        keys = self._keys(candidates[0], prompt, params)
        # Never all of the prompt: the worker computes at least its last token (as its scheduler does).
        hits = {id(w): min(self._index(w).match(keys) * w.info.block_size, len(prompt) - 1) for w in candidates}
        now = self._clock()
        history = keys[0] if keys else None
        if any(hits.values()):
            best = min(candidates, key=lambda w: loads[id(w)] + len(prompt) - hits[id(w)])
        else:
            # A new history (a conversation's first turn) stays where it starts, turn after turn:
            # it goes where the fewest histories are live, so that conversations spread evenly;
            # unless that worker is behind the least loaded by more than this request is long.
            least = min(loads.values())
            near = [w for w in candidates if loads[id(w)] - least <= len(prompt)]
            best = min(near, key=lambda w: (self._live_histories(w, now, history), loads[id(w)]))
        self._index(best).add(keys)
        self._touch_history(candidates, best, history, now)
        log.debug("route %d tokens to %s: hits %s, loads %s, %s", len(prompt), best.name,
                  [hits[id(w)] for w in candidates], [loads[id(w)] for w in candidates],
                  "history" if any(hits.values()) else "new")
        return Route(best, hits[id(best)])

    def _live_histories(self, worker: WorkerHandle, now: float, excluding: bytes | None) -> float:
        histories = self._histories.get(worker.name)
        return histories.weight(now, excluding) if histories is not None else 0.0

    def _touch_history(self, candidates: Sequence[WorkerHandle], best: WorkerHandle, history: bytes | None,
                       now: float) -> None:
        """The history now lives on `best`, and on no other worker; long-idle ones are forgotten."""
        if history is not None:
            for w in candidates:
                if w is not best and w.name in self._histories:
                    self._histories[w.name].remove(history, now)
            self._histories.setdefault(best.name, LiveHistories()).touch(history, now)
        for histories in self._histories.values():
            histories.forget_idle(now)

    def record(self, worker: WorkerHandle, token_ids: Sequence[int], params: SamplingParams | None = None) -> None:
        """A request's prompt and output as the worker computed them: what its cache now holds."""
        if self.policy == "cache-aware" and worker.info is not None:
            self._index(worker).add(self._keys(worker, token_ids, params))

    def forget(self, worker: WorkerHandle) -> None:
        """A dead worker's cache is gone with it."""
        self._indexes.pop(worker.name, None)
        self._histories.pop(worker.name, None)

    @staticmethod
    def _keys(worker: WorkerHandle, token_ids: Sequence[int], params: SamplingParams | None) -> list[bytes]:
        key = sequence_key(params or _DEFAULT_PARAMS, lambda start, end: token_ids[start:end])
        block_size = worker.info.block_size
        return list(key.block_keys(ROUTER_KEYS, len(token_ids) // block_size, block_size))
