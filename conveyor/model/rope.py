"""Rotary position embedding: cos and sin at the positions a step computes, as HF computes them."""
from __future__ import annotations

import math
from typing import Any

import torch

from conveyor.errors import UnsupportedModelError


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """The head_dim / 2 rotation frequencies (fp32), with the checkpoint's scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])  # type: ignore[index]
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = float(scaling["factor"])  # type: ignore[index]
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])  # type: ignore[index]
        old_len = float(scaling["original_max_position_embeddings"])  # type: ignore[index]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled)
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported")


def rope_at(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [len(positions), head_dim] in the rotate-half layout HF Llama uses, computed as
    HF's rotary embedding computes them (fp32 angles, then cos and sin of [angles, angles]). Per step
    rather than a table over every reachable position: such a table costs 2 x positions x head_dim
    floats a base (128 MiB for Gemma 3's two bases at 32,768 positions), while a step needs only its
    own rows (their cost: docs/PERF.md, "Memory")."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, 1, head_dim] (already gathered at each token's position)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
