"""Vectorised sampling: logit adjustments (allowed tokens, bad words, min_tokens, logit_bias,
penalties), greedy, temperature,
min-p, top-k, top-p and per-request seeds, in one pass per step over the [rows, vocab] logits.

Each sampled row draws one uniform number and inverts its CDF. The number comes from the
request's own generator when it has a seed, so its draws do not depend on its batch-mates.
Rows that use no adjustment pay nothing for them: each adjustment builds its tensors only for
the rows that ask for it.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Callable, MutableMapping, Sequence

import torch

from conveyor.request import Request
from conveyor.sampling.outputs import SamplerOutput, verify_rows


def _holds_back_stops(request: Request) -> bool:
    return len(request.output_token_ids) < request.sampling_params.min_tokens


def _banned_by_bad_words(request: Request) -> list[int]:
    """The last token of every bad word whose other tokens end the output so far."""
    out = request.output_token_ids
    banned = []
    for ids in request.sampling_params.bad_words_token_ids:
        before = len(ids) - 1
        if before <= len(out) and (before == 0 or out[-before:] == ids[:-1]):
            banned.append(ids[-1])
    return banned


def adjusts_logits(request: Request) -> bool:
    """Whether adjust_logits may change this request's row this step."""
    p = request.sampling_params
    return (_holds_back_stops(request) or bool(p.logit_bias) or p.penalized or p.allowed_token_ids is not None
            or bool(p.bad_words_token_ids))


def _mask(logits: torch.Tensor, cells: dict[int, Sequence[int]]) -> None:
    """Set logits[row, token] to -inf for each row's tokens (those inside the vocabulary)."""
    vocab = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    for row, tokens in cells.items():
        ids = [t for t in tokens if t < vocab]
        rows += [row] * len(ids)
        cols += ids
    if rows:
        logits[torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)] = float("-inf")


def _outside(request: Request, vocab: int, masks: MutableMapping[Request, torch.Tensor] | None) -> torch.Tensor:
    """[vocab] bool, True where a token is not in the request's allowed_token_ids: made once per
    request when `masks` keeps it (a long list must not cost every step of everyone's batch)."""
    mask = masks.get(request) if masks is not None else None
    if mask is None or mask.shape[0] != vocab:
        ids = [t for t in request.sampling_params.allowed_token_ids or () if t < vocab]
        mask = torch.ones(vocab, dtype=torch.bool)
        mask[torch.tensor(ids, dtype=torch.long)] = False
        if masks is not None:
            masks[request] = mask
    return mask


