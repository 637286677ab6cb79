"""Request-level (static) batching: the baseline that continuous batching is measured against.

Exactly what it does:
- When no batch is in flight, it takes up to max_num_seqs requests from the head of the queue
  (FCFS) as one batch. Nobody else is admitted until every member of that batch has finished.
- A finished member stops computing but keeps its place: the batch does not shrink its slot count
  for the purpose of admission, so short requests leave idle capacity behind (the waste under study).
- Within the batch, tokens are handed out exactly as the continuous policy does (same token budget,
  same chunked-prefill switch, same paged KV cache). The only difference is when requests may join,
  so the comparison isolates the scheduling granularity, not memory management: this baseline is
  kinder than systems that reserve max-length contiguous KV per request.
- If KV blocks run out inside a batch, the most recently admitted member holding blocks is
  preempted and recomputed, as in the continuous policy; the batch still ends only when all are done.
"""
from __future__ import annotations

from conveyor.request import Request, RequestStatus
from conveyor.scheduler.base import Scheduler, SchedulerOutput


class StaticScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batch: list[Request] = []

    @property
    def num_running(self) -> int:
        return sum(1 for r in self.batch if not r.is_finished)

    @property
    def batch_size(self) -> int:
        """Slots the current batch occupies, finished members included."""
        return len(self.batch)

    def schedule(self) -> SchedulerOutput:
        if all(r.is_finished for r in self.batch):
            self._form_batch()
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for request in self._service_order(self.batch):
            if budget == 0:
                break
            if request.is_finished or request in out.preempted:
                continue
            cached = self._cached_prefix(request)
            n = self._tokens_to_schedule(request, budget, cached)
            if n and self._reserve(request, n, self.batch, out, cached):
                request.status = RequestStatus.RUNNING
                budget -= n
        return self._finish_schedule(out)

    def _form_batch(self) -> None:
        # Samples of n > 1 count as n members: their forks join the batch later.
        self.batch = []
        slots = 0
        # The first request always joins, so a cap lowered under a request's n cannot stall it.
        while self.waiting and (not slots or slots + 1 + self.waiting[0].pending_forks <= self.max_num_seqs):
            request = self.waiting.popleft()
            slots += 1 + request.pending_forks
            self.batch.append(request)

    def _admit_fork(self, child: Request) -> None:
        self.batch.append(child)

    def _on_preempt(self, request: Request) -> None:
        request.status = RequestStatus.WAITING  # stays a member; resumes when blocks free up

    def _on_finish(self, request: Request) -> None:
        if request in self.waiting:
            self.waiting.remove(request)
