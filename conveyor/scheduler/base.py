"""What every scheduling policy shares: queues, the step's decision, preemption, step bookkeeping.

A policy only decides which requests get tokens this step and how many; the rule that drives it is
the same for all of them: a request needs `num_tokens - num_computed_tokens` more tokens computed.

The scheduler is the one owner of the KV manager: whatever changes a request's blocks (a step's
allocations, preemption, finishing, a KV handover to another engine, an import from one) happens
here, and the runner reads the step's block tables in the decision, never the manager.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

from conveyor.config import SchedulerConfig
from conveyor.kv.keys import SequenceKey
from conveyor.kv.manager import KVCacheManager, blocks_for
from conveyor.request import Request, RequestStatus
from conveyor.scheduler.queue import WaitingQueue, priority_key


@dataclass
class SchedulerOutput:
    """One step's decision. `scheduled` keeps the order in which tokens were handed out."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # (parent, child): samples of n > 1 branching off this step; a child shares its parent's KV
    # blocks and samples its first token from its parent's logits row.
    forks: list[tuple[Request, Request]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write, before the forward
    # Request id -> its KV blocks, for every scheduled request and forked child: where the runner
    # writes and reads their tokens' KV. The KV manager's own lists, not copies: read-only, and
    # valid until the next schedule().
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    # The same for a model's sliding-window layers (KVCacheManager.window_tables), and their
    # copy-on-write; empty without them.
    window_tables: dict[str, list[int]] = field(default_factory=dict)
    window_block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def sampling_requests(self) -> list[Request]:
        """Requests that catch up with all their known tokens this step, so sample the next one.
        Forked children come last. Valid until the step's results are applied."""
        regular = [r for r, n in self.scheduled
                   if r.num_computed_tokens + n == r.num_known_tokens and r.sampling_params.pooling is None]
        return regular + [child for _, child in self.forks]

    def pooled_requests(self) -> list[Request]:
        """Embedding requests that compute the rest of their prompt this step: they end with it."""
        return [r for r, n in self.scheduled
                if r.sampling_params.pooling is not None and r.num_computed_tokens + n == r.num_known_tokens]


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.requests: dict[str, Request] = {}
        self._handed_over: set[str] = set()  # detached requests whose blocks are kept until released
        self.num_preemptions = 0
        # Prefix cache, in tokens: looked up when a request starts (or restarts) holding no KV, and hit.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Lower limits an SLO controller may set under the configured ones (None: the configured).
        self.seq_cap: int | None = None
        self.token_cap: int | None = None

    # --- limits -----------------------------------------------------------------------------
    @property
    def max_num_seqs(self) -> int:
        """The running-batch cap in force. Lowering it never preempts: admissions wait until the
        batch shrinks under it."""
        configured = self.config.max_num_seqs
        return configured if self.seq_cap is None else max(1, min(self.seq_cap, configured))

    @property
    def max_num_batched_tokens(self) -> int:
        """The per-step token budget in force. Without chunked prefill a whole prompt must fit one
        step, so only the configured budget applies."""
        configured = self.config.max_num_batched_tokens
        if self.token_cap is None or not self.config.chunked_prefill:
            return configured
        return max(1, min(self.token_cap, configured))

    def set_limits(self, max_num_seqs: int | None, max_num_batched_tokens: int | None) -> None:
        self.seq_cap, self.token_cap = max_num_seqs, max_num_batched_tokens

    # --- queues -----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> Request | None:
        """Ends a request now and frees its blocks; `status` says why (a stop string found by the
        caller is FINISHED_STOPPED)."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        self._finish(request, status)
        return request

    # --- KV handover (prefill/decode disaggregation: conveyor/distributed, conveyor/sim) ----------
    def detach_request(self, request_id: str) -> Request | None:
        """Take a request out of scheduling but keep its KV blocks until `release_handover`: a
        prefill worker hands the request's KV to a decode worker."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            self._on_finish(request)
            self._handed_over.add(request_id)
        return request

    def handover_blocks(self, request: Request) -> list[int]:
        """The blocks that hold a detached request's computed tokens, first block first."""
        table = self.kv.block_tables.get(request.request_id, [])
        return table[: blocks_for(request.num_computed_tokens, self.kv.block_size)]

    def handover_window_blocks(self, request: Request) -> list[int] | None:
        """The same in the sliding-window layers' pool (NULL_BLOCK where out of sight); None
        without one."""
        table = self.kv.window_tables.get(request.request_id)
        if self.kv.window_pool is None:
            return None
        return (table or [])[: blocks_for(request.num_computed_tokens, self.kv.block_size)]

    def release_handover(self, request_id: str) -> None:
        """Free a detached request's blocks (another engine holds a copy now, or never will)."""
        if request_id in self._handed_over:
            self._handed_over.discard(request_id)
            self.kv.free(request_id)

    def cached_import_prefix(self, key: SequenceKey, num_computed_tokens: int) -> list[int]:
        """The blocks of this engine's prefix cache that hold the leading full blocks of a sequence
        another engine computed (its first num_computed_tokens tokens): an import takes them as
        they are instead of writing them. Nothing is taken yet."""
        return self.kv.lookup_prefix(key, num_computed_tokens)

    def import_fits(self, num_computed_tokens: int, cached: Sequence[int], window_held_from: int = 0) -> bool:
        """Whether an import of that many computed tokens, `cached` of them found here, may take
        blocks now: what it needs to run (its KV and the slot of its next token) within the blocks
        no request here is owed (uncommitted_free_blocks)."""
        if self.kv.blocks_to_start(num_computed_tokens + 1, cached) > self.uncommitted_free_blocks():
            return False
        # The window pool: a block of growth owed to each running request, as above.
        window_pool = self.kv.window_pool
        window_from = self.kv.import_window_start(num_computed_tokens, window_held_from)
        return window_pool is None or (self.kv.window_blocks_to_start(num_computed_tokens + 1, cached, window_from)
                                       <= window_pool.num_free - self.num_running)

    def import_prefilled(self, request: Request, cached: Sequence[int] = (),
                         write_kv: Callable[[list[int], list[int] | None], None] | None = None,
                         window_held_from: int = 0) -> None:
        """Queue a request whose first `num_computed_tokens` tokens have KV computed elsewhere, with
        blocks for them: `cached` (cached_import_prefix) head its table as they are, and
        `write_kv(blocks, window_blocks)` writes the KV of the blocks after them (window_blocks: the
        same entries of the window table, NULL_BLOCK where out of sight, None without one; None: a
        runner that holds no data, the simulator's). `window_held_from`: the first block whose KV the
        exporter's window pool still held (it had given back those before it: no data to write).
        Those blocks are then keyed like computed ones, so the next import of the same prefix finds
        them. It resumes like any request, from that count; one left with
        nothing computed takes no table and waits as a new request does."""
        rid = request.request_id
        if request.num_computed_tokens or cached:
            # Window blocks the exporter no longer held would be written with nothing, and keyed as if
            # they held it: the window table starts after them (and at most a window before what the
            # next query sees, which a later import of a shorter prefix may hit).
            window_from = self.kv.import_window_start(request.num_computed_tokens, window_held_from)
            self.kv.allocate(rid, request.num_computed_tokens, cached, window_from)
        if write_kv is not None:
            window = self.kv.window_tables.get(rid, []) if self.kv.window_pool is not None else None
            try:
                write_kv(self.kv.block_tables.get(rid, [])[len(cached):],
                         None if window is None else window[len(cached):])
            except BaseException:
                self.kv.free(rid)  # before keying: a block whose write failed must never be a hit
                raise
        self.kv.cache_full_blocks(request.sequence_key, request.num_computed_tokens)
        self.add_request(request)

    def set_prefix_caching(self, enabled: bool) -> None:
        """Turn prefix caching on or off from the next lookup on (blocks already cached stay until
        evicted); e.g. a profile whose prompts repeat but must each be computed whole."""
        self.kv.enable_prefix_caching = enabled

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def uncommitted_free_blocks(self) -> int:
        """Free blocks not owed to requests already here: what each waiting request still needs to
        be admitted, and a block of growth per running request. KV taken over from another engine
        (disaggregation, conveyor/distributed and conveyor/sim) may only use these: taking every
        free block would starve what is queued or running (the scheduler would then have to evict
        the imports, which costs a recompute). Negative when already overcommitted."""
        owed = self.num_running
        for request in self.waiting:
            held = len(self.kv.block_tables.get(request.request_id, ()))
            owed += max(0, blocks_for(request.num_tokens, self.kv.block_size) - held)
        return self.kv.num_free_blocks - owed

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        raise NotImplementedError

    def schedule(self) -> SchedulerOutput:
        raise NotImplementedError

    # --- shared mechanics -------------------------------------------------------------------
    def _cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks a request holding no KV (new, or back after preemption) may start from:
        the longest cached run of its full blocks, never its last token, whose logits are needed.
        With prompt logprobs asked, never past the prompt tokens already scored: a position's logits
        score the token after it, and a hit would skip computing them (vLLM skips the cache too)."""
        limit = request.num_tokens - 1
        if request.prompt_logprobs is not None:
            limit = min(limit, len(request.prompt_logprobs) - 1)
        pooled = request.pooled_positions
        if pooled is not None and request.num_pooled < len(pooled):
            limit = min(limit, pooled[request.num_pooled])  # an embedding's positions not pooled yet, likewise
        return self.kv.cached_prefix(request.sequence_key, limit)

    def _tokens_to_schedule(self, request: Request, budget: int, cached: Sequence[int] = ()) -> int:
        """How many of the request's pending tokens (after a prefix hit on `cached`) fit the
        budget; 0 if it must wait. Speculative tokens that do not fit are dropped, not chunked:
        they are only worth computing with the token before them, in the step that samples it."""
        pending = request.num_pending_tokens - len(cached) * self.kv.block_size
        if pending > budget and request.spec_token_ids:
            del request.spec_token_ids[max(0, budget - (pending - len(request.spec_token_ids))):]
            pending = request.num_pending_tokens
        if pending <= budget:
            return pending
        return budget if self.config.chunked_prefill else 0

    def _total(self, request: Request, num_new: int, cached: Sequence[int] = ()) -> int:
        """Tokens the request will have slots for after this step."""
        return request.num_computed_tokens + len(cached) * self.kv.block_size + num_new

    def _reserve(
        self, request: Request, num_new: int, victims: list[Request], out: SchedulerOutput,
        cached: Sequence[int] = (),
    ) -> bool:
        """Give `request` slots for num_new tokens (after a prefix hit on `cached`), preempting from
        the end of `victims` (the most recently admitted) until they fit. False if the request
        itself had to give way."""
        total = self._total(request, num_new, cached)
        rid = request.request_id
        if not self.kv.can_allocate(rid, total, cached):
            self._evict_waiting(request, total, out, cached)
        while not self.kv.can_allocate(rid, total, cached):
            victim = self._pick_victim(victims, out)
            if victim is None:
                return False
            self._preempt(victim, out)
            if victim is request:
                return False
        starts = rid not in self.kv.block_tables
        self.kv.allocate(rid, total, cached)
        if starts:
            hit = len(cached) * self.kv.block_size
            request.num_computed_tokens += hit  # the prefix hit: those tokens' KV is in `cached`
            if request.num_cached_tokens is None:
                request.num_cached_tokens = hit
            if self.kv.enable_prefix_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += hit
        out.scheduled.append((request, num_new))
        return True

    def _evict_waiting(self, head: Request, total: int, out: SchedulerOutput, cached: Sequence[int] = ()) -> None:
        """Free the blocks of waiting requests (other than `head`), newest first, until `head`
        has room for `total` tokens.

        Only a request taken over with its KV (a decode worker's import) waits while holding
        blocks, and preemption only reaches running requests: without this, a head that does not
        fit with nothing running (one preempted for recompute, an import one block short) stalls
        the engine for good, and a lone running request that needs those blocks preempts itself
        over and over. They go first, before running requests are preempted: recomputed later
        like any preempted request."""
        for candidate in reversed(self.waiting):
            if self.kv.can_allocate(head.request_id, total, cached):
                return
            if candidate is head or candidate.request_id not in self.kv.block_tables:
                continue
            self._drop_kv(candidate, out)

    def _finish_schedule(self, out: SchedulerOutput) -> SchedulerOutput:
        """Branch off the extra samples of n > 1 requests that sample their first token now."""
        for request, n in out.scheduled:
            if request.num_computed_tokens + n < request.num_known_tokens:
                continue
            for index in range(1, request.pending_forks + 1):
                child = request.fork(index)
                self.kv.fork(request.request_id, child.request_id)
                self.requests[child.request_id] = child
                self._admit_fork(child)
                out.forks.append((request, child))
        out.block_copies = self.kv.take_copies()
        tables = self.kv.block_tables
        out.block_tables = {r.request_id: tables[r.request_id] for r, _ in out.scheduled}
        out.block_tables.update((child.request_id, tables[child.request_id]) for _, child in out.forks)
        if self.kv.window_pool is not None:
            out.window_block_copies = self.kv.take_window_copies()
            windows = self.kv.window_tables
            out.window_tables = {rid: windows[rid] for rid in out.block_tables}
        return out

    def _admit_fork(self, child: Request) -> None:
        raise NotImplementedError

    def _service_order(self, admitted: list[Request]) -> list[Request]:
        """The order in which admitted requests get their tokens each step: admission order, or
        with priority scheduling the most urgent first (admission order among equals). Preemption
        goes the other way, so a victim is never one already served this step."""
        return sorted(admitted, key=priority_key) if self.waiting.by_priority else admitted

    def _pick_victim(self, victims: list[Request], out: SchedulerOutput) -> Request | None:
        scheduled = {r.request_id for r, _ in out.scheduled}
        for candidate in reversed(self._service_order(victims)):
            if candidate.request_id in self.kv.block_tables and candidate.request_id not in scheduled:
                return candidate
        return None

    def _drop_kv(self, request: Request, out: SchedulerOutput) -> None:
        # Recompute, not swap: drop the KV and let the request catch up from token 0 later (or
        # from what the prefix cache still holds of it).
        self.kv.free(request.request_id)
        request.spec_token_ids.clear()
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(request)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self._drop_kv(request, out)
        self._on_preempt(request)

    def _on_preempt(self, request: Request) -> None:
        raise NotImplementedError

    def update_from_output(self, out: SchedulerOutput, finished: Iterable[tuple[Request, RequestStatus]],
                           num_rejected: Mapping[str, int] | None = None) -> None:
        """Account for the computed tokens, then retire the requests the engine says are done.
        `num_rejected`: request id -> speculative tokens computed this step that the model did not
        accept (the engine has dropped them from the request): the count rolls back past them and
        the blocks that held only them are freed. Only verified tokens reach the prefix cache."""
        for request, n in out.scheduled:
            rejected = num_rejected.get(request.request_id, 0) if num_rejected else 0
            request.num_computed_tokens += n - rejected
            if rejected:
                self.kv.truncate(request.request_id, request.num_computed_tokens)
            self.kv.cache_full_blocks(request.sequence_key, request.num_computed_tokens)
        for parent, child in out.forks:
            child.num_computed_tokens = parent.num_computed_tokens
        for request, status in finished:
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request.request_id)
        self.requests.pop(request.request_id, None)
        self._on_finish(request)

    def _on_finish(self, request: Request) -> None:
        raise NotImplementedError
