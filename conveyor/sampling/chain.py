"""llama.cpp's sampler chain: its samplers applied in the order a request names them (llama.cpp's
`samplers` field), each on the candidates the one before left, then a draw, all on a window of the
row's best tokens that widens only where a cut reaches past it. Used for requests of
llama.cpp's own API (/completion, /infill), whose default order differs from vLLM's: top-k, top-p
and min-p cut the distribution as the model gives it, and temperature comes last.

The `infill` sampler is llama.cpp's for fill-in-the-middle: when the end-of-generation tokens
together are likely enough against the text ones it keeps only them; otherwise it adds the
probability of every candidate whose text starts another's to the likelier of the two, and keeps
those that then stand out (and the end tokens). The draw is over the kept tokens' logits, as
llama.cpp's `dist` sampler recomputes them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from conveyor.sampling.arrays import log_totals, softmax64, top_window
from conveyor.sampling.params import GREEDY_TEMPERATURE_EPS

# A row's candidates start from this many of its best tokens and widen eightfold while a cut runs
# past them: a full sort of a 150k vocabulary costs more than a decode step.
FIRST_CANDIDATE_WIDTH = 256
# The infill step compares candidates' texts pairwise, on the engine thread: past this many (a chain
# with no top-k before it) only the likeliest are merged; whether to end is judged on all of them.
INFILL_MOST_CANDIDATES = 256
_INFILL_FIRST_THRESHOLD = 0.2


@dataclass(frozen=True)
class InfillVocabulary:
    """What the infill step needs of the vocabulary: which tokens end a generation (llama.cpp's
    end-of-generation set: EOS, end of turn, the fill-in-the-middle ends), the one it falls back to,
    and each token's bytes."""

    end_ids: frozenset[int]
    end_id: int
    piece: Callable[[int], bytes]


@dataclass(frozen=True)
class Window:
    """A row's best logits (best first) with their token ids, and the log of the row's total
    softmax mass: what a chain's first window needs, found for a batch's rows in one call each
    (first_windows)."""

    values: np.ndarray
    ids: np.ndarray
    log_total: float | None  # None: not found (cuts_first_by_top_k)


def kept_by_top_k(top_k: int, size: int) -> int:
    """How many tokens a top-k step keeps of a row of `size` (0 or less, or k past the row: all)."""
    return top_k if 0 < top_k < size else size


def first_width(chain: tuple[str, ...], top_k: int, size: int) -> int:
    """The window a chain starts from: a top-k step's k where it is wider than the default."""
    k = kept_by_top_k(top_k, size)
    return min(size, max(FIRST_CANDIDATE_WIDTH, k if "top_k" in chain and k < size else 0))


def cuts_first_by_top_k(chain: tuple[str, ...], top_k: int, size: int) -> bool:
    """Whether top-k cuts the row before anything reads its total: only min-p (whose cut is
    relative to the best) and temperature (which keeps the order) come before it."""
    return (kept_by_top_k(top_k, size) < size and "top_k" in chain
            and set(chain[:chain.index("top_k")]) <= {"min_p", "temperature"})


def first_windows(logits: np.ndarray, widths: list[int], totals_wanted: list[bool]) -> list[Window]:
    """Each row's Window of its width, with its total where `totals_wanted` says. Rows of one width
    take one top_window together; a row's window, tied logits' order included, is that of a stable
    sort of its own row, whatever its batch-mates ask."""
    windows: list[Window | None] = [None] * logits.shape[0]
    for width in sorted(set(widths)):
        rows = [i for i, w in enumerate(widths) if w == width]
        group = logits if len(rows) == logits.shape[0] else logits[rows]  # a copy only of some rows
        values, ids = top_window(group, width)
        wanted = [j for j, i in enumerate(rows) if totals_wanted[i]]
        found = log_totals(group if len(wanted) == len(rows) else group[wanted]).tolist() if wanted else []
        totals: list[float | None] = [None] * len(rows)
        for j, total in zip(wanted, found):
            totals[j] = total
        for j, i in enumerate(rows):
            windows[i] = Window(values[j], ids[j], totals[j])
    return [w for w in windows if w is not None]


def draw_by_chain(row: np.ndarray, chain: tuple[str, ...], top_k: int, top_p: float, min_p: float,
                  temperature: float, uniform: float, vocabulary: InfillVocabulary | None,
                  width: int | None = None, window: Window | None = None) -> int:
    """One row's token: `chain`'s steps in order on the row's logits (after the logit adjustments),
    then a draw of `uniform` over the softmax of what is left, likeliest first. The steps run on
    the row's `width` best tokens (first_width's by default; `window`: those already found, as
    many or more), and on eight times as many while a step's cut or the draw runs past them: the
    token a full sort of the row gives, but for rounding at a cut's edge (tied logits in
    top_window's order: by token id)."""
    size = row.shape[-1]
    k = kept_by_top_k(top_k, size)
    width = first_width(chain, top_k, size) if width is None else min(size, width)
    while True:
        token, wider = _chain_on_window(row, chain, k, top_p, min_p, temperature, uniform, vocabulary, width, window)
        if token is not None:
            return token
        width = min(size, max(width * 8, wider))


