"""LLMEngine: add_request / abort_request / step(). One step = schedule, run, apply results.

The runner is pluggable: the real ModelRunner computes tensors; a runner that only predicts step
times turns this same loop into a simulator, and tests drive it with a fake one.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Callable, Protocol, Sequence

from conveyor.config import EngineConfig
from conveyor.control import SloController
from conveyor.engine.tokenizer_protocol import TextCodec
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.stopping import StopChecker
from conveyor.errors import (
    CONTEXT_LENGTH_EXCEEDED, ConfigError, ConveyorError, InvalidRequestError, NoAllowedTokenError, RequestFailedError,
)
from conveyor.kv import blocks_for
from conveyor.model.facts import ModelFacts
from conveyor.request import Request, RequestStatus
from conveyor.runner.stats import StepStats
from conveyor.sampling.outputs import SamplerOutput
from conveyor.sampling.params import SamplingParams
from conveyor.sampling.pooling import PoolingParams
from conveyor.scheduler import SchedulerOutput, build_scheduler
from conveyor.engine.draft import DraftModelProposer
from conveyor.speculative import Proposer, Speculator
from conveyor.structured.matchers import GrammarMatchers

log = logging.getLogger("conveyor.engine")


class Runner(Protocol):
    """Optionally also `save_rng_state(out) -> state` and `restore_rng_state(state)`, so that a step
    re-run after a failure (LLMEngine._execute_isolating) draws the same random numbers, and
    `prompt_rows_apart` (True where prompt and generated tokens compute differently: the prefix
    cache then keys them apart; absent means False)."""

    def execute(self, out: SchedulerOutput, stats: StepStats) -> SamplerOutput:
        """Compute the scheduled tokens (their KV blocks: `out.block_tables`, after `out.block_copies`);
        return one sampled token per `out.sampling_requests()`.
        A runner with `supports_token_masks` also takes `token_masks=` (structured outputs) and
        applies them to those rows before sampling; only such a runner gets constrained requests."""
        ...


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        num_kv_blocks: int,
        max_model_len: int,
        vocab_size: int,
        tokenizer: TextCodec | None = None,
        eos_token_ids: Sequence[int] = (),
        clock: Callable[[], float] = time.perf_counter,
        proposer: Proposer | None = None,
    ) -> None:
        """`proposer`: where speculative tokens come from when config.speculative_config asks for a
        draft model (from_config builds one); prompt lookup needs none."""
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.clock = clock
        # It owns the KV manager, whose prefix-cache keys follow how the runner computes a token.
        self.scheduler = build_scheduler(config, num_kv_blocks, bool(getattr(runner, "prompt_rows_apart", False)),
                                         getattr(runner, "kv_window", None))
        self.stopper = StopChecker(tuple(eos_token_ids), max_model_len)
        self.grammars = GrammarMatchers(tokenizer, vocab_size)  # structured outputs (conveyor/structured)
        self.last_step = StepStats()
        # Lowers the batch cap / token budget to hold slo_tpot_ms; None without an SLO target.
        self.slo = SloController.from_scheduler_config(config.scheduler, num_kv_blocks * config.block_size)
        self._ids = itertools.count()
        self._unfinished_samples: dict[str, int] = {}  # request id -> samples not yet finished
        self.speculator: Speculator | None = None
        if config.speculative_config is not None:
            if not getattr(runner, "supports_speculation", False):
                raise ConfigError("this engine's runner cannot verify speculative tokens (speculative_config)")
            if config.speculative_config.method == "draft_model" and proposer is None:
                raise ConfigError("speculative_config: a draft model's engine is built by LLMEngine.from_config")
            self.speculator = Speculator(config.speculative_config, proposer)

    @classmethod
    def from_config(cls, config: EngineConfig, loaded: object | None = None) -> "LLMEngine":
        """`loaded` (a runner.model_runner.LoadedModel) shares weights already in memory."""
        from conveyor.runner.model_runner import ModelRunner  # the model's modules only where one is built

        runner = ModelRunner.from_config(config, loaded)  # type: ignore[arg-type]
        assert runner.tokenizer is not None  # from_config loads the checkpoint's tokenizer
        spec = config.speculative_config
        proposer = None
        if spec is not None and spec.method == "draft_model":
            proposer = DraftModelProposer(cls._draft_engine(config, runner.num_kv_blocks, runner.max_model_len,
                                                            runner.model_config.vocab_size))
        return cls(
            config,
            runner,
            num_kv_blocks=runner.num_kv_blocks,
            max_model_len=runner.max_model_len,
            vocab_size=runner.model_config.vocab_size,
            tokenizer=runner.tokenizer,
            eos_token_ids=runner.tokenizer.eos_token_ids,
            proposer=proposer,
        )

    @classmethod
    def _draft_engine(cls, config: EngineConfig, num_kv_blocks: int, max_model_len: int,
                      vocab_size: int) -> "LLMEngine":
        """The draft model's engine: the target's options, its own weights, as many KV blocks (of a
        smaller model), prefix caching on (what lets a proposal reuse the last one's KV)."""
        spec = config.speculative_config
        assert spec is not None and spec.model is not None
        draft = cls.from_config(dataclasses.replace(
            config, model=spec.model, speculative_config=None, num_kv_blocks=num_kv_blocks,
            max_model_len=max_model_len, enable_prefix_caching=True,
            scheduler=dataclasses.replace(config.scheduler, slo_tpot_ms=None, slo_ttft_ms=None)))
        if draft.vocab_size != vocab_size:
            raise ConfigError(f"speculative_config.model {spec.model!r} has a vocabulary of {draft.vocab_size} "
                              f"tokens, the served model {vocab_size}: a draft must share the vocabulary")
        return draft

    # --- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and queue a request; raises InvalidRequestError without touching engine state.

        The engine works on token ids: it makes no text and does not search for `params.stop`
        strings; whoever makes the text does (LLM.generate, the server) and ends the sample with
        `stop_sample` when one appears.

        Every per-request value that reaches a tensor is checked or bounded here, before the
        request can share a step with others (a value that overflowed inside the step would fail
        the whole batch)."""
        params = self._prepared(params or SamplingParams())
        text = prompt if isinstance(prompt, str) else None
        token_ids = self._tokenize(prompt)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._unfinished_samples:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        params = self._until_full(len(token_ids), params)
        self._check_fits(len(token_ids), params)
        arrival = self.clock() if arrival_time is None else arrival_time
        self._check_token_ids(params)
        if params.pooling is not None and not getattr(self.runner, "supports_pooling", False):
            raise InvalidRequestError("this engine's runner cannot pool hidden states (embeddings)", param="pooling")
        request = Request(request_id, token_ids, params, arrival, prompt=text)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]  # the first prompt token has nothing to be scored against
        self._start_grammar(request)
        self.scheduler.add_request(request)
        self._unfinished_samples[request_id] = params.n
        return request_id

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer: pass prompt token ids")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            if any(not isinstance(t, int) or isinstance(t, bool) for t in token_ids):
                raise InvalidRequestError("prompt token ids must be integers", param="prompt")
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"token ids out of vocabulary [0, {self.vocab_size}): {bad[:5]}",
                                          param="prompt")
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return token_ids

    def _prepared(self, params: SamplingParams) -> SamplingParams:
        """The request's parameters as the sampler takes them: checked again, bounded to the
        vocabulary, bad words tokenized."""
        params = params.bounded(self.vocab_size)
        if params.priority != 0 and self.config.scheduler.scheduling_policy != "priority":
            raise InvalidRequestError(f"priority ({params.priority}) needs priority scheduling, which this engine "
                                      f"does not run (--scheduling-policy priority)", param="priority")
        if params.bad_words:
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer: pass bad_words_token_ids", param="bad_words")
            tokenizer = self.tokenizer
            params = params.with_bad_words_tokenized(lambda text: tokenizer.encode(text, add_special_tokens=False))
        return params

    def _check_token_ids(self, params: SamplingParams) -> None:
        token_lists = [("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids),
                       ("allowed_token_ids", params.allowed_token_ids or ()),
                       ("bad_words", [t for ids in params.bad_words_token_ids for t in ids])]
        for name, ids in token_lists:
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"{name}: token ids out of vocabulary [0, {self.vocab_size}): {bad[:5]}",
                                          param=name)
        self._check_some_token_allowed(params)

    def _check_some_token_allowed(self, params: SamplingParams) -> None:
        """Refuse constraints that leave no token from the start (what only shows later fails the
        request at that step: _end_blocked)."""
        if params.allowed_token_ids is None:
            return
        left = set(params.allowed_token_ids) - {ids[0] for ids in params.bad_words_token_ids if len(ids) == 1}
        if not left:
            raise InvalidRequestError("allowed_token_ids: bad_words bans every allowed token", param="allowed_token_ids")
        held = set(params.stop_token_ids) | (set() if params.ignore_eos else self.stopper.eos_token_ids)
        if params.min_tokens > 0 and not left - held:
            raise InvalidRequestError(f"min_tokens ({params.min_tokens}) holds back EOS and stop_token_ids, and "
                                      "allowed_token_ids allows nothing else", param="min_tokens")

    @property
    def capacity(self) -> int:
        """Most tokens (prompt and output) one request can hold: the context or the whole KV cache,
        and without chunked prefill what one step computes (a recomputed request is one prefill)."""
        kv, sched = self.scheduler.kv, self.config.scheduler
        room = min(self.max_model_len, kv.num_blocks * kv.block_size)
        return room if sched.chunked_prefill else min(room, sched.max_num_batched_tokens)

    @property
    def default_pooling(self) -> PoolingParams:
        """What an embedding request pools by, unless it says: EngineConfig.pooling_type, else the
        model file's, else the last token's (vLLM's for a decoder model); normalized."""
        model_config = getattr(self.runner, "model_config", None)
        return PoolingParams(self.config.pooling_type or getattr(model_config, "pooling_type", None) or "last")

    @property
    def embedding_size(self) -> int | None:
        """How many numbers an embedding has: the model's hidden size (None: a runner without a model)."""
        model_config = getattr(self.runner, "model_config", None)
        return None if model_config is None else model_config.hidden_size

    @property
    def model_facts(self) -> ModelFacts | None:
        """What the served file is (None: weights built in memory, or a runner without a model)."""
        return getattr(self.runner, "model_facts", None)

    def _until_full(self, num_prompt: int, params: SamplingParams) -> SamplingParams:
        """`params` with max_tokens None (vLLM's "until the context is full") set to what the prompt
        leaves; a prompt that leaves nothing is refused."""
        if params.max_tokens is not None:
            return params
        room = self.capacity - num_prompt
        if room < 1:
            raise InvalidRequestError(f"the prompt ({num_prompt} tokens) leaves no room for output within the "
                                      f"{self.capacity} tokens a request can hold", param="prompt")
        return dataclasses.replace(params, max_tokens=room)

    def _check_fits(self, num_prompt: int, params: SamplingParams) -> None:
        max_tokens = params.max_tokens
        if max_tokens is None:
            raise InvalidRequestError("max_tokens is None: set it with _until_full first", param="max_tokens")
        if params.pooling is not None:  # an embedding holds its prompt alone: it never takes the slot it reserves
            if num_prompt > self.capacity:
                raise InvalidRequestError(f"the prompt ({num_prompt} tokens) cannot fit the {self.capacity} tokens a "
                                          "request can hold", param="prompt", code=CONTEXT_LENGTH_EXCEEDED)
            return
        total = num_prompt + max_tokens
        # The field at fault: max_tokens while the prompt alone leaves room for a token.
        kv = self.scheduler.kv
        blamed = "max_tokens" if num_prompt < self.capacity else "prompt"
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) exceeds the "
                f"maximum model length {self.max_model_len}", param=blamed, code=CONTEXT_LENGTH_EXCEEDED
            )
        if blocks_for(total, kv.block_size) > kv.num_blocks:
            raise InvalidRequestError(
                f"prompt plus max_tokens ({total} tokens) cannot fit the whole KV cache "
                f"({kv.num_blocks} blocks of {kv.block_size} tokens)", param=blamed, code=CONTEXT_LENGTH_EXCEEDED
            )
        sched = self.config.scheduler
        if params.n > sched.max_num_seqs:
            raise InvalidRequestError(f"n ({params.n}) exceeds max_num_seqs ({sched.max_num_seqs})", param="n")
        if not sched.chunked_prefill and total > sched.max_num_batched_tokens:
            # Without chunking a (re)computed prompt must fit one step's token budget.
            raise InvalidRequestError(
                f"prompt plus max_tokens ({total} tokens) exceeds max_num_batched_tokens "
                f"({sched.max_num_batched_tokens}) and chunked prefill is off", param=blamed
            )

    def abort_request(self, request_id: str) -> bool:
        """Aborts every sample of the request; False if it is unknown or already finished."""
        if self._unfinished_samples.pop(request_id, None) is None:
            return False
        samples = [r for r in self.scheduler.requests.values() if r.group_id == request_id]
        now = self.clock()
        for sample in samples:
            self.scheduler.abort_request(sample.request_id)
            sample.times.finished = now
        return True

    def stop_sample(self, request_id: str, index: int, stop_reason: str | None = None) -> RequestOutput | None:
        """Ends sample `index` of a request as stopped (its text reached a stop string) and frees its
        KV blocks at once; returns its final output, or None if it is unknown or already done."""
        if request_id not in self._unfinished_samples:
            return None
        sample = next((r for r in self.scheduler.requests.values()
                       if r.group_id == request_id and r.sample_index == index), None)
        # An embedding has no text to stop: ended before its vector, it is aborted.
        status = RequestStatus.FINISHED_ABORTED if sample and sample.sampling_params.pooling else RequestStatus.FINISHED_STOPPED
        if sample is None or self.scheduler.abort_request(sample.request_id, status) is None:
            return None
        sample.stop_reason = stop_reason
        sample.times.finished = self.clock()
        self._retire_sample(request_id)
        return self._output(sample, [], None)

    # --- KV handover (prefill/decode disaggregation, conveyor/distributed) ----------------------
    def detach_request(self, request_id: str) -> Request | None:
        """Stop scheduling a (single-sample) request but keep its KV blocks: the caller frees them
        with `scheduler.release_handover` once another engine holds a copy."""
        request = self.scheduler.detach_request(request_id)
        if request is not None:
            self._unfinished_samples.pop(request.group_id, None)
        return request

    def add_prefilled_request(self, request: Request, cached: Sequence[int] = (),
                              write_kv: Callable[[list[int], list[int] | None], None] | None = None,
                              window_held_from: int = 0) -> None:
        """Queue a request whose first `num_computed_tokens` tokens have KV computed elsewhere
        (Scheduler.import_prefilled: `cached` from scheduler.cached_import_prefix head its table,
        `write_kv(blocks, window_blocks)` writes the rest; `window_held_from`: the first block whose KV
        the exporter's sliding-window pool still held). It resumes like any request, from that count."""
        if request.request_id in self._unfinished_samples or request.sampling_params.n != 1:
            raise InvalidRequestError(f"cannot take over request {request.request_id!r}")
        request.sampling_params = self._until_full(request.num_prompt_tokens, self._prepared(request.sampling_params))
        self._check_fits(request.num_prompt_tokens, request.sampling_params)
        self._check_token_ids(request.sampling_params)
        self._start_grammar(request)  # replays the output it already has
        try:
            self.scheduler.import_prefilled(request, cached, write_kv, window_held_from)
        except BaseException:
            self.grammars.forget(request)
            raise
        self._unfinished_samples[request.request_id] = 1

    def _start_grammar(self, request: Request) -> None:
        if request.sampling_params.structured is None:
            return
        if not getattr(self.runner, "supports_token_masks", False):
            raise InvalidRequestError("this engine's runner cannot constrain outputs (structured outputs)")
        self.grammars.start(request)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def warm_up(self, prompt_len: int = 32, output_len: int = 4) -> "LLMEngine":
        """Run two small requests (one greedy, one sampled) through every stage of a step, so that
        first-call costs (allocator growth, thread pools, lazily built tables) are paid before the
        first real request, not inside it. Call it on an idle engine; returns the engine. The
        requests shrink to what the engine's limits admit (a short --max-model-len, a small pool);
        an engine that admits no request at all is a ConfigError that says so."""
        room = self.capacity
        output_len = max(1, min(output_len, room // 4))
        prompt_len = max(1, min(prompt_len, room - output_len))
        half = self.vocab_size // 2  # ids in the upper half: clear of the special tokens at the start
        ids = [half + (7 * i) % (self.vocab_size - half) for i in range(prompt_len)]
        greedy = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        sampled = SamplingParams(max_tokens=output_len, temperature=0.8, top_p=0.9, seed=0, ignore_eos=True)
        try:
            self.add_request(ids, greedy, request_id="warm-up greedy")
            self.add_request(ids[::-1], sampled, request_id="warm-up sampled")
        except InvalidRequestError as e:
            for request_id in ("warm-up greedy", "warm-up sampled"):
                self.abort_request(request_id)
            raise ConfigError(f"this engine admits no request of even {prompt_len} prompt token(s) and {output_len} "
                              f"output token(s) (--max-model-len, --num-kv-blocks / --kv-cache-memory, "
                              f"--max-num-batched-tokens): {e}") from e
        while self.has_unfinished_requests:
            self.step()
        return self

    # --- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        stats = StepStats()
        t0 = self.clock()
        if self.slo is not None:
            self.slo.before_schedule(self.scheduler, t0)
        out = self.scheduler.schedule()
        t1 = self.clock()
        stats.schedule_s = t1 - t0
        self.last_step = stats
        if out.is_empty:
            return []
        if self.slo is not None:
            self.slo.on_scheduled(out, self.scheduler)
        stats.num_requests, stats.num_tokens, stats.num_preempted = len(out.scheduled), out.num_tokens, len(out.preempted)
        for request in [r for r, _ in out.scheduled] + [child for _, child in out.forks]:
            if request.times.first_scheduled is None:  # a fork of a parent first scheduled now, too
                request.times.first_scheduled = t1
        for parent, child in out.forks:
            self.grammars.fork(parent, child)
        sampled, out, outputs = self._execute_isolating(out, stats)
        if sampled.blocked:
            sampled, out, ended = self._end_blocked(sampled, out)
            outputs += ended
        samplers = out.sampling_requests()
        t2 = self.clock()
        for request_id, scored in (sampled.prompt_logprobs or {}).items():
            self.scheduler.requests[request_id].prompt_logprobs.extend(scored)  # type: ignore[union-attr]
        for request_id, (total, count) in (sampled.pooled or {}).items():
            request = self.scheduler.requests[request_id]
            request.pooled_sum = total if request.pooled_sum is None else [
                a + b for a, b in zip(request.pooled_sum, total)]
            request.num_pooled += count
        finished: list[tuple[Request, RequestStatus, dict[int, float] | None, list[int]]] = [
            (request, RequestStatus.FINISHED_STOPPED, None, []) for request in out.pooled_requests()]
        logprobs = sampled.logprobs or [None] * len(samplers)
        accepted = sampled.num_accepted or [0] * len(samplers)
        num_rejected: dict[str, int] = {}
        for request, token, token_logprobs, num_accepted in zip(samplers, sampled.tokens, logprobs, accepted):
            drafts, request.spec_token_ids = request.spec_token_ids, []
            if drafts:
                num_rejected[request.request_id] = len(drafts) - num_accepted
                self._count_verified(request, len(drafts), num_accepted, stats)
            new_tokens: list[int] = []
            status = None
            for new_token in drafts[:num_accepted] + [token]:
                new_tokens.append(new_token)
                request.output_token_ids.append(new_token)
                request.times.tokens.append(t2)
                if request.times.first_token is None:
                    request.times.first_token = t2
                grammar_done = self.grammars.accept(request, new_token)
                status = self.stopper.check(request, new_token)
                if grammar_done and status is not RequestStatus.FINISHED_STOPPED:
                    status = RequestStatus.FINISHED_STOPPED
                if status is not None:
                    break  # the tokens after a stop are dropped, as they would never have been sampled
            if status is not None:
                finished.append((request, status, token_logprobs, new_tokens))
            else:
                outputs.append(self._output(request, new_tokens, token_logprobs))
        self.scheduler.update_from_output(out, [(r, status) for r, status, _, _ in finished], num_rejected)
        for request, _, token_logprobs, new_tokens in finished:
            request.times.finished = t2
            outputs.append(self._output(request, new_tokens, token_logprobs))
            self._retire_sample(request.group_id)
        if self.speculator is not None:
            base_rows = out.num_tokens - stats.num_draft_tokens
            self.speculator.observe_step(out.num_tokens, len(samplers) + stats.num_draft_tokens, t2 - t1)
            proposing = [r for r in samplers if not r.is_finished]
            self.speculator.propose(proposing, base_rows)
            for request in proposing:
                self.grammars.cut_proposal(request)
        stats.postprocess_s = self.clock() - t2
        if self.slo is not None:
            self.slo.after_step(self.clock() - t0, samplers, [r for r, _, _, _ in finished], self.scheduler)
            stats.extra.update(self.slo.state.as_extra())
        return outputs

    def _count_verified(self, request: Request, num_drafted: int, num_accepted: int, stats: StepStats) -> None:
        """A step verified num_drafted proposed tokens of the request and kept num_accepted."""
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafted
        stats.num_accepted_tokens += num_accepted
        for depth in range(num_accepted):
            if depth == len(stats.accepted_per_position):
                stats.accepted_per_position.append(0)
            stats.accepted_per_position[depth] += 1
        if self.speculator is not None:
            self.speculator.observe_verified(request, num_drafted, num_accepted)

    # --- failure isolation -----------------------------------------------------------------------
    def _run(self, out: SchedulerOutput, stats: StepStats) -> SamplerOutput:
        """One call of the runner, with the grammar masks of the step's constrained requests."""
        masks = self.grammars.masks(out.sampling_requests())
        if masks is None:
            return self.runner.execute(out, stats)
        return self.runner.execute(out, stats, token_masks=masks)  # type: ignore[call-arg]

    def _execute_isolating(self, out: SchedulerOutput,
                           stats: StepStats) -> tuple[SamplerOutput, SchedulerOutput, list[RequestOutput]]:
        """Run the step; if the runner raises, find the requests that make it raise by re-running
        it on halves of the batch (bisection), fail only them, and run the rest as one batch again.

        Returns what the runner sampled, the step's decision without the failed requests, and a
        final output (carrying a RequestFailedError) per failed request. A step that fails for
        every request (the model itself is broken) raises, failing everyone as before.

        The retries are exact: the random generators are restored before each, a copy-on-write
        block copy repeats the same copy, and KV writes rewrite the same slots with the same values
        (a request's rows do not depend on its batch-mates), so survivors get the tokens a clean
        run gives. Samples of one request (n > 1, forks) stand or fall together."""
        save = getattr(self.runner, "save_rng_state", None)
        rng_state = save(out) if save is not None else None

        def attempt(decision: SchedulerOutput, step_stats: StepStats) -> SamplerOutput | None:
            if rng_state is not None:
                self.runner.restore_rng_state(rng_state)  # type: ignore[attr-defined]
            try:
                return self._run(decision, step_stats)
            except Exception:
                return None

        try:
            return self._run(out, stats), out, []
        except Exception as exc:
            error = exc
        groups = list(dict.fromkeys(r.group_id for r, _ in out.scheduled))
        if len(groups) == 1:
            raise error

        def culprits(suspects: list[str]) -> list[str]:
            """The groups among `suspects` (known to fail together) whose step fails on its own."""
            if len(suspects) == 1:
                return suspects
            found: list[str] = []
            for part in (suspects[: len(suspects) // 2], suspects[len(suspects) // 2 :]):
                if attempt(_only(out, set(part)), StepStats()) is None:
                    found += culprits(part)
            return found

        failed = set(culprits(groups))
        if not failed or len(failed) == len(groups):  # no single cause, or the model itself fails
            raise error
        log.error("engine step failed; isolated the cause to request(s) %s, the other %d go on",
                  sorted(failed), len(groups) - len(failed), exc_info=error)
        survivors = _only(out, set(groups) - failed)
        sampled = attempt(survivors, stats)
        if sampled is None:
            raise error
        return sampled, survivors, [self._fail_group(group_id, RequestFailedError(
            f"request {group_id!r} failed inside the engine step and was removed from the batch "
            f"({type(error).__name__}); the other requests were not affected")) for group_id in sorted(failed)]

    def _end_blocked(self, sampled: SamplerOutput,
                     out: SchedulerOutput) -> tuple[SamplerOutput, SchedulerOutput, list[RequestOutput]]:
        """Fail the requests whose constraints left no token this step (their sampled token would
        break them), as failure isolation fails a request: the step's results without them, and
        their final outputs. Samples of one request stand or fall together."""
        samplers = out.sampling_requests()
        errors: dict[str, NoAllowedTokenError] = {}
        for i in sampled.blocked or ():
            request = samplers[i]
            errors.setdefault(request.group_id, _no_token_error(request))
        keep = [i for i, r in enumerate(samplers) if r.group_id not in errors]

        def kept(values: list | None) -> list | None:
            return None if values is None else [values[i] for i in keep]

        prompt_logprobs = {rid: scored for rid, scored in (sampled.prompt_logprobs or {}).items()
                           if self.scheduler.requests[rid].group_id not in errors}
        survivors = _only(out, {r.group_id for r, _ in out.scheduled} - set(errors))
        kept_sampled = SamplerOutput(kept(sampled.tokens) or [], kept(sampled.logprobs), prompt_logprobs or None,
                                     kept(sampled.num_accepted), pooled=sampled.pooled)
        return kept_sampled, survivors, [self._fail_group(group_id, error) for group_id, error in errors.items()]

    def _fail_group(self, group_id: str, error: ConveyorError) -> RequestOutput:
        """Finish every sample of a request as failed with `error` (blocks freed); its final output."""
        request = next(r for r in self.scheduler.requests.values() if r.group_id == group_id)
        self.abort_request(group_id)
        output = self._output(request, [], None)
        output.finish_reason = "error"
        output.error = error
        return output

    def _retire_sample(self, group_id: str) -> None:
        left = self._unfinished_samples.get(group_id)
        if left is None:
            return
        if left <= 1:
            del self._unfinished_samples[group_id]
        else:
            self._unfinished_samples[group_id] = left - 1

    def _output(self, request: Request, new_tokens: list[int], logprobs: dict[int, float] | None) -> RequestOutput:
        finished = request.is_finished
        return RequestOutput(
            embedding=_embedding(request) if finished and request.status is RequestStatus.FINISHED_STOPPED else None,
            request_id=request.group_id,
            index=request.sample_index,
            logprobs=None if logprobs is None else [logprobs],
            prompt_logprobs=request.prompt_logprobs if len(request.output_token_ids) == 1 else None,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=request.output_token_ids,
            new_token_ids=new_tokens,
            finished=finished,
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason,
            ended_on_stop_token=finished and request.ended_on_stop_token,
            times=request.times,
            num_preemptions=request.num_preemptions,
            num_cached_tokens=request.num_cached_tokens or 0,
        )


def _embedding(request: Request) -> list[float] | None:
    """An embedding request's vector, once every position it pools is computed (None otherwise)."""
    pooling, pooled = request.sampling_params.pooling, request.pooled_positions
    if pooling is None or pooled is None:
        return None
    if request.num_pooled != len(pooled) or request.pooled_sum is None:
        raise AssertionError(f"request {request.request_id!r} ended having pooled {request.num_pooled} of its "
                             f"{len(pooled)} positions")
    return pooling.embedding(request.pooled_sum, request.num_pooled)


def _no_token_error(request: Request) -> NoAllowedTokenError:
    p = request.sampling_params
    fields = [name for name, used in (("allowed_token_ids", p.allowed_token_ids is not None),
                                      ("bad_words", bool(p.bad_words_token_ids)),
                                      ("min_tokens", len(request.output_token_ids) < p.min_tokens)) if used]
    names = ", ".join(fields + (["the structured-output grammar"] if p.structured is not None else []))
    return NoAllowedTokenError(
        f"no token satisfies the request's constraints together ({names}) at output token "
        f"{len(request.output_token_ids) + 1}; the request was ended there", param=fields[0] if fields else None)


def _only(out: SchedulerOutput, group_ids: set[str]) -> SchedulerOutput:
    """The step's decision restricted to the given requests (every sample of each)."""
    return SchedulerOutput(
        scheduled=[(r, n) for r, n in out.scheduled if r.group_id in group_ids],
        preempted=out.preempted,
        forks=[(parent, child) for parent, child in out.forks if parent.group_id in group_ids],
        block_copies=out.block_copies,
        block_tables=out.block_tables,
        window_tables=out.window_tables,
        window_block_copies=out.window_block_copies,
    )
