"""A request's state as the scheduler sees it: tokens known vs tokens computed (pure Python)."""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field

from conveyor.kv.keys import SequenceKey, TokenSlice
from conveyor.sampling.params import SamplingParams


def sequence_key(params: SamplingParams, token_slice: TokenSlice, request_id: str = "",
                 prompt_tokens: int | None = None) -> SequenceKey:
    """What the prefix cache keys a sequence's KV blocks by: the one place that says which of a
    request's fields keep its blocks apart from others' (a new one joins here and in
    conveyor/kv/keys.py). `request_id` names the sequence to the KV manager; a lookup of tokens
    no request holds yet (an import, the router's estimate) needs none. `prompt_tokens`: how many
    of the sequence's tokens are its prompt (None: every token asked about)."""
    return SequenceKey(request_id, token_slice, params.cache_salt, prompt_tokens)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass
class RequestTimes:
    """Wall-clock (or virtual, in the simulator) timestamps from which TTFT/TPOT/ITL are computed."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    tokens: list[float] = field(default_factory=list)
    finished: float | None = None


@dataclass(eq=False)  # identity: two requests are never "equal"
class Request:
    """One generation. Prefill, chunked prefill, decode and recompute-after-preemption are all the
    same thing: computing tokens until num_computed_tokens catches up with num_tokens."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    prompt: str | None = None
    group_id: str = ""  # the id the caller knows; samples of n > 1 share it (default: request_id)
    sample_index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    # Prompt tokens whose KV came from the prefix cache when the request first started (None:
    # not started yet); what the API reports as usage.prompt_tokens_details.cached_tokens.
    num_cached_tokens: int | None = None
    stop_reason: int | str | None = None
    ended_on_stop_token: bool = False  # its last token is the EOS or stop_token_ids entry that ended it
    # With sampling_params.prompt_logprobs: {token id: logprob} per prompt token scored so far (the
    # first token has none), filled chunk by chunk as the prompt is computed.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Speculative tokens: proposed after the last sampled token (conveyor/speculative), known but
    # not yet verified. They are scheduled and computed like any known token; the step's sampling
    # keeps the run the model agrees with and the scheduler rolls the rest back (never cached).
    spec_token_ids: list[int] = field(default_factory=list)
    # An embedding request (sampling_params.pooling): the sum of the hidden states of its pooled
    # positions computed so far, and how many of those positions it holds (the next to pool is
    # pooled_positions[num_pooled]; a recompute after preemption pools none twice).
    pooled_sum: list[float] | None = None
    num_pooled: int = 0
    times: RequestTimes = field(init=False)

    def __post_init__(self) -> None:
        self.times = RequestTimes(arrival=self.arrival_time)
        if not self.group_id:
            self.group_id = self.request_id

    @property
    def pending_forks(self) -> int:
        """Further samples still to branch off this one: it forks when it samples its first token."""
        return self.sampling_params.n - 1 if not self.output_token_ids else 0

    def fork(self, index: int) -> "Request":
        """A sibling sample at the same point of computation (it will share this one's KV blocks)."""
        child = Request(
            request_id=f"{self.group_id}#{index}",
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=self.sampling_params.for_sample(index),
            arrival_time=self.arrival_time,
            prompt=self.prompt,
            group_id=self.group_id,
            sample_index=index,
            status=self.status,
            num_computed_tokens=self.num_computed_tokens,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
        )
        child.times.first_scheduled = self.times.first_scheduled
        return child

    def decodes(self, num_scheduled: int) -> bool:
        """Whether a step computes these `num_scheduled` tokens as decode rows (the runner batches
        them, conveyor/runner/inputs.py): a token after the prompt, with the speculative ones it
        verifies. A prompt's tokens are a prefill chunk, its last one alone too."""
        return (num_scheduled in (1, 1 + len(self.spec_token_ids))
                and self.num_computed_tokens >= len(self.prompt_token_ids))

    @property
    def pooled_positions(self) -> range | None:
        """The prompt positions an embedding request pools (None: the request samples tokens)."""
        pooling = self.sampling_params.pooling
        return None if pooling is None else pooling.positions(len(self.prompt_token_ids))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Verified tokens and the speculative ones after them: what a step may compute."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + len(self.spec_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        return self.num_known_tokens - self.num_computed_tokens

    @property
    def max_tokens(self) -> int:
        """The most output tokens it may have: its max_tokens, which the engine sets at admission
        where the caller left it None (until the context is full)."""
        limit = self.sampling_params.max_tokens
        assert limit is not None, "max_tokens is set when the engine admits a request"
        return limit

    @property
    def max_total_tokens(self) -> int:
        """Upper bound on tokens this request can ever hold in the KV cache."""
        return self.num_prompt_tokens + self.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @functools.cached_property
    def sequence_key(self) -> SequenceKey:
        """What the prefix cache is asked with about this request. Built once (the scheduler asks at
        every step): its id never changes, nor do its parameters' key ingredients (the engine's
        checks bound other fields), and its token slice reads the tokens as they grow."""
        return sequence_key(self.sampling_params, self.token_slice, self.request_id, len(self.prompt_token_ids))

    def token_at(self, position: int) -> int:
        """The known token at `position`: prompt, output, then speculative tokens."""
        n_prompt = len(self.prompt_token_ids)
        if position < n_prompt:
            return self.prompt_token_ids[position]
        n_verified = n_prompt + len(self.output_token_ids)
        if position < n_verified:
            return self.output_token_ids[position - n_prompt]
        return self.spec_token_ids[position - n_verified]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Known tokens [start, end): prompt, output, then speculative tokens."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        n_verified = n_prompt + len(self.output_token_ids)
        if end > n_verified:
            return self.token_slice(start, n_verified) + self.spec_token_ids[max(0, start - n_verified): end - n_verified]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]
