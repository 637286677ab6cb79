"""Vectorised sampling on numpy: logit adjustments (allowed tokens, bad words, min_tokens,
logit_bias, penalties), greedy, temperature, min-p, top-k, top-p and per-request seeds, over the
fp32 [rows, vocab] logits of a step. Nothing sorts a whole row: top-k and top-p keep candidates
found by `top_window` (conveyor/sampling/arrays.py), and penalties touch only the tokens a request
has seen.

Each sampled row draws one uniform number and inverts its CDF. The number comes from the
request's own generator (numpy's PCG64) when it has a seed, so its draws do not depend on its
batch-mates. Rows that use no adjustment pay nothing for them: each adjustment builds its arrays
only for the rows that ask for it.
"""
from __future__ import annotations

import itertools
import weakref
from collections import Counter
from typing import Any, Callable, Mapping, MutableMapping, Sequence

import numpy as np

from conveyor.request import Request
from conveyor.sampling.arrays import log_normalizers, log_totals, top_window, whole_row_draw
from conveyor.sampling.chain import (FIRST_CANDIDATE_WIDTH, InfillVocabulary, cuts_first_by_top_k, draw_by_chain,
                                     first_width, first_windows, kept_by_top_k)
from conveyor.sampling.params import SamplingParams
from conveyor.sampling.outputs import SamplerOutput, TokenLogprobs, verify_rows

NEG_INF = float("-inf")


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


def _mask(logits: np.ndarray, cells: dict[int, Sequence[int]]) -> None:
    """Set logits[row, token] to -inf for each row's tokens (those inside the vocabulary)."""
    vocab = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    for row, tokens in cells.items():
        ids = [t for t in tokens if t < vocab]
        rows += [row] * len(ids)
        cols += ids
    if rows:
        logits[np.array(rows, dtype=np.intp), np.array(cols, dtype=np.intp)] = NEG_INF


def _outside(request: Request, vocab: int, masks: MutableMapping[Request, np.ndarray] | None) -> np.ndarray:
    """[vocab] bool, True where a token is not in the request's allowed_token_ids: made once per
    request when `masks` keeps it (a long list must not cost every step of everyone's batch)."""
    mask = masks.get(request) if masks is not None else None
    if mask is None or mask.shape[0] != vocab:
        ids = [t for t in request.sampling_params.allowed_token_ids or () if t < vocab]
        mask = np.ones(vocab, dtype=np.bool_)
        mask[np.array(ids, dtype=np.intp)] = False
        if masks is not None:
            masks[request] = mask
    return mask


def adjust_logits(logits: np.ndarray, requests: Sequence[Request], eos_token_ids: Sequence[int] = (),
                  allowed_masks: MutableMapping[Request, np.ndarray] | None = None) -> np.ndarray:
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
    logits = np.array(logits, order="C")  # a copy: each row is then a view that masks write through
    vocab = logits.shape[-1]
    for i in allowed:
        np.putmask(logits[i], _outside(requests[i], vocab, allowed_masks), NEG_INF)
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
        # No cell twice (a row's biases are a dict's): += adds each once, in the logits' dtype.
        logits[np.array(bias_rows, dtype=np.intp), np.array(bias_cols, dtype=np.intp)] += np.array(values, dtype=logits.dtype)
    if penalized:
        _penalize_(logits, {i: requests[i] for i in penalized})
    return logits


def _penalize_(logits: np.ndarray, rows: dict[int, Request]) -> None:
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
    dtype = logits.dtype
    cells = (np.array(cell_rows, dtype=np.intp), np.array(cell_tokens, dtype=np.intp))
    values = logits[cells]
    factor = np.array(repetition, dtype=dtype)
    values = np.where(values > 0, values / factor, values * factor)
    count = np.array(counts, dtype=dtype)
    logits[cells] = values - np.array(frequency, dtype=dtype) * count - np.array(presence, dtype=dtype) * (count > 0)


def _masks_tokens(request: Request) -> bool:
    """Whether adjust_logits may set some of this request's logits to -inf this step."""
    p = request.sampling_params
    return p.allowed_token_ids is not None or bool(p.bad_words_token_ids) or _holds_back_stops(request)


