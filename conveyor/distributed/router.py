"""Which worker takes a request: the live one of the right role with the least outstanding tokens.

Outstanding tokens of a worker = prompt tokens of its requests still waiting for their first
token + one per sample it is decoding. Counted afresh from the front end's own table of requests
at every pick, so the figure can never drift from what the workers really hold; a long prompt
thus steers the next requests away from the worker that is prefilling it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

log = logging.getLogger("conveyor.distributed")


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


def pick(workers: Iterable[WorkerHandle], role: str, requests: Iterable[Assignment],
         exclude: WorkerHandle | None = None) -> WorkerHandle | None:
    """The least loaded live worker of `role` (the first one on ties); None if none is alive."""
    candidates = [w for w in workers if w.role == role and w.alive and w is not exclude]
    if not candidates:
        return None
    loads = {id(w): 0 for w in candidates}
    for r in requests:
        if r.worker is not None and id(r.worker) in loads:
            loads[id(r.worker)] += r.outstanding_tokens()
    return min(candidates, key=lambda w: loads[id(w)])

