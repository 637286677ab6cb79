"""How many tokens to propose, per request and per step: a cost model, not a constant.

A proposed token costs one more row in the step, a sampled one (`StepCostModel`: step time = base +
per_row * rows + per_sampled * sampled rows, fitted online to the engine's own steps) plus what proposing it took (a draft model's
share of its own steps; nothing for a lookup), and is worth a token of output only if it and
every proposal before it are accepted. With the request's acceptance rate a (accepted proposals
over proposals verified, recent steps weighted most), the i-th proposal yields a^i tokens on
average; one token is worth the step's time over the tokens the step yields. So a request gets the
deepest i (up to num_speculative_tokens) where a^i * step_time / tokens_per_step >= per_row +
per_sampled + proposal cost. One
stream, with its step mostly spent streaming weights, speculates deeply even at modest acceptance;
a large batch, whose every row already pays for itself, speculates only where proposals are
nearly always right. That is what keeps speculation from slowing a busy server.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Protocol, Sequence

from conveyor.config import SpeculativeConfig
from conveyor.request import Request, RequestStatus
from conveyor.speculative.ngram import NgramProposer


class Proposer(Protocol):
    # Seconds of the proposer's own work per token it proposes (0 for a lookup).
    cost_per_token: float

    def propose(self, requests: Sequence[Request], depths: Sequence[int]) -> list[list[int]]:
        """Up to depths[i] tokens to follow requests[i]'s verified tokens (fewer, or none, allowed)."""
        ...


def can_speculate(request: Request) -> bool:
    """Whether the request's next tokens may be proposed and verified in one step: it decodes
    (every known token but the last is computed), and each of its rows is sampled as it would be
    without speculation: no logprobs (reported one token a step), no penalties, bad words of more
    than one token or min_tokens, whose adjustments depend on the output so far (a banned single
    token is masked in every row alike). A grammar's masks are made for each row
    (conveyor/structured: a proposal is cut at the first token its grammar forbids)."""
    p = request.sampling_params
    return (request.status is RequestStatus.RUNNING and bool(request.output_token_ids)
            and request.num_computed_tokens == request.num_tokens - 1
            and p.logprobs is None and not p.penalized and all(len(ids) == 1 for ids in p.bad_words_token_ids)
            and len(request.output_token_ids) >= p.min_tokens)


class StepCostModel:
    """Least squares of step time on the rows a step computes and the rows it samples, over recent
    steps (exponentially forgotten): time = base + per_row * rows + per_sampled * sampled. A sampled
    row (a decode, or a proposal being verified) also pays the vocabulary projection and the
    sampler, which a prefill row does not; one slope for both would price a proposal at a prefill
    row's cost. Steps that all sample every row (decodes only) cannot tell the two slopes apart: a
    small ridge term then splits their sum, which is what a proposal costs, between them."""

    RIDGE = 1e-6

    def __init__(self, memory: float = 0.98) -> None:
        self.memory = memory
        # Sums of x_i * x_j and of x_i * seconds, for x = (1, rows, sampled rows).
        self._sums = [[0.0] * 4 for _ in range(3)]

    def observe(self, rows: int, sampled: int, seconds: float) -> None:
        x = (1.0, float(rows), float(sampled))
        for i, row in enumerate(self._sums):
            for j in range(3):
                row[j] = self.memory * row[j] + x[i] * x[j]
            row[3] = self.memory * row[3] + x[i] * seconds

    def fit(self) -> tuple[float, float, float] | None:
        """(base, per_row, per_sampled) seconds; None until steps of different sizes were seen."""
        s = self._sums
        n = s[0][0]
        if n == 0 or s[1][1] / n - (s[0][1] / n) ** 2 < 0.25:  # every step had (almost) the same rows
            return None
        a = [row[:] for row in s]
        ridge = self.RIDGE * (a[1][1] + a[2][2])
        a[1][1] += ridge
        a[2][2] += ridge
        for col in range(3):  # Gaussian elimination with partial pivoting on the 3 x 4 system
            pivot = max(range(col, 3), key=lambda r: abs(a[r][col]))
            if abs(a[pivot][col]) < 1e-300:
                return None
            a[col], a[pivot] = a[pivot], a[col]
            for r in range(3):
                if r != col:
                    factor = a[r][col] / a[col][col]
                    a[r] = [v - factor * w for v, w in zip(a[r], a[col])]
        base, per_row, per_sampled = (a[i][3] / a[i][i] for i in range(3))
        return base, max(0.0, per_row), max(0.0, per_sampled)

    def step_time(self, rows: int, sampled: int) -> float | None:
        fit = self.fit()
        return None if fit is None else fit[0] + fit[1] * rows + fit[2] * sampled

    @property
    def per_proposal(self) -> float | None:
        """Seconds one more proposed token adds to a step: a row, and a sampled one."""
        fit = self.fit()
        return None if fit is None else fit[1] + fit[2]