def adjust_logits(logits: torch.Tensor, requests: Sequence[Request], eos_token_ids: Sequence[int] = (),
                  allowed_masks: MutableMapping[Request, torch.Tensor] | None = None) -> torch.Tensor:
    """allowed_token_ids, bad words, min_tokens, logit_bias, repetition/frequency/presence
    penalties, before temperature (vLLM's order). Returns `logits` itself when no request adjusts
    anything, else an adjusted copy, so the caller's logits stay the model's own (logprobs are
    reported from those). `allowed_masks` keeps each request's allowed-token mask between steps."""
    params = [r.sampling_params for r in requests]
    if not any(adjusts_logits(r) for r in requests):
        return logits
    allowed = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    penalized = [i for i, p in enumerate(params) if p.penalized]
    logits = logits.clone()
    vocab = logits.shape[-1]
    if allowed:
        outside = torch.stack([_outside(requests[i], vocab, allowed_masks) for i in allowed])
        logits[allowed] = logits[allowed].masked_fill(outside, float("-inf"))
    _mask(logits, {i: _banned_by_bad_words(r) for i, r in enumerate(requests) if params[i].bad_words_token_ids})
    # EOS and stop tokens may not end the request before min_tokens.
    _mask(logits, {i: list(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids)))
                   for i, (r, p) in enumerate(zip(requests, params)) if _holds_back_stops(r)})
    if biased:
        bias_rows: list[int] = []
        bias_cols: list[int] = []
        values: list[float] = []
        for i in biased:
            bias = params[i].logit_bias
            bias_rows += [i] * len(bias)
            bias_cols += bias.keys()
            values += bias.values()
        logits.index_put_((torch.tensor(bias_rows, dtype=torch.long), torch.tensor(bias_cols, dtype=torch.long)),
                          torch.tensor(values, dtype=logits.dtype), accumulate=True)
    if penalized:
        logits[penalized] = _penalize(logits[penalized], [requests[i] for i in penalized])
    return logits


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    """[len(token_lists), vocab] float counts, from one scatter over the lists padded to one length
    (padding goes to a spare column that is dropped)."""
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), width), vocab, dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        if tokens:
            padded[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    counts = torch.zeros(len(token_lists), vocab + 1)
    counts.scatter_add_(1, padded, torch.ones(padded.shape))
    return counts[:, :vocab]


def _penalize(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """logits: the rows of `requests` only, every one of which uses a penalty."""
    params = [r.sampling_params for r in requests]
    vocab = logits.shape[-1]
    output_counts = _token_counts([r.output_token_ids for r in requests], vocab)
    repetition = torch.tensor([p.repetition_penalty for p in params])
    if bool((repetition != 1.0).any()):
        prompt_seen = _token_counts([r.prompt_token_ids if p.repetition_penalty != 1.0 else () for r, p in
                                     zip(requests, params)], vocab) > 0
        seen = prompt_seen | (output_counts > 0)
        factor = torch.where(seen, repetition[:, None], torch.ones(()))
        logits = torch.where(logits > 0, logits / factor, logits * factor)
    frequency = torch.tensor([p.frequency_penalty for p in params])
    presence = torch.tensor([p.presence_penalty for p in params])
    return logits - frequency[:, None] * output_counts - presence[:, None] * (output_counts > 0)


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids: Sequence[int] = (),
                 argmax: Callable[[torch.Tensor], torch.Tensor] = torch_argmax) -> None:
        """argmax: [rows, vocab] -> each row's first index of its maximum (NaN first), as
        torch.argmax; the runner passes the model's vectorised one (sampling sits above no model)."""
        self._argmax = argmax
        self._generator = torch.Generator().manual_seed(seed)
        self._request_generators: weakref.WeakKeyDictionary[Request, torch.Generator] = weakref.WeakKeyDictionary()
        self._allowed_masks: weakref.WeakKeyDictionary[Request, torch.Tensor] = weakref.WeakKeyDictionary()
        self.eos_token_ids = tuple(eos_token_ids)  # what min_tokens holds back, besides stop_token_ids

    @staticmethod
    def argmax_is_all(requests: Sequence[Request]) -> bool:
        """Whether these requests' tokens are the argmax of the model's own logits and nothing else
        is read from them: greedy, no logprobs, and no adjustment (adjust_logits) in force."""
        return all(r.sampling_params.greedy and r.sampling_params.logprobs is None and not adjusts_logits(r)
                   for r in requests)

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """logits: fp32 [len(requests), vocab]."""
        tokens = self._sample(adjust_logits(logits, requests, self.eos_token_ids, self._allowed_masks), requests)
        wanted = [r.sampling_params.logprobs for r in requests]
        if all(k is None for k in wanted):
            return SamplerOutput(tokens)
        return SamplerOutput(tokens, self._logprobs(logits, tokens, wanted))

    def verify(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """logits: fp32, 1 + len(spec_token_ids) rows per request, in order. Samples every row as
        its position would be sampled without speculation, then keeps each request's drafts while
        they agree (verify_rows). A seeded request's generator ends where drawing only the rows
        it keeps would leave it, so its output does not depend on whether it speculated.
        Only requests whose rows sample independently of the tokens before them speculate
        (conveyor/speculative's eligibility): no logprobs, penalties or output-dependent masks."""
        rows = [r for r in requests for _ in range(1 + len(r.spec_token_ids))]
        seeded = [r for r in requests if r.spec_token_ids and r.sampling_params.seed is not None]
        before = {r: self._generator_for(r).get_state() for r in seeded}
        row_tokens = self._sample(adjust_logits(logits, rows, self.eos_token_ids, self._allowed_masks), rows)
        tokens, accepted = verify_rows(row_tokens, [r.spec_token_ids for r in requests])
        for request, count in zip(requests, accepted):
            if request in before and count < len(request.spec_token_ids):
                generator = self._request_generators[request]
                generator.set_state(before[request])
                for _ in range(count + 1):
                    torch.rand(1, generator=generator)
        wanted = [r.sampling_params.logprobs for r in rows]
        if all(k is None for k in wanted):
            return SamplerOutput(tokens, num_accepted=accepted)
        row_logprobs = self._logprobs(logits, row_tokens, wanted)
        last_rows = list(itertools.accumulate(1 + len(r.spec_token_ids) for r in requests))
        return SamplerOutput(tokens, [row_logprobs[i - 1] for i in last_rows], num_accepted=accepted)

    @staticmethod
    def prompt_logprobs(logits: torch.Tensor, targets: list[int], top: int) -> list[dict[int, float]]:
        """{token: logprob} for each row's target token and its `top` best alternatives."""
        logp = torch.log_softmax(logits, dim=-1)
        chosen = logp[torch.arange(len(targets)), torch.tensor(targets, dtype=torch.long)].tolist()
        top_values, top_ids = logp.topk(top, dim=-1) if top else (logp[:, :0], logp[:, :0].long())
        result = []
        for target, value, ids, values in zip(targets, chosen, top_ids.tolist(), top_values.tolist()):
            entry = dict(zip(ids, values))
            entry[target] = value
            result.append(entry)
        return result

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: list[int], wanted: list[int | None]) -> list[dict[int, float] | None]:
        # Of the model's own distribution (before temperature and truncation), as vLLM reports them.
        rows = [i for i, k in enumerate(wanted) if k is not None]
        logp = torch.log_softmax(logits[rows], dim=-1)
        top = max(wanted[i] for i in rows)  # type: ignore[type-var]
        top_values, top_ids = logp.topk(top, dim=-1) if top else (logp[:, :0], logp[:, :0].long())
        chosen = logp[torch.arange(len(rows)), torch.tensor([tokens[i] for i in rows])]
        result: list[dict[int, float] | None] = [None] * len(tokens)
        for j, i in enumerate(rows):
            k = wanted[i]
            entry = dict(zip(top_ids[j, :k].tolist(), top_values[j, :k].tolist()))
            entry[tokens[i]] = float(chosen[j])
            result[i] = entry
        return result

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        params = [r.sampling_params for r in requests]
        greedy = self._argmax(logits)
        if all(p.greedy for p in params):
            return greedy.tolist()
        temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params])
        scaled = logits / temperature[:, None]
        if any(p.min_p > 0.0 for p in params):
            scaled = self._min_p(scaled, params)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            scaled = self._truncate(scaled, params)
        cdf = scaled.softmax(dim=-1).cumsum(dim=-1)
        uniform = self._uniforms(requests) * cdf[:, -1]
        sampled = torch.searchsorted(cdf, uniform[:, None]).squeeze(1).clamp_(max=logits.shape[-1] - 1)
        is_greedy = torch.tensor([p.greedy for p in params])
        return torch.where(is_greedy, greedy, sampled).tolist()

    @staticmethod
    def _min_p(logits: torch.Tensor, params: Sequence) -> torch.Tensor:
        # Of the tempered distribution, before top-k/top-p (vLLM): p < min_p * max p is dropped.
        # In log space: logit < max logit + log(min_p); min_p 0 gives -inf and drops nothing.
        min_p = torch.tensor([p.min_p for p in params])
        floor = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
        return logits.masked_fill(logits < floor, float("-inf"))

    @staticmethod
    def _truncate(logits: torch.Tensor, params: Sequence) -> torch.Tensor:
        vocab = logits.shape[-1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]).clamp_(max=vocab)
        ranks = torch.arange(vocab)[None, :]
        drop = ranks >= top_k[:, None]
        top_p = torch.tensor([p.top_p for p in params])
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it does.
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= top_p[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)

    # A seeded request that moves to another engine (KV handover) takes its draws along with it.
    def generator_state(self, request: Request) -> torch.Tensor | None:
        gen = self._request_generators.get(request)
        return None if gen is None else gen.get_state()

    def set_generator_state(self, request: Request, state: torch.Tensor) -> None:
        self._request_generators[request] = torch.Generator().set_state(state)

    # A step that raised is run again on part of its batch (LLMEngine's failure isolation): the
    # retry must draw the numbers the first try would have drawn.
    def save_rng_state(self, requests: Sequence[Request]) -> tuple[torch.Tensor, dict[Request, torch.Tensor | None]]:
        """The shared generator and the seeded generators of `requests` (None: not created yet)."""
        seeded = {}
        for request in requests:
            if request.sampling_params.seed is not None:
                gen = self._request_generators.get(request)
                seeded[request] = None if gen is None else gen.get_state()
        return self._generator.get_state(), seeded

    def restore_rng_state(self, state: tuple[torch.Tensor, dict[Request, torch.Tensor | None]]) -> None:
        shared, seeded = state
        self._generator.set_state(shared)
        for request, request_state in seeded.items():
            if request_state is None:
                self._request_generators.pop(request, None)
            else:
                self._request_generators[request].set_state(request_state)

    def _generator_for(self, request: Request) -> torch.Generator:
        """A seeded request's own generator, made at its first draw."""
        gen = self._request_generators.get(request)
        if gen is None:
            gen = torch.Generator().manual_seed(request.sampling_params.seed)  # type: ignore[arg-type]
            self._request_generators[request] = gen
        return gen

    def _uniforms(self, requests: Sequence[Request]) -> torch.Tensor:
        uniform = torch.rand(len(requests), generator=self._generator)
        for i, request in enumerate(requests):
            if request.sampling_params.seed is not None:
                uniform[i] = torch.rand(1, generator=self._generator_for(request))
        return uniform
