"""Applying a step's grammar masks to the logits: one bit unpack and one masked write per
constrained row.

Done in numpy on the logits' own memory, on one thread: on a loaded 2-core machine a threaded
fill (torch's OpenMP-parallel masked_fill, before) waited at barriers for a core. What masks cost
a step: benchmarks/structured_cost.py.
"""
from __future__ import annotations

import numpy as np

from conveyor.structured.spec import TokenMasks


def apply_token_masks(logits: np.ndarray, masks: TokenMasks) -> None:
    """Set every disallowed token of the constrained rows of `logits` (numpy [batch, vocab], any
    strides) to -inf, in place; other rows untouched."""
    vocab = logits.shape[-1]
    # The bitmask's int32 words read as little-endian bytes, inverted: bit t set = token t disallowed.
    disallowed_bits = (~np.ascontiguousarray(masks.bitmask, dtype=np.int32)).view(np.uint8)
    disallowed = np.unpackbits(disallowed_bits, axis=1, count=vocab, bitorder="little").view(np.bool_)
    for row, row_disallowed in zip(masks.rows, disallowed):
        np.putmask(logits[row], row_disallowed, -np.inf)