def blocked_rows(logits: np.ndarray, requests: Sequence[Request], masked_rows: Sequence[int] = ()) -> list[int]:
    """The rows of `logits` (adjusted, grammar masks applied) where every token is -inf: sampling
    would return an arbitrary token there. Only rows that a mask touched are looked at, in one
    vectorised pass; the others pay nothing."""
    rows = sorted(set(masked_rows).union(i for i, r in enumerate(requests) if _masks_tokens(r)))
    if not rows:
        return []
    picked = logits if len(rows) == logits.shape[0] else logits[rows]
    dead = picked.max(axis=-1) == NEG_INF
    return [rows[i] for i in np.flatnonzero(dead).tolist()]


def numpy_argmax(logits: np.ndarray) -> np.ndarray:
    """Each row's first index of its maximum, NaN first."""
    return np.argmax(logits, axis=-1)


def _min_p(logits: np.ndarray, params: Sequence[SamplingParams]) -> np.ndarray:
    # In place on `logits`, the tempered rows' own array. Of the tempered distribution, before
    # top-k/top-p (vLLM): p < min_p * max p is dropped.
    # In log space: logit < max logit + log(min_p); min_p 0 gives -inf and drops nothing.
    min_p = np.array([p.min_p for p in params], dtype=logits.dtype)
    with np.errstate(divide="ignore"):
        floor = logits.max(axis=-1, keepdims=True) + np.log(min_p)[:, None]
    np.putmask(logits, logits < floor, NEG_INF)  # the sampler's own tempered copy
    return logits


def _draw_from_vocabulary(logits: np.ndarray, rows: Sequence[int], params: Sequence[SamplingParams],
                          uniform: np.ndarray) -> np.ndarray:
    """The rows' tokens drawn over their whole rows, tempered and cut by min-p as _min_p cuts,
    one row at a time (each row stays in cache through its passes)."""
    tokens = np.empty(len(rows), dtype=np.int64)
    scaled = np.empty((1, logits.shape[-1]), dtype=logits.dtype)
    for j, (i, p) in enumerate(zip(rows, params)):
        np.divide(logits[i], logits.dtype.type(p.temperature), out=scaled[0])
        if p.min_p > 0.0:
            np.putmask(scaled, scaled < scaled.max() + np.log(logits.dtype.type(p.min_p)), NEG_INF)
        tokens[j] = whole_row_draw(scaled, uniform[j:j + 1])[0]
    return tokens


def nucleus_candidates(scaled: np.ndarray, params: Sequence[SamplingParams], width: int = FIRST_CANDIDATE_WIDTH,
                       row_log_total: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, logits), each [rows, width]: every row's tokens that survive top-k and then
    top-p (the smallest best-first prefix whose mass reaches top_p, of the distribution top-k
    leaves; the likeliest token always survives), best first, the rest of the width at -inf.
    The tokens a full sort of the row keeps (masses in float64), found by `top_window` over a
    window that widens, for the rows whose nucleus runs past it only."""
    vocab = scaled.shape[-1]
    top_k = [kept_by_top_k(p.top_k, vocab) for p in params]
    limit = np.array(top_k, dtype=np.int64)
    top_p = np.array([p.top_p for p in params], dtype=np.float64)
    by_k = limit < vocab
    # A row with top-k is normalised over its k best, so the window holds them all; a row without
    # over its whole row, so its window need only reach the end of its nucleus.
    width = min(vocab, max([k for k in top_k if k < vocab] + [1 if bool(by_k.all()) else width]))
    if row_log_total is None:
        row_log_total = np.zeros(len(params))
        whole = ~by_k
        if whole.any():
            row_log_total[whole] = log_totals(scaled if whole.all() else scaled[whole])
    values, ids = top_window(scaled, width)
    drop = np.arange(width)[None, :] >= limit[:, None]
    values = np.where(drop, NEG_INF, values)
    log_total = row_log_total
    if by_k.any():
        log_total = np.where(by_k, log_totals(values.astype(np.float64)), row_log_total)
    with np.errstate(invalid="ignore"):
        probs = np.exp(values.astype(np.float64) - log_total[:, None])
    # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it does.
    mass = np.cumsum(probs, axis=-1)
    drop |= (mass - probs) >= top_p[:, None]
    drop |= values == NEG_INF
    drop[:, 0] = False
    values = np.where(drop, NEG_INF, values)
    past = np.flatnonzero(~by_k & (mass[:, -1] < top_p)).tolist()
    if width == vocab or not past:
        return ids, values
    wide_ids, wide_values = nucleus_candidates(scaled[past], [params[i] for i in past], min(vocab, width * 8),
                                               row_log_total[past])
    pad = wide_ids.shape[1] - width
    ids = np.pad(ids, ((0, 0), (0, pad)))
    values = np.pad(values, ((0, 0), (0, pad)), constant_values=NEG_INF)
    ids[past], values[past] = wide_ids, wide_values
    return ids, values


def _draw_from_candidates(scaled: np.ndarray, params: Sequence[SamplingParams], uniform: np.ndarray) -> np.ndarray:
    """Draws over the candidates in vocabulary order, as a draw over the whole masked row does, so
    a seeded request draws the token it would draw were its row sorted whole: each row's first
    candidate whose cumulative mass (float64) exceeds its uniform number's share of the total."""
    ids, values = nucleus_candidates(scaled, params)
    tokens = ids[:, 0].copy()  # a row with no candidate (NaN) keeps its first
    for r in range(len(ids)):
        kept = np.sort(ids[r][values[r] > NEG_INF])  # vocabulary order
        if kept.size:
            with np.errstate(invalid="ignore"):
                cdf = np.cumsum(np.exp(scaled[r, kept].astype(np.float64) - float(values[r, 0])))
            position = int(np.searchsorted(cdf, float(uniform[r]) * float(cdf[-1]), side="right"))
            tokens[r] = kept[min(position, kept.size - 1)]
    return tokens