def _chain_on_window(row: np.ndarray, chain: tuple[str, ...], k: int, top_p: float, min_p: float,
                     temperature: float, uniform: float, vocabulary: InfillVocabulary | None,
                     width: int, window: Window | None = None) -> tuple[int | None, int]:
    """draw_by_chain on the row's `width` best tokens: (the token, 0), or (None, the width the
    window must at least reach) where a step needs tokens beyond it. While no step has cut inside
    the window (`whole` False), the tokens in play are every token of the row still `alive`,
    the window being their best; a step normalising over them reads the row for the total."""
    size = row.shape[-1]
    whole = width >= size
    if window is not None and window.values.size >= width:
        values, ids = window.values[:width], window.ids[:width]
    else:
        found = top_window(row[None, :], width)
        values, ids = found[0][0], found[1][0]
    alive: np.ndarray | None = None  # None: all of the row
    divisors: list[float] = []  # the temperatures applied so far, in order

    def row_now() -> np.ndarray:
        scaled = row
        for divisor in divisors:
            scaled = scaled / divisor
        return scaled

    def probabilities() -> np.ndarray:
        """The window's probabilities among the tokens in play, in float64: a cumulative sum over
        a hundred thousand float32 terms would move a draw in a flat row's tail."""
        if whole:
            return softmax64(values)
        if window is not None and window.log_total is not None and alive is None and not divisors:
            log_total = window.log_total
        else:
            scaled = row_now()
            log_total = float(log_totals(scaled if alive is None else scaled[alive]))
        with np.errstate(invalid="ignore"):
            return np.exp(values.astype(np.float64) - log_total)

    def in_play() -> int:
        return size if alive is None else int(alive.sum())

    for step in chain:
        if step == "top_k" and k < size:
            if not whole and k > values.size:
                return None, k
            values, ids, whole = values[:k], ids[:k], True
        elif step == "top_p" and top_p < 1.0:
            probs = probabilities()
            keep = max(1, int(((np.cumsum(probs) - probs) < top_p).sum()))  # through the one reaching top_p
            if not whole and keep >= values.size:  # the nucleus may run past the window
                return None, 0
            values, ids, whole = values[:keep], ids[:keep], True
        elif step == "min_p" and min_p > 0.0:
            floor = values[0] + math.log(min_p)
            keep = max(1, int((values >= floor).sum()))
            if whole or keep < values.size:
                values, ids, whole = values[:keep], ids[:keep], True
            else:  # every token of the window stays: of the row, those at the floor or above do
                above = row_now() >= floor
                alive = above if alive is None else alive & above
        elif step == "temperature":
            if temperature < GREEDY_TEMPERATURE_EPS:
                values, ids, whole = values[:1], ids[:1], True
            else:
                values = values / temperature
                divisors.append(temperature)
        elif step == "infill":
            if vocabulary is None:
                raise ValueError("the infill sampler needs the model's vocabulary")
            if not whole:  # judges on every candidate in play
                return None, in_play()
            values, ids = infill_step(values, ids, vocabulary)
    if values.size == 1:
        return int(ids[0]), 0
    cdf = np.cumsum(probabilities())
    target = uniform * float(cdf[-1]) if whole else uniform
    if not whole and target >= float(cdf[-1]):  # the draw lands past the window
        return None, 0
    # The first token whose cumulative mass exceeds the target: one of zero mass never is.
    position = int(np.searchsorted(cdf, target, side="right"))
    return int(ids[min(position, values.size - 1)]), 0


def infill_step(values: np.ndarray, ids: np.ndarray, vocabulary: InfillVocabulary) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's infill sampler on candidates sorted likeliest first: the kept ones, with their
    own logits and in their order."""
    all_probs = softmax64(values)
    ending = np.array([t in vocabulary.end_ids for t in ids.tolist()], dtype=np.bool_)
    p_end, p_text = float(all_probs[ending].sum()), float(all_probs[~ending].sum())
    if 3 * p_end * values.size > p_text:  # ending is likely enough: only the end tokens stay
        return values[ending], ids[ending]
    values, ids = values[:INFILL_MOST_CANDIDATES], ids[:INFILL_MOST_CANDIDATES]
    probs = all_probs[:INFILL_MOST_CANDIDATES].tolist()
    tokens = ids.tolist()
    is_end = ending[:INFILL_MOST_CANDIDATES].tolist()
    alive = [True] * len(tokens)
    pieces = [vocabulary.piece(t) for t in tokens]
    for i0 in range(len(tokens)):
        for i1 in range(len(tokens)):
            if not alive[i0]:
                break
            if i0 == i1 or not alive[i1]:
                continue
            a, b = pieces[i0], pieces[i1]
            if a and len(a) <= len(b) and b.startswith(a):  # one token's text begins the other's
                dst, src = (i1, i0) if probs[i1] > probs[i0] else (i0, i1)
                probs[dst] += probs[src]
                probs[src], alive[src] = 0.0, False
    kept = [i for i in range(len(tokens)) if alive[i] and (probs[i] >= _INFILL_FIRST_THRESHOLD or is_end[i])]
    texts = sum(1 for i in kept if not is_end[i])
    if texts == 0:  # nothing of the text stands out: end here
        return np.ones(1, dtype=values.dtype), np.array([vocabulary.end_id], dtype=ids.dtype)
    total = sum(probs[i] for i in kept)
    threshold = 1.0 / (texts + 1)
    index = np.array([i for i in kept if probs[i] / total >= threshold or is_end[i]], dtype=np.intp)
    return values[index], ids[index]