@dataclass
class _Acceptance:
    accepted: float = 1.0  # a prior of one accepted and one rejected proposal: a = 0.5
    rejected: float = 1.0

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def add(self, accepted: int, rejected: bool, forget: float) -> None:
        self.accepted = forget * self.accepted + accepted
        self.rejected = forget * self.rejected + rejected


class Speculator:
    # Each verification counts this much less than the one after it: a request's text changes
    # kind (prose, a copied block) over its life, and the rate should follow within a few steps.
    FORGET = 0.8
    # The rate over all requests (forgotten more slowly) is a new request's prior, weighted as this
    # many verifications: requests of one workload resemble each other more than they resemble 0.5.
    SERVER_FORGET = 0.98
    PRIOR_WEIGHT = 2.0

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        """`proposer`: the draft model's (conveyor/engine/draft.py); None for prompt lookup."""
        self.config = config
        self.proposer: Proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.cost = StepCostModel()
        self._acceptance: weakref.WeakKeyDictionary[Request, _Acceptance] = weakref.WeakKeyDictionary()
        self._server_acceptance = _Acceptance()
        # Since start: proposals verified, accepted, and accepted at each depth (vLLM's metrics).
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.num_speculative_tokens

    def observe_step(self, rows: int, sampled: int, seconds: float) -> None:
        """A step computed `rows` rows, `sampled` of them sampled (proposals verified included)."""
        self.cost.observe(rows, sampled, seconds)

    def observe_verified(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """A step verified num_drafted proposals of the request and kept the first num_accepted."""
        if not num_drafted:
            return
        stats = self._acceptance.get(request)
        if stats is None:
            stats = self._acceptance[request] = self._prior()
        stats.add(num_accepted, num_accepted < num_drafted, self.FORGET)
        self._server_acceptance.add(num_accepted, num_accepted < num_drafted, self.SERVER_FORGET)
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def depth(self, request: Request, rows: int, tokens: int) -> int:
        """How many tokens to propose for the request in a step like the last one (`rows` rows,
        `tokens` of them sampled, yielding a token each), at most num_speculative_tokens; the
        module's cost rule."""
        most = self.config.num_speculative_tokens
        if not self.config.adaptive:
            return most
        per_row, step = self.cost.per_proposal, self.cost.step_time(rows, tokens)
        if per_row is None or step is None:
            return most
        per_row += self.proposer.cost_per_token
        if per_row == 0.0:
            return most
        token_value = step / max(1, tokens)
        stats = self._acceptance.get(request)
        rate = (stats or self._prior()).rate
        if rate >= 1.0:
            return most
        if rate <= 0.0 or token_value < per_row:
            return 0
        # The deepest i with rate**i * token_value >= per_row.
        return max(0, min(most, math.floor(math.log(per_row / token_value) / math.log(rate))))

    def _prior(self) -> _Acceptance:
        # Bounded away from 0 and 1: a new request always gets a first proposal to measure itself by.
        rate = min(0.9, max(0.1, self._server_acceptance.rate))
        return _Acceptance(self.PRIOR_WEIGHT * rate, self.PRIOR_WEIGHT * (1.0 - rate))

    def propose(self, requests: Sequence[Request], rows: int) -> None:
        """Set the speculative tokens of each request that may have them, for the next step."""
        chosen, depths = [], []
        for request in requests:
            if not can_speculate(request):
                continue
            # Never past max_tokens: the last token a request may have is its own, never a proposal.
            room = request.max_tokens - len(request.output_token_ids) - 1
            depth = min(room, self.depth(request, rows, len(requests)))
            if depth > 0:
                chosen.append(request)
                depths.append(depth)
        if chosen:
            for request, tokens in zip(chosen, self.proposer.propose(chosen, depths)):
                request.spec_token_ids = tokens