def _token_logprobs(logits: np.ndarray, chosen: Sequence[int], top: int) -> list[TokenLogprobs]:
    """Each row's {token: logprob} for its chosen token and its `top` likeliest, in float32 as
    log-softmax gives them, with the chosen token's rank (vLLM's: tokens at least as likely count
    before it; 1: the likeliest). The full log-softmax is never made: a logprob is its logit less
    the row's normaliser, and the order and ranks are the logits' own (the logprobs' order, with
    no ties made by rounding)."""
    rows = logits.shape[0]
    normalizers = log_normalizers(logits)
    chosen_ids = np.array(chosen, dtype=np.intp)
    chosen_logits = logits[np.arange(rows), chosen_ids]
    top_logits, top_ids = top_window(logits, top)
    top_values = (top_logits - normalizers[:, None]).tolist()
    chosen_values = (chosen_logits - normalizers).tolist()
    result = []
    for r in range(rows):
        entry = dict(zip(top_ids[r].tolist(), top_values[r]))
        entry[int(chosen_ids[r])] = chosen_values[r]
        rank = max(1, int(np.count_nonzero(logits[r] >= chosen_logits[r])))
        result.append(TokenLogprobs(entry, rank))
    return result


# A seeded request's generator state, as it travels with a KV handover: PCG64's 128-bit state and
# increment and its buffered 32-bit draw, little-endian, as bytes (numpy uint8).
_STATE_BYTES = 16 + 16 + 1 + 4


def _seeded_generator(seed: int) -> np.random.Generator:
    """numpy's PCG64 seeded by `seed` (a negative seed as its 64-bit two's complement)."""
    return np.random.Generator(np.random.PCG64(seed % 2**64))


def _state_array(generator: np.random.Generator) -> np.ndarray:
    state = generator.bit_generator.state
    raw = (state["state"]["state"].to_bytes(16, "little") + state["state"]["inc"].to_bytes(16, "little")
           + bytes([state["has_uint32"]]) + state["uinteger"].to_bytes(4, "little"))
    return np.frombuffer(raw, dtype=np.uint8).copy()


def _state_dict(state: Any) -> dict[str, Any]:
    """The PCG64 state `_state_array` wrote; ValueError if `state` is not one."""
    raw = np.asarray(state)
    if raw.dtype != np.uint8 or raw.shape != (_STATE_BYTES,) or raw[32] > 1:
        raise ValueError(f"a seeded request's generator state is {_STATE_BYTES} bytes (numpy uint8) of PCG64's; "
                         f"got {raw.dtype} of shape {raw.shape}")
    data = raw.tobytes()
    return {"bit_generator": "PCG64",
            "state": {"state": int.from_bytes(data[:16], "little"), "inc": int.from_bytes(data[16:32], "little")},
            "has_uint32": data[32], "uinteger": int.from_bytes(data[33:37], "little")}


