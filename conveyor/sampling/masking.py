"""Applying a step's grammar masks to the logits: one unpack and one masked fill, constrained rows only."""
from __future__ import annotations

import numpy as np
import torch

from conveyor.sampling.structured import TokenMasks


def apply_token_masks(logits: torch.Tensor, masks: TokenMasks) -> None:
    """Set every disallowed token of the constrained rows to -inf, in place; other rows untouched."""
    vocab = logits.shape[-1]
    # Little-endian int32 words read as bytes, bits least significant first: bit t lands at column t.
    allowed = np.unpackbits(np.ascontiguousarray(masks.bitmask).view(np.uint8), axis=1, bitorder="little")
    disallowed = torch.from_numpy(allowed[:, :vocab]) == 0
    rows = torch.tensor(masks.rows, dtype=torch.long)
    logits[rows] = logits[rows].masked_fill_(disallowed, float("-inf"))
