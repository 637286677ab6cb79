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

import torch

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


def log_totals(logits: torch.Tensor) -> torch.Tensor:
    """Each row's log of its total softmax mass, in float64: exponentials in float32 but summed in
    float64, since a flat row's total is a sum of a hundred thousand terms that a draw in its tail
    reads to a few parts in a billion (float32's logsumexp is off by a part in ten million)."""
    top = logits.amax(dim=-1, keepdim=True)
    return (logits - top).exp_().double().sum(dim=-1).log_() + top.squeeze(-1).double()


@dataclass(frozen=True)
class Window:
    """A row's best logits (best first) with their token ids, and the log of the row's total
    softmax mass: what a chain's first window needs, found for a batch's rows in one call each
    (first_windows)."""

    values: torch.Tensor
    ids: torch.Tensor
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


def first_windows(logits: torch.Tensor, widths: list[int], totals_wanted: list[bool]) -> list[Window]:
    """Each row's Window of its width, with its total where `totals_wanted` says. Rows of one width
    take one topk together: a row's window, tied logits' order included, is then what its own
    topk gives, whatever its batch-mates ask."""
    windows: list[Window | None] = [None] * logits.shape[0]
    for width in sorted(set(widths)):
        rows = [i for i, w in enumerate(widths) if w == width]
        group = logits if len(rows) == logits.shape[0] else logits[rows]  # a copy only of some rows
        values, ids = group.topk(min(width, logits.shape[-1]), dim=-1)
        wanted = [j for j, i in enumerate(rows) if totals_wanted[i]]
        found = log_totals(group if len(wanted) == len(rows) else group[wanted]).tolist() if wanted else []
        totals: list[float | None] = [None] * len(rows)
        for j, total in zip(wanted, found):
            totals[j] = total
        for j, i in enumerate(rows):
            windows[i] = Window(values[j], ids[j], totals[j])
    return [w for w in windows if w is not None]


def draw_by_chain(row: torch.Tensor, chain: tuple[str, ...], top_k: int, top_p: float, min_p: float,
                  temperature: float, uniform: float, vocabulary: InfillVocabulary | None,
                  width: int | None = None, window: Window | None = None) -> int:
    """One row's token: `chain`'s steps in order on the row's logits (after the logit adjustments),
    then a draw of `uniform` over the softmax of what is left, likeliest first. The steps run on
    the row's `width` best tokens (first_width's by default; `window`: those already found, as
    many or more), and on eight times as many while a step's cut or the draw runs past them: the
    token a full sort of the row gives, but for rounding at a cut's edge and the order of tied
    logits (topk's, not sort's)."""
    size = row.shape[-1]
    k = kept_by_top_k(top_k, size)
    width = first_width(chain, top_k, size) if width is None else min(size, width)
    while True:
        token, wider = _chain_on_window(row, chain, k, top_p, min_p, temperature, uniform, vocabulary, width, window)
        if token is not None:
            return token
        width = min(size, max(width * 8, wider))


def _chain_on_window(row: torch.Tensor, chain: tuple[str, ...], k: int, top_p: float, min_p: float,
                     temperature: float, uniform: float, vocabulary: InfillVocabulary | None,
                     width: int, window: Window | None = None) -> tuple[int | None, int]:
    """draw_by_chain on the row's `width` best tokens: (the token, 0), or (None, the width the
    window must at least reach) where a step needs tokens beyond it. While no step has cut inside
    the window (`whole` False), the tokens in play are every token of the row still `alive`,
    the window being their best; a step normalising over them reads the row for the total."""
    size = row.shape[-1]
    whole = width >= size
    if window is not None and window.values.numel() >= width:
        values, ids = window.values[:width], window.ids[:width]
    else:
        values, ids = row.sort(descending=True) if whole else row.topk(width)
    alive: torch.Tensor | None = None  # None: all of the row
    divisors: list[float] = []  # the temperatures applied so far, in order

    def row_now() -> torch.Tensor:
        scaled = row
        for divisor in divisors:
            scaled = scaled / divisor
        return scaled

    def probabilities() -> torch.Tensor:
        """The window's probabilities among the tokens in play, in float64: a cumulative sum over
        a hundred thousand float32 terms would move a draw in a flat row's tail."""
        if whole:
            return torch.softmax(values.double(), dim=0)
        if window is not None and window.log_total is not None and alive is None and not divisors:
            log_total = window.log_total
        else:
            scaled = row_now()
            log_total = float(log_totals(scaled if alive is None else scaled[alive]))
        return (values.double() - log_total).exp()

    def in_play() -> int:
        return size if alive is None else int(alive.sum())

    for step in chain:
        if step == "top_k" and k < size:
            if not whole and k > values.numel():
                return None, k
            values, ids, whole = values[:k], ids[:k], True
        elif step == "top_p" and top_p < 1.0:
            probs = probabilities()
            keep = max(1, int(((probs.cumsum(0) - probs) < top_p).sum()))  # through the one reaching top_p
            if not whole and keep >= values.numel():  # the nucleus may run past the window
                return None, 0
            values, ids, whole = values[:keep], ids[:keep], True
        elif step == "min_p" and min_p > 0.0:
            floor = values[0] + math.log(min_p)
            keep = max(1, int((values >= floor).sum()))
            if whole or keep < values.numel():
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
    if values.numel() == 1:
        return int(ids[0]), 0
    cdf = probabilities().cumsum(0)
    target = uniform * float(cdf[-1]) if whole else uniform
    if not whole and target >= float(cdf[-1]):  # the draw lands past the window
        return None, 0
    position = int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype)))
    return int(ids[min(position, values.numel() - 1)]), 0


def infill_step(values: torch.Tensor, ids: torch.Tensor, vocabulary: InfillVocabulary) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's infill sampler on candidates sorted likeliest first: the kept ones, with their
    own logits and in their order."""
    all_probs = torch.softmax(values.double(), dim=0)
    ending = torch.tensor([t in vocabulary.end_ids for t in ids.tolist()], dtype=torch.bool)
    p_end, p_text = float(all_probs[ending].sum()), float(all_probs[~ending].sum())
    if 3 * p_end * values.numel() > p_text:  # ending is likely enough: only the end tokens stay
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
        return torch.ones(1, dtype=values.dtype), torch.tensor([vocabulary.end_id], dtype=ids.dtype)
    total = sum(probs[i] for i in kept)
    threshold = 1.0 / (texts + 1)
    kept = [i for i in kept if probs[i] / total >= threshold or is_end[i]]
    return values[kept], ids[kept]
