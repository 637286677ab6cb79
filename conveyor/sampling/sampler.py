"""Vectorised sampling: logit adjustments (allowed tokens, bad words, min_tokens, logit_bias,
penalties), greedy, temperature, min-p, top-k, top-p and per-request seeds, over the [rows, vocab]
logits of a step. Nothing sorts a whole row: top-k and top-p keep candidates found by `topk`, and
penalties touch only the tokens a request has seen.

Each sampled row draws one uniform number and inverts its CDF. The number comes from the
request's own generator when it has a seed, so its draws do not depend on its batch-mates.
Rows that use no adjustment pay nothing for them: each adjustment builds its tensors only for
the rows that ask for it.
"""
from __future__ import annotations

import itertools
import weakref
from collections import Counter
from typing import Callable, MutableMapping, Sequence

import torch

from conveyor.request import Request
from conveyor.sampling.chain import (FIRST_CANDIDATE_WIDTH, InfillVocabulary, cuts_first_by_top_k, draw_by_chain,
                                     first_width, first_windows, kept_by_top_k)
from conveyor.sampling.params import SamplingParams
from conveyor.sampling.outputs import SamplerOutput, TokenLogprobs, verify_rows


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
        _penalize_(logits, {i: requests[i] for i in penalized})
    return logits


def _penalize_(logits: torch.Tensor, rows: dict[int, Request]) -> None:
    """Applies each row's penalties in place. A penalty changes only tokens its request has seen,
    so only those cells are read and written, not the vocabulary."""
    vocab = logits.shape[-1]
    cell_rows: list[int] = []
    cell_tokens: list[int] = []
    counts: list[int] = []
    repetition: list[float] = []
    frequency: list[float] = []
    presence: list[float] = []
    for row, request in rows.items():
        p = request.sampling_params
        output = Counter(t for t in request.output_token_ids if t < vocab)
        seen = set(output)
        if p.repetition_penalty != 1.0:
            seen.update(t for t in request.prompt_token_ids if t < vocab)
        cell_rows += [row] * len(seen)
        cell_tokens += seen
        counts += (output[t] for t in seen)
        repetition += [p.repetition_penalty] * len(seen)
        frequency += [p.frequency_penalty] * len(seen)
        presence += [p.presence_penalty] * len(seen)
    if not cell_rows:
        return
    cells = (torch.tensor(cell_rows, dtype=torch.long), torch.tensor(cell_tokens, dtype=torch.long))
    values = logits[cells]
    factor = torch.tensor(repetition)
    values = torch.where(values > 0, values / factor, values * factor)
    count = torch.tensor(counts, dtype=logits.dtype)
    logits[cells] = values - torch.tensor(frequency) * count - torch.tensor(presence) * (count > 0)


def _masks_tokens(request: Request) -> bool:
    """Whether adjust_logits may set some of this request's logits to -inf this step."""
    p = request.sampling_params
    return p.allowed_token_ids is not None or bool(p.bad_words_token_ids) or _holds_back_stops(request)


def blocked_rows(logits: torch.Tensor, requests: Sequence[Request], masked_rows: Sequence[int] = ()) -> list[int]:
    """The rows of `logits` (adjusted, grammar masks applied) where every token is -inf: sampling
    would return an arbitrary token there. Only rows that a mask touched are looked at, in one
    vectorised pass; the others pay nothing."""
    rows = sorted(set(masked_rows).union(i for i, r in enumerate(requests) if _masks_tokens(r)))
    if not rows:
        return []
    # A row's maximum, on a gathered copy (index_select: list indexing costs ~5x as much).
    picked = logits if len(rows) == logits.shape[0] else logits.index_select(0, torch.tensor(rows))
    dead = picked.amax(dim=-1) == float("-inf")
    return [rows[i] for i in dead.nonzero().flatten().tolist()]


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def _min_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    # Of the tempered distribution, before top-k/top-p (vLLM): p < min_p * max p is dropped.
    # In log space: logit < max logit + log(min_p); min_p 0 gives -inf and drops nothing.
    min_p = torch.tensor([p.min_p for p in params])
    floor = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
    return logits.masked_fill(logits < floor, float("-inf"))


def _draw_by_cdf(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Each row's first position whose cumulative softmax reaches its uniform share of the total."""
    cdf = logits.softmax(dim=-1).cumsum(dim=-1)
    position = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None]).squeeze(1)
    return position.clamp_(max=logits.shape[-1] - 1)


def _draw_from_vocabulary(scaled: torch.Tensor, params: Sequence[SamplingParams], uniform: torch.Tensor) -> torch.Tensor:
    return _draw_by_cdf(scaled, uniform)


