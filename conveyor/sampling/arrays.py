"""The numpy building blocks of sampling: a row's best tokens without sorting the row, a row's total
softmax mass summed in float64, log-softmax, and a draw over a whole row without a running sum
over it.

Ties have one order everywhere: a row's tokens in the order of a stable sort by descending logit
(equal logits by token id, -0.0 equal to 0.0; NaN first, as torch's topk puts it), so a row's window
is a function of that row and its width alone, whatever its batch-mates ask.
"""
from __future__ import annotations

import numpy as np

_SIGN = np.uint32(0x80000000)
_LOW_32 = np.uint64(0xFFFFFFFF)
# top_window's lower bound on a row's k-th best logit: the k-th best maximum of `_SETS` interleaved
# slices of the row (k slices each hold a logit at least that high).
_SETS = 16
# whole_row_draw's blocks: block sums find the block a draw lands in, then one running sum within it.
_DRAW_BLOCK = 1024


def _descending_keys(values: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """uint64 keys whose ascending order is the tokens' stable descending order: the float32 logit's
    bits mapped so that a larger logit gives a smaller high half, the token id in the low half."""
    bits = (values + np.float32(0.0)).view(np.uint32)  # + 0.0: -0.0 becomes 0.0
    high = np.where(bits & _SIGN, bits, ~bits & ~_SIGN)
    return (high.astype(np.uint64) << np.uint64(32)) | ids.astype(np.uint64)


def top_window(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(values, ids), each [rows, k] (ids int64): every row's first k tokens in the stable
    descending order, best first. A float32 row is not sorted: the k-th best maximum of 16
    interleaved slices bounds its k-th best logit from below, and only the slices whose maximum
    reaches it hold candidates (k * 16 logits or so), which one partition and sort of unique keys
    orders. Other dtypes (float64 references) take a stable sort of the row."""
    rows, n = x.shape
    k = min(k, n)
    if k <= 0:
        return x[:, :0], np.zeros((rows, 0), dtype=np.int64)
    if x.dtype != np.float32:
        order = np.argsort(-x, axis=-1, kind="stable")[:, :k]
        return np.take_along_axis(x, order, -1), order
    sets = max(1, min(_SETS, n // (4 * k)))
    size = n // sets
    ids = np.empty((rows, k), dtype=np.int64)
    everything = np.arange(n, dtype=np.int64) if sets == 1 else None
    if sets > 1:
        maxima = x[:, :sets * size].reshape(rows, sets, size).max(axis=1)
        bound = np.partition(maxima, size - k, axis=-1)[:, size - k]
        sliced = ~np.isnan(maxima).any(axis=1)
        starts = (np.arange(sets, dtype=np.int64) * size)[:, None]
        tail = np.arange(sets * size, n, dtype=np.int64)
    for r in range(rows):
        row = x[r]
        if sets > 1 and sliced[r]:
            candidates = (np.flatnonzero(maxima[r] >= bound[r]) + starts).ravel()
            if tail.size:
                candidates = np.concatenate([candidates, tail])
            keys = _descending_keys(row[candidates], candidates)
        else:  # NaN (a slice's maximum hides the rest of it), or k near the row's length
            if everything is None:
                everything = np.arange(n, dtype=np.int64)
            keys = _descending_keys(row, everything)
        if keys.size > k:
            keys = np.partition(keys, k - 1)[:k]
        keys.sort()
        ids[r] = keys & _LOW_32
    return np.take_along_axis(x, ids, -1), ids


def _exponentials(row: np.ndarray, out: np.ndarray) -> float:
    """exp(row - its maximum) into `out` (the row's dtype); returns the maximum."""
    top = row.max()
    np.subtract(row, top, out=out)
    np.exp(out, out=out)
    return float(top)


def log_totals(logits: np.ndarray) -> np.ndarray:
    """Each row's log of its total softmax mass (over the last axis), in float64: exponentials in
    the logits' dtype but summed in float64, since a flat row's total is a sum of a hundred
    thousand terms that a draw in its tail reads to a few parts in a billion (float32's sum is
    off by a part in ten million). Row by row, each in cache while its passes run. A row of -inf
    only gives NaN."""
    x = logits.reshape(-1, logits.shape[-1])
    totals = np.empty(x.shape[0])
    scratch = np.empty(x.shape[-1], dtype=x.dtype)
    with np.errstate(invalid="ignore", divide="ignore"):
        for r, row in enumerate(x):
            top = _exponentials(row, scratch)
            totals[r] = np.log(scratch.sum(dtype=np.float64)) + top
    return totals.reshape(logits.shape[:-1])


def softmax64(values: np.ndarray) -> np.ndarray:
    """The softmax of a 1-D array of logits, in float64."""
    v = values.astype(np.float64)
    with np.errstate(invalid="ignore"):
        exps = np.exp(v - v.max())
        return exps / exps.sum()


def log_normalizers(logits: np.ndarray) -> np.ndarray:
    """What log-softmax subtracts from each row, in the logits' dtype (float32 for a step's
    logits): its maximum plus the log of its exponentials' sum, summed in float64."""
    return log_totals(logits).astype(logits.dtype)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-softmax over the last axis, in the logits' dtype."""
    return logits - log_normalizers(logits)[..., None]


def whole_row_draw(logits: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """Each row's first token whose cumulative softmax mass (in float64) exceeds its uniform
    number's share of the row's total: a token of zero mass is never drawn. Block sums find the
    block the draw lands in, a running sum finds the token within it: a running sum over the whole
    row (np.cumsum is sequential) costs several times the rest."""
    rows, n = logits.shape
    whole = n // _DRAW_BLOCK * _DRAW_BLOCK
    exps = np.empty(n, dtype=logits.dtype)
    positions = np.empty(rows, dtype=np.int64)
    for r in range(rows):
        with np.errstate(invalid="ignore"):
            _exponentials(logits[r], exps)
        sums = exps[:whole].reshape(-1, _DRAW_BLOCK).sum(axis=1, dtype=np.float64)
        if whole < n:
            sums = np.append(sums, exps[whole:].sum(dtype=np.float64))
        cumulative = np.cumsum(sums)
        target = float(uniform[r]) * float(cumulative[-1])
        block = min(int(np.searchsorted(cumulative, target, side="right")), sums.size - 1)
        start = block * _DRAW_BLOCK
        part = exps[start:start + _DRAW_BLOCK]
        before = float(cumulative[block - 1]) if block else 0.0
        at = int(np.searchsorted(before + np.cumsum(part, dtype=np.float64), target, side="right"))
        if at >= part.size:  # the block's running sum rounded below its block sum: its last token with mass
            nonzero = np.flatnonzero(part)
            at = int(nonzero[-1]) if nonzero.size else part.size - 1
        positions[r] = start + at
    return positions
