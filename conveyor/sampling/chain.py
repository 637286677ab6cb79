"""llama.cpp's sampler chain: its samplers applied in the order a request names them (llama.cpp's
`samplers` field), each on the candidates the one before left, then a draw. Used for requests of
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


def draw_by_chain(row: torch.Tensor, chain: tuple[str, ...], top_k: int, top_p: float, min_p: float,
                  temperature: float, uniform: float, vocabulary: InfillVocabulary | None) -> int:
    """One row's token: `chain`'s steps in order on the row's logits (after the logit adjustments),
    then a draw of `uniform` over the softmax of what is left, likeliest first."""
    size = row.shape[-1]
    k = top_k if 0 < top_k < size else size
    # Steps before top-k that neither renormalize nor merge (min-p's cut is relative to the best,
    # temperature keeps the order) leave the k best as they would find them.
    before = chain[:chain.index("top_k")] if "top_k" in chain else ()
    if "top_k" in chain and k < size and set(before) <= {"min_p", "temperature"}:
        values, ids = row.topk(k)
    else:
        values, ids = row.sort(descending=True)
    for step in chain:
        if step == "top_k":
            values, ids = values[:k], ids[:k]
        elif step == "top_p" and top_p < 1.0:
            probs = torch.softmax(values, dim=0)
            keep = max(1, int(((probs.cumsum(0) - probs) < top_p).sum()))  # through the one reaching top_p
            values, ids = values[:keep], ids[:keep]
        elif step == "min_p" and min_p > 0.0:
            keep = max(1, int((values >= values[0] + math.log(min_p)).sum()))
            values, ids = values[:keep], ids[:keep]
        elif step == "temperature":
            if temperature < GREEDY_TEMPERATURE_EPS:
                values, ids = values[:1], ids[:1]
            else:
                values = values / temperature
        elif step == "infill":
            if vocabulary is None:
                raise ValueError("the infill sampler needs the model's vocabulary")
            values, ids = infill_step(values, ids, vocabulary)
    if values.numel() == 1:
        return int(ids[0])
    cdf = torch.softmax(values, dim=0).cumsum(0)
    position = int(torch.searchsorted(cdf, torch.tensor([uniform * float(cdf[-1])], dtype=cdf.dtype)))
    return int(ids[min(position, values.numel() - 1)])


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