def check_generator_state(state: Any) -> None:
    """Raises ValueError unless `state` is a seeded request's generator state (Sampler.generator_state)."""
    bit_generator: np.random.BitGenerator = np.random.PCG64()
    bit_generator.state = _state_dict(state)


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids: Sequence[int] = (),
                 argmax: Callable[[np.ndarray], np.ndarray] = numpy_argmax,
                 infill: InfillVocabulary | None = None) -> None:
        """argmax: [rows, vocab] -> each row's first index of its maximum (NaN first), as numpy's
        argmax; the runner may pass the model's vectorised one (sampling sits above no model).
        infill: what a sampler chain's infill step needs of the vocabulary (None: no such step)."""
        self._argmax = argmax
        self._infill = infill
        self._generator = _seeded_generator(seed)
        self._request_generators: weakref.WeakKeyDictionary[Request, np.random.Generator] = weakref.WeakKeyDictionary()
        self._allowed_masks: weakref.WeakKeyDictionary[Request, np.ndarray] = weakref.WeakKeyDictionary()
        self.eos_token_ids = tuple(eos_token_ids)  # what min_tokens holds back, besides stop_token_ids

    @staticmethod
    def argmax_is_all(requests: Sequence[Request]) -> bool:
        """Whether these requests' tokens are the argmax of the model's own logits and nothing else
        is read from them: greedy, no logprobs, and no adjustment (adjust_logits) in force."""
        return all(r.sampling_params.greedy and r.sampling_params.logprobs is None and not adjusts_logits(r)
                   for r in requests)

    def __call__(self, logits: np.ndarray, requests: Sequence[Request], masked_rows: Sequence[int] = ()) -> SamplerOutput:
        """logits: numpy fp32 [len(requests), vocab], left as they are; `masked_rows`: those a
        grammar mask was applied to."""
        adjusted = adjust_logits(logits, requests, self.eos_token_ids, self._allowed_masks)
        tokens = self._sample(adjusted, requests)
        blocked = blocked_rows(adjusted, requests, masked_rows) or None
        wanted = [r.sampling_params.logprobs for r in requests]
        if all(k is None for k in wanted):
            return SamplerOutput(tokens, blocked=blocked)
        return SamplerOutput(tokens, self._logprobs(logits, tokens, wanted), blocked=blocked)

    def verify(self, logits: np.ndarray, requests: Sequence[Request], masked_rows: Sequence[int] = ()) -> SamplerOutput:
        """logits: numpy fp32, 1 + len(spec_token_ids) rows per request, in order. Samples every
        row as its position would be sampled without speculation, then keeps each request's drafts
        while they agree (verify_rows). A seeded request's generator ends where drawing only the
        rows it keeps would leave it, so its output does not depend on whether it speculated.
        Only requests whose rows sample independently of the tokens before them speculate
        (conveyor/speculative's eligibility): no logprobs, penalties or output-dependent masks."""
        rows = [r for r in requests for _ in range(1 + len(r.spec_token_ids))]
        seeded = [r for r in requests if r.spec_token_ids and r.sampling_params.seed is not None]
        before = {r: self._generator_for(r).bit_generator.state for r in seeded}
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
                generator.bit_generator.state = before[request]
                generator.random(count + 1)
        wanted = [r.sampling_params.logprobs for r in rows]
        if all(k is None for k in wanted):
            return SamplerOutput(tokens, num_accepted=accepted, blocked=blocked)
        row_logprobs = self._logprobs(logits, row_tokens, wanted)
        last_rows = list(itertools.accumulate(1 + len(r.spec_token_ids) for r in requests))
        return SamplerOutput(tokens, [row_logprobs[i - 1] for i in last_rows], num_accepted=accepted, blocked=blocked)

    @staticmethod
    def prompt_logprobs(logits: np.ndarray, targets: list[int], top: int) -> list[dict[int, float]]:
        """{token: logprob} for each row's target token and its `top` best alternatives, with the
        target's rank (TokenLogprobs); logits: numpy fp32 [len(targets), vocab]."""
        return list(_token_logprobs(logits, targets, top))

    @staticmethod
    def _logprobs(logits: np.ndarray, tokens: list[int], wanted: list[int | None]) -> list[dict[int, float] | None]:
        # Of the model's own distribution (before temperature and truncation), as vLLM reports them.
        rows = [i for i, k in enumerate(wanted) if k is not None]
        result: list[dict[int, float] | None] = [None] * len(tokens)
        for k in sorted({k for k in wanted if k is not None}):
            same = [i for i in rows if wanted[i] == k]
            picked = logits if len(same) == logits.shape[0] else logits[same]
            for i, entry in zip(same, _token_logprobs(picked, [tokens[i] for i in same], k)):
                result[i] = entry
        return result

    def _sample(self, logits: np.ndarray, requests: Sequence[Request]) -> list[int]:
        params = [r.sampling_params for r in requests]
        greedy = np.asarray(self._argmax(logits))
        if all(p.greedy for p in params):
            return greedy.tolist()
        uniform = self._uniforms(requests)
        tokens = greedy.astype(np.int64)
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
        if whole:
            tokens[whole] = _draw_from_vocabulary(logits, whole, [params[i] for i in whole], uniform[whole])
        if truncated:
            row_params = [params[i] for i in truncated]
            temperatures = np.array([p.temperature for p in row_params], dtype=logits.dtype)
            if len(truncated) == logits.shape[0]:
                scaled = logits / temperatures[:, None]  # the caller's logits stay as they are
            else:
                scaled = logits[truncated]  # already a copy
                scaled /= temperatures[:, None]
            if any(p.min_p > 0.0 for p in row_params):
                scaled = _min_p(scaled, row_params)
            tokens[truncated] = _draw_from_candidates(scaled, row_params, uniform[truncated])
        return tokens.tolist()

    # A seeded request that moves to another engine (KV handover) takes its draws along with it.
    def generator_state(self, request: Request) -> np.ndarray | None:
        """The request's own generator state (numpy uint8; check_generator_state checks one), None
        before its first draw."""
        gen = self._request_generators.get(request)
        return None if gen is None else _state_array(gen)

    def set_generator_state(self, request: Request, state: np.ndarray) -> None:
        gen = np.random.Generator(np.random.PCG64())
        gen.bit_generator.state = _state_dict(state)
        self._request_generators[request] = gen

    # A step that raised is run again on part of its batch (LLMEngine's failure isolation): the
    # retry must draw the numbers the first try would have drawn.
    def save_rng_state(self, requests: Sequence[Request]) -> tuple[Mapping[str, Any], dict[Request, Mapping[str, Any] | None]]:
        """The shared generator and the seeded generators of `requests` (None: not created yet)."""
        seeded: dict[Request, Mapping[str, Any] | None] = {}
        for request in requests:
            if request.sampling_params.seed is not None:
                gen = self._request_generators.get(request)
                seeded[request] = None if gen is None else gen.bit_generator.state
        return self._generator.bit_generator.state, seeded

    def restore_rng_state(self, state: tuple[Mapping[str, Any], dict[Request, Mapping[str, Any] | None]]) -> None:
        shared, seeded = state
        self._generator.bit_generator.state = shared
        for request, request_state in seeded.items():
            if request_state is None:
                self._request_generators.pop(request, None)
            else:
                self._request_generators[request].bit_generator.state = request_state

    def _generator_for(self, request: Request) -> np.random.Generator:
        """A seeded request's own generator, made at its first draw."""
        gen = self._request_generators.get(request)
        if gen is None:
            gen = _seeded_generator(request.sampling_params.seed)  # type: ignore[arg-type]
            self._request_generators[request] = gen
        return gen

    def _uniforms(self, requests: Sequence[Request]) -> np.ndarray:
        """One float64 uniform number in [0, 1) per row."""
        uniform = self._generator.random(len(requests))
        for i, request in enumerate(requests):
            if request.sampling_params.seed is not None:
                uniform[i] = self._generator_for(request).random()
        return uniform