def nucleus_candidates(scaled: torch.Tensor, params: Sequence[SamplingParams], width: int = FIRST_CANDIDATE_WIDTH,
                       row_log_total: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, logits), each [rows, width]: every row's tokens that survive top-k and then
    top-p (the smallest best-first prefix whose mass reaches top_p, of the distribution top-k
    leaves; the likeliest token always survives), best first, the rest of the width at -inf.
    The tokens a full sort of the row keeps, found by `topk` over a window that widens, for the
    rows whose nucleus runs past it only."""
    vocab = scaled.shape[-1]
    top_k = [kept_by_top_k(p.top_k, vocab) for p in params]
    limit = torch.tensor(top_k)
    top_p = torch.tensor([p.top_p for p in params])
    by_k = limit < vocab
    # A row with top-k is normalised over its k best, so the window holds them all; a row without
    # over its whole row, so its window need only reach the end of its nucleus.
    width = min(vocab, max([k for k in top_k if k < vocab] + [1 if bool(by_k.all()) else width]))
    if row_log_total is None:
        row_log_total = torch.logsumexp(scaled, dim=-1) if not bool(by_k.all()) else torch.zeros(len(params))
    values, ids = scaled.topk(width, dim=-1)
    drop = torch.arange(width)[None, :] >= limit[:, None]
    values = values.masked_fill(drop, float("-inf"))
    log_total = torch.where(by_k, torch.logsumexp(values, dim=-1), row_log_total) if bool(by_k.any()) else row_log_total
    probs = (values - log_total[:, None]).exp()
    # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it does.
    mass = probs.cumsum(dim=-1)
    drop |= (mass - probs) >= top_p[:, None]
    drop |= values == float("-inf")
    drop[:, 0] = False
    values = values.masked_fill(drop, float("-inf"))
    past = torch.nonzero(~by_k & (mass[:, -1] < top_p)).flatten().tolist()
    if width == vocab or not past:
        return ids, values
    wide_ids, wide_values = nucleus_candidates(scaled[past], [params[i] for i in past], min(vocab, width * 8),
                                               row_log_total[past])
    pad = wide_ids.shape[1] - width
    ids = torch.nn.functional.pad(ids, (0, pad))
    values = torch.nn.functional.pad(values, (0, pad), value=float("-inf"))
    ids[past], values[past] = wide_ids, wide_values
    return ids, values


def _draw_from_candidates(scaled: torch.Tensor, params: Sequence[SamplingParams], uniform: torch.Tensor) -> torch.Tensor:
    """Draws over the candidates in vocabulary order, as a draw over the whole masked row does, so
    a seeded request draws the token it would draw were its row sorted whole."""
    ids, values = nucleus_candidates(scaled, params)
    vocab_order = ids.masked_fill(values == float("-inf"), scaled.shape[-1]).argsort(dim=-1)
    ids, values = ids.gather(-1, vocab_order), values.gather(-1, vocab_order)
    return ids.gather(-1, _draw_by_cdf(values, uniform)[:, None]).squeeze(1)


def _ranks(logp: torch.Tensor, chosen: torch.Tensor, rows_at_once: int = 64) -> list[int]:
    """Each row's count of tokens at least as likely as its chosen one (vLLM's rank; 1: the
    likeliest), a few rows at a time: a prompt's thousands of rows would otherwise hold a
    vocabulary-wide comparison for all of them at once."""
    counts = [(logp[i:i + rows_at_once] >= chosen[i:i + rows_at_once, None]).sum(dim=-1)
              for i in range(0, logp.shape[0], rows_at_once)]
    return torch.cat(counts).clamp_(min=1).tolist() if counts else []


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids: Sequence[int] = (),
                 argmax: Callable[[torch.Tensor], torch.Tensor] = torch_argmax,
                 infill: InfillVocabulary | None = None) -> None:
        """argmax: [rows, vocab] -> each row's first index of its maximum (NaN first), as
        torch.argmax; the runner passes the model's vectorised one (sampling sits above no model).
        infill: what a sampler chain's infill step needs of the vocabulary (None: no such step)."""
        self._argmax = argmax
        self._infill = infill
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

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request], masked_rows: Sequence[int] = ()) -> SamplerOutput:
        """logits: fp32 [len(requests), vocab]; `masked_rows`: those a grammar mask was applied to."""
        adjusted = adjust_logits(logits, requests, self.eos_token_ids, self._allowed_masks)
        tokens = self._sample(adjusted, requests)
        blocked = blocked_rows(adjusted, requests, masked_rows) or None
        wanted = [r.sampling_params.logprobs for r in requests]
        if all(k is None for k in wanted):
            return SamplerOutput(tokens, blocked=blocked)
        return SamplerOutput(tokens, self._logprobs(logits, tokens, wanted), blocked=blocked)

    def verify(self, logits: torch.Tensor, requests: Sequence[Request], masked_rows: Sequence[int] = ()) -> SamplerOutput:
        """logits: fp32, 1 + len(spec_token_ids) rows per request, in order. Samples every row as
        its position would be sampled without speculation, then keeps each request's drafts while
        they agree (verify_rows). A seeded request's generator ends where drawing only the rows
        it keeps would leave it, so its output does not depend on whether it speculated.
        Only requests whose rows sample independently of the tokens before them speculate
        (conveyor/speculative's eligibility): no logprobs, penalties or output-dependent masks."""
        rows = [r for r in requests for _ in range(1 + len(r.spec_token_ids))]
        seeded = [r for r in requests if r.spec_token_ids and r.sampling_params.seed is not None]
        before = {r: self._generator_for(r).get_state() for r in seeded}
        adjusted = adjust_logits(logits, rows, self.eos_token_ids, self._allowed_masks)
        row_tokens = self._sample(adjusted, rows)
        tokens, accepted = verify_rows(row_tokens, [r.spec_token_ids for r in requests])
        dead = set(blocked_rows(adjusted, rows, masked_rows))
        firsts = list(itertools.accumulate((1 + len(r.spec_token_ids) for r in requests), initial=0))
        # Only the row whose token is kept matters: the ones after a rejected draft are never used.
        blocked = [i for i, (first, count) in enumerate(zip(firsts, accepted)) if first + count in dead] or None
        for request, count in zip(requests, accepted):
            if request in before and count < len(request.spec_token_ids):
                generator = self._request_generators[request]
                generator.set_state(before[request])
                for _ in range(count + 1):
                    torch.rand(1, generator=generator)
        wanted = [r.sampling_params.logprobs for r in rows]
        if all(k is None for k in wanted):
            return SamplerOutput(tokens, num_accepted=accepted, blocked=blocked)
        row_logprobs = self._logprobs(logits, row_tokens, wanted)
        last_rows = list(itertools.accumulate(1 + len(r.spec_token_ids) for r in requests))
        return SamplerOutput(tokens, [row_logprobs[i - 1] for i in last_rows], num_accepted=accepted, blocked=blocked)

    @staticmethod
    def prompt_logprobs(logits: torch.Tensor, targets: list[int], top: int) -> list[dict[int, float]]:
        """{token: logprob} for each row's target token and its `top` best alternatives, with the
        target's rank (TokenLogprobs)."""
        logp = torch.log_softmax(logits, dim=-1)
        chosen = logp[torch.arange(len(targets)), torch.tensor(targets, dtype=torch.long)]
        ranks = _ranks(logp, chosen)
        top_values, top_ids = logp.topk(top, dim=-1) if top else (logp[:, :0], logp[:, :0].long())
        result: list[dict[int, float]] = []
        for target, value, rank, ids, values in zip(targets, chosen.tolist(), ranks, top_ids.tolist(),
                                                     top_values.tolist()):
            entry = dict(zip(ids, values))
            entry[target] = value
            result.append(TokenLogprobs(entry, rank))
        return result

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: list[int], wanted: list[int | None]) -> list[dict[int, float] | None]:
        # Of the model's own distribution (before temperature and truncation), as vLLM reports them.
        rows = [i for i, k in enumerate(wanted) if k is not None]
        logp = torch.log_softmax(logits[rows], dim=-1)
        top = max(wanted[i] for i in rows)  # type: ignore[type-var]
        top_values, top_ids = logp.topk(top, dim=-1) if top else (logp[:, :0], logp[:, :0].long())
        chosen = logp[torch.arange(len(rows)), torch.tensor([tokens[i] for i in rows])]
        ranks = _ranks(logp, chosen)
        result: list[dict[int, float] | None] = [None] * len(tokens)
        for j, i in enumerate(rows):
            k = wanted[i]
            entry = dict(zip(top_ids[j, :k].tolist(), top_values[j, :k].tolist()))
            entry[tokens[i]] = float(chosen[j])
            result[i] = TokenLogprobs(entry, ranks[j])
        return result

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        params = [r.sampling_params for r in requests]
        greedy = self._argmax(logits)
        if all(p.greedy for p in params):
            return greedy.tolist()
        uniform = self._uniforms(requests)
        tokens = greedy.clone()
        drawn = [i for i, p in enumerate(params) if not p.greedy]
        chained = [i for i in drawn if params[i].sampler_chain is not None]  # llama.cpp's order, row by row
        if chained:
            vocab = logits.shape[-1]
            widths = [first_width(params[i].sampler_chain or (), params[i].top_k, vocab) for i in chained]
            totals = [not cuts_first_by_top_k(params[i].sampler_chain or (), params[i].top_k, vocab) for i in chained]
            chain_logits = logits if len(chained) == logits.shape[0] else logits[chained]  # a copy only of some rows
            for i, window in zip(chained, first_windows(chain_logits, widths, totals)):
                p = params[i]
                tokens[i] = draw_by_chain(logits[i], p.sampler_chain or (), p.top_k, p.top_p, p.min_p, p.temperature,
                                          float(uniform[i]), self._infill, window=window)
        drawn = [i for i in drawn if params[i].sampler_chain is None]
        whole = [i for i in drawn if params[i].top_k <= 0 and params[i].top_p >= 1.0]
        truncated = [i for i in drawn if params[i].top_k > 0 or params[i].top_p < 1.0]
        for rows, draw in ((whole, _draw_from_vocabulary), (truncated, _draw_from_candidates)):
            if rows:
                row_params = [params[i] for i in rows]
                scaled = logits[rows] / torch.tensor([p.temperature for p in row_params])[:, None]
                if any(p.min_p > 0.0 for p in row_params):
                    scaled = _min_p(scaled, row_params)
                tokens[rows] = draw(scaled, row_params, uniform[rows])
        return tokens.tolist()

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
