"""Rotary position embedding: cos and sin at the positions a step computes, as HF computes them."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from conveyor.errors import UnsupportedModelError


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> np.ndarray:
    """The head_dim / 2 rotation frequencies (fp32), with the checkpoint's scaling applied. HF takes
    theta ** (i / head_dim) in fp32; here the power is taken in float64 of the same fp32 exponent and
    rounded once, which is torch's fp32 result wherever that is correctly rounded."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq: np.ndarray = np.float32(1.0) / (float(theta) ** exponent.astype(np.float64)).astype(np.float32)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / np.float32(float(scaling["factor"]))  # type: ignore[index]
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = float(scaling["factor"])  # type: ignore[index]
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])  # type: ignore[index]
        old_len = float(scaling["original_max_position_embeddings"])  # type: ignore[index]
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > np.float32(old_len / low), inv_freq / np.float32(factor), inv_freq)
        smooth = (np.float32(old_len) / wavelen - np.float32(low)) / np.float32(high - low)
        blended = (np.float32(1) - smooth) * scaled / np.float32(factor) + smooth * scaled
        medium = (wavelen >= np.float32(old_len / high)) & (wavelen <= np.float32(old_len / low))
        return np.where(medium, blended, scaled).astype(np.float32)
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported")


def rope_at(inv_freq: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [len(positions), head_dim] (fp32, contiguous) in the rotate-half layout HF Llama
    uses, computed as HF's rotary embedding computes them (fp32 angles, then cos and sin of [angles,
    angles]; here each cos and sin in float64 of the fp32 angle, rounded once). Per step rather than
    a table over every reachable position: such a table costs 2 x positions x head_dim floats a base
    (128 MiB for Gemma 3's two bases at 32,768 positions), while a step needs only its own rows
    (their cost: docs/PERF.md, "Memory")."""
    freqs = np.asarray(positions).astype(np.float32)[:, None] * inv_freq[None, :]
    angles = freqs.astype(np.float64)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    return np.concatenate((cos, cos), axis=-1), np.concatenate((sin, sin), axis=-1)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x: [T, heads, head_dim]; cos/sin: [T, 1, head_dim] (already gathered at each token's position)."""
    half = x.shape[-1] // 2
    rotated = np.concatenate((-x[..., half:], x[..., :half]), axis=-1)
    return x * cos + rotated * sin
