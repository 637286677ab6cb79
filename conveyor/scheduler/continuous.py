"""Iteration-level (continuous) batching, Orca/vLLM style.

Every step: running requests first, in admission order, each gets its pending tokens (1 for a
decode, a chunk for a prefill) under the token budget; then waiting requests join in queue order
(FCFS, or by priority: scheduler/queue.py) while the budget, max_num_seqs and free blocks allow.
When blocks run out, the most recently admitted running request (or the least urgent) is preempted
(its blocks freed, recomputed later when the queue comes back to it).
"""
from __future__ import annotations

from conveyor.request import Request, RequestStatus
from conveyor.scheduler.base import Scheduler, SchedulerOutput


class ContinuousScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.running: list[Request] = []

    @property
    def num_running(self) -> int:
        return len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for request in list(self._service_order(self.running)):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._tokens_to_schedule(request, budget)
            if n and self._reserve(request, n, self.running, out):
                budget -= n

        # Admitting while preempting would only hand the freed blocks straight back: thrash.
        # A request of n samples holds n seats from admission on, though its forks come later.
        seats = sum(1 + r.pending_forks for r in self.running)
        while self.waiting and budget > 0 and not out.preempted:
            request = self.waiting[0]
            # An empty batch always takes the head, so a cap lowered under a request's n cannot stall it.
            if seats and seats + 1 + request.pending_forks > self.max_num_seqs:
                break
            cached = self._cached_prefix(request)
            n = self._tokens_to_schedule(request, budget, cached)
            if n and not self.running:
                self._evict_waiting(request, self._total(request, n, cached), out, cached)
            if n == 0 or not self.kv.can_allocate(request.request_id, self._total(request, n, cached), cached):
                break
            self.waiting.popleft()
            seats += 1 + request.pending_forks
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._reserve(request, n, [], out, cached)
            budget -= n
        return self._finish_schedule(out)

    def _admit_fork(self, child: Request) -> None:
        self.running.append(child)

    def _on_preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        self.waiting.requeue(request)

    def _on_finish(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
