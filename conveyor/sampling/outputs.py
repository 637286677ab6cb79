"""What sampling returns for one step (pure Python: the simulator's runner builds it too)."""
from __future__ import annotations

from dataclasses import dataclass


class TokenLogprobs(dict[int, float]):
    """{token id: logprob} at one position: its chosen (or, for a prompt, actual) token's and the
    top alternatives asked for; `rank` is that token's place in the whole distribution (1: the
    likeliest; tokens as likely as it count before it, as vLLM counts)."""

    def __init__(self, entries: dict[int, float], rank: int) -> None:
        super().__init__(entries)
        self.rank = rank


@dataclass
class SamplerOutput:
    """What a runner returns for one step: a token per sampling request, in order."""

    tokens: list[int]
    # Per sampling request: {token id: logprob} for the chosen token and the top alternatives,
    # or None where the request did not ask for logprobs (the list is None if nobody did).
    logprobs: list[dict[int, float] | None] | None = None
    # request id -> {token id: logprob} for each prompt token this step scored, in order.
    prompt_logprobs: dict[str, list[dict[int, float]]] | None = None
    # Per sampling request: how many of its speculative tokens the model accepted; `tokens` holds
    # the token sampled after them (None: no request verified any this step).
    num_accepted: list[int] | None = None
    # Sampling requests (indices) whose row had no token left once masked (allowed_token_ids, bad
    # words, min_tokens, a grammar): their token is meaningless and the request cannot go on.
    blocked: list[int] | None = None
    # Embedding requests: request id -> (the sum of the final-normed hidden states of the positions
    # it pooled this step, how many; inputs' pooled_rows). Summed in float64.
    pooled: dict[str, tuple[list[float], int]] | None = None


def verify_rows(row_tokens: list[int], drafts: list[list[int]]) -> tuple[list[int], list[int]]:
    """Each request's run of sampled rows (1 + len(its drafts)) -> (the token after its accepted
    drafts, how many were accepted). Row j holds the token the model chose at the j-th draft's
    position; a draft stands while it is the chosen one, and the first chosen token that differs
    (or the one after the last draft) is the model's own. For a request that samples, drawing a
    row's token from the model's distribution and keeping the draft only when they agree is
    rejection sampling for a draft that proposes one token with certainty (an n-gram lookup's): a
    draft x is kept with probability p(x), and a rejection yields p without x, renormalized, so
    every token is distributed exactly as without speculation."""
    tokens, accepted, at = [], [], 0
    for draft in drafts:
        rows = row_tokens[at: at + len(draft) + 1]
        at += len(draft) + 1
        count = 0
        while count < len(draft) and rows[count] == draft[count]:
            count += 1
        tokens.append(rows[count])
        accepted.append(count)
    return tokens, accepted
