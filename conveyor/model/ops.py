"""The small per-layer ops of a decoder layer: RMSNorm, the residual add, rotary embedding with the
KV-cache write, and SiLU(gate) * up (GELU-tanh(gate) * up for Gemma: torch only); and the argmax of
the logits that greedy sampling takes.

In torch each is 2-16 ops on tensors of a few KiB, so at decode batch sizes their dispatch costs
more than their arithmetic (~1,300 ops a step for SmolLM2's 30 layers). `FusedOps` runs each as one
C++ pass over the rows (conveyor/model/kernels/fused_ops.cpp) for fp32; `ReferenceOps` is the torch
version, used for other dtypes, where the extension cannot be built, and under CONVEYOR_KERNELS=0.
The two agree within fp32 rounding (rotary embedding bit for bit).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from conveyor.model.attention import write_kv
from conveyor.model.kernels import fused_ops
from conveyor.model.rope import apply_rope

QKNorm = tuple[torch.Tensor, torch.Tensor, float]  # (q weight, k weight, eps) for Qwen3-style models
QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same operation order as HF's LlamaRMSNorm, so fp32 outputs agree bit for bit.
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> QKV:
    n, q_size, kv_size = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return q.view(n, num_heads, head_dim), k.view(n, num_kv_heads, head_dim), v.view(n, num_kv_heads, head_dim)


class ReferenceOps:
    """torch ops, in the order HF's Llama runs them."""

    rms_norm = staticmethod(rms_norm)

    @staticmethod
    def add_rms_norm_(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += delta in place; returns the normed residual."""
        residual.add_(delta)
        return rms_norm(residual, weight, eps)

    @staticmethod
    def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int,
                       qk_norm: QKNorm | None = None) -> QKV:
        """Splits fused qkv rows into heads, rotates q and k (cos/sin: [T, d] at each row's position)
        and writes k and v into the cache slots. Returns q, k, v as [T, heads, d]."""
        q, k, v = split_qkv(qkv, num_heads, num_kv_heads, k_cache.shape[-1])
        if qk_norm is not None:
            q, k = rms_norm(q, qk_norm[0], qk_norm[2]), rms_norm(k, qk_norm[1], qk_norm[2])
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        write_kv(k_cache, v_cache, k, v, slots)
        return q, k, v

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    @staticmethod
    def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)


class FusedOps:
    """The same ops as one C++ pass each (fp32, rows contiguous); GELU-tanh stays in torch."""

    def __init__(self, module: Any) -> None:
        self.rms_norm = module.rms_norm
        self.add_rms_norm_ = module.add_rms_norm_
        self.silu_and_mul = module.silu_and_mul
        self.gelu_tanh_and_mul = ReferenceOps.gelu_tanh_and_mul
        self._rope_and_cache = module.rope_and_cache
        self._argmax_rows = module.argmax_rows

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        # torch.argmax's answer (first index of the maximum, NaN first), vectorised: torch's CPU
        # argmax compares element by element, ~2% of a Gemma 3 decode step over 262,144 logits.
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(-1) != 1 or logits.shape[-1] == 0:
            return logits.argmax(dim=-1)
        return self._argmax_rows(logits)

    def rope_and_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int,
                       qk_norm: QKNorm | None = None) -> QKV:
        q_norm, k_norm, eps = qk_norm if qk_norm is not None else (None, None, 0.0)
        # q and k normed (per head, when the model has qk norms) and k rotated in place in qkv.
        return self._rope_and_cache(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads,
                                    q_norm, k_norm, eps)


LayerOps = ReferenceOps | FusedOps


_REFERENCE = ReferenceOps()


@functools.cache
def _fused(module: Any) -> FusedOps:
    return FusedOps(module)


def layer_ops(dtype: torch.dtype) -> LayerOps:
    """Chosen once per forward pass, not per op."""
    module = fused_ops() if dtype == torch.float32 else None
    return _REFERENCE if module is None else _fused(module)
