"""The small per-layer ops of a decoder layer: RMSNorm, the residual add, rotary embedding with the
KV-cache write, and SiLU(gate) * up (GELU-tanh(gate) * up for Gemma: numpy only); and the argmax of
the logits that greedy sampling takes.

As numpy each is 2-16 passes over arrays of a few KiB, so at decode batch sizes their dispatch costs
more than their arithmetic (~1,300 ops a step for SmolLM2's 30 layers). `FusedOps` runs each as one
C++ pass over the rows (conveyor/model/kernels/fused_ops.cpp); `ReferenceOps` is the numpy version
in the order HF's torch code runs them, used where the extension cannot be built, under
CONVEYOR_KERNELS=0, and as the reference tests compare with. The two agree within fp32 rounding
(rotary embedding bit for bit). Activations are fp32.
"""
from __future__ import annotations

import functools
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from conveyor.model.attention import write_kv
from conveyor.model.kernels import fused_ops
from conveyor.model.rope import apply_rope

QKNorm = tuple[np.ndarray, np.ndarray, float]  # (q weight, k weight, eps) for Qwen3-style models
QKV = tuple[np.ndarray, np.ndarray, np.ndarray]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    # HF's LlamaRMSNorm's order: x * rsqrt(mean(x^2) + eps) in fp32, then times the weight.
    hidden = x.astype(np.float32, copy=False)
    mean = np.square(hidden).mean(axis=-1, keepdims=True, dtype=np.float32)
    hidden = hidden * (np.float32(1) / np.sqrt(mean + np.float32(eps)))
    return weight * hidden


def split_qkv(qkv: np.ndarray, num_heads: int, num_kv_heads: int, head_dim: int) -> QKV:
    n, q_size, kv_size = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size], qkv[:, q_size + kv_size:]
    return q.reshape(n, num_heads, head_dim), k.reshape(n, num_kv_heads, head_dim), v.reshape(n, num_kv_heads, head_dim)


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), as torch's F.silu computes it: x / (1 + exp(-x)) (exp overflowing to inf for
    x below -88 gives -0, the limit)."""
    with np.errstate(over="ignore"):
        return x / (np.float32(1) + np.exp(-x))


_GELU_BETA, _GELU_KAPPA = np.float32(math.sqrt(2 / math.pi)), np.float32(0.044715)


def gelu_tanh(x: np.ndarray, times: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """GELU's tanh approximation (torch's F.gelu(approximate="tanh"), HF's gelu_pytorch_tanh):
    0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) in fp32, in torch's order of operations (numpy's
    tanh, not torch's, so within a few ulp of it), times `times` where given. One array, updated in
    place: Gemma's MLP runs it on every row of a step (3-4x the time of the same passes each making
    a new array; the scaling by 0.5 is exact, so its place changes no bit). `out`: the array to
    compute in (x's shape, float32), else a new one."""
    t = np.multiply(x, x, out=out)
    t *= x
    t *= _GELU_KAPPA
    t += x
    t *= _GELU_BETA
    np.tanh(t, out=t)
    t += np.float32(1)
    t *= x
    t *= np.float32(0.5)
    if times is not None:
        t *= times
    return t


class ReferenceOps:
    """numpy ops, in the order HF's Llama runs them."""

    rms_norm = staticmethod(rms_norm)

    @staticmethod
    def add_rms_norm_(residual: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """residual += delta in place; returns the normed residual."""
        residual += delta
        return rms_norm(residual, weight, eps)

    @staticmethod
    def rope_and_cache(qkv: np.ndarray, cos: np.ndarray, sin: np.ndarray, k_cache: np.ndarray,
                       v_cache: np.ndarray, slots: np.ndarray, num_heads: int, num_kv_heads: int,
                       qk_norm: QKNorm | None = None) -> QKV:
        """Splits fused qkv rows into heads, rotates q and k (cos/sin: [T, d] at each row's position)
        and writes k and v into the cache slots. Returns q, k, v as [T, heads, d]."""
        q, k, v = split_qkv(qkv, num_heads, num_kv_heads, k_cache.shape[-1])
        if qk_norm is not None:
            q, k = rms_norm(q, qk_norm[0], qk_norm[2]), rms_norm(k, qk_norm[1], qk_norm[2])
        cos, sin = cos[:, None, :], sin[:, None, :]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        write_kv(k_cache, v_cache, k, v, slots)
        return q, k, v

    @staticmethod
    def silu_and_mul(gate_up: np.ndarray) -> np.ndarray:
        half = gate_up.shape[-1] // 2
        return silu(gate_up[..., :half]) * gate_up[..., half:]

    @staticmethod
    def gelu_tanh_and_mul(gate_up: np.ndarray) -> np.ndarray:
        half = gate_up.shape[-1] // 2
        return gelu_tanh(gate_up[..., :half], gate_up[..., half:])

    @staticmethod
    def argmax_rows(logits: np.ndarray) -> np.ndarray:
        """Each row's first index of its maximum, a NaN first (numpy's argmax, as torch's)."""
        return np.argmax(logits, axis=-1).astype(np.int64, copy=False)


# From this many rows Gemma's GELU-tanh is split into runs of rows computed side by side, one a
# kernel thread (numpy releases the GIL inside its loops): at a prefill's rows it is several
# milliseconds a layer on one core, where the products and fused ops around it use every core.
GELU_ROWS_APART = 64


@functools.cache
def _gelu_helpers(count: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=count, thread_name_prefix="conveyor-gelu")


def gelu_tanh_and_mul_by_rows(gate_up: np.ndarray, threads: int) -> np.ndarray:
    """ReferenceOps.gelu_tanh_and_mul with its rows in `threads` runs at once: each element's
    arithmetic is the same, so are its bits."""
    rows, half = gate_up.shape[0], gate_up.shape[-1] // 2
    if threads <= 1 or rows < GELU_ROWS_APART:
        return ReferenceOps.gelu_tanh_and_mul(gate_up)
    out = np.empty((rows, half), dtype=np.float32)
    bounds = [rows * i // threads for i in range(threads + 1)]

    def run(part: int) -> None:
        start, end = bounds[part], bounds[part + 1]
        gelu_tanh(gate_up[start:end, :half], gate_up[start:end, half:], out=out[start:end])
    helpers = [_gelu_helpers(threads - 1).submit(run, part) for part in range(1, threads)]
    run(0)
    for helper in helpers:
        helper.result()
    return out


class FusedOps:
    """The same ops as one C++ pass each (fp32, rows contiguous); GELU-tanh stays numpy's, its rows
    split over the kernels' thread count."""

    def __init__(self, module: Any) -> None:
        self.rms_norm = module.rms_norm
        self.add_rms_norm_ = module.add_rms_norm_
        self.silu_and_mul = module.silu_and_mul
        self._threads = module.get_num_threads
        self._rope_and_cache = module.rope_and_cache
        self._argmax_rows = module.argmax_rows

    def gelu_tanh_and_mul(self, gate_up: np.ndarray) -> np.ndarray:
        return gelu_tanh_and_mul_by_rows(gate_up, int(self._threads()))

    def argmax_rows(self, logits: np.ndarray) -> np.ndarray:
        # numpy's argmax answer (first index of the maximum, NaN first), vectorised in one pass that
        # also finds NaNs: ~2% of a Gemma 3 decode step over 262,144 logits otherwise.
        if (logits.dtype != np.float32 or logits.ndim != 2 or logits.strides[-1] != logits.itemsize
                or logits.shape[-1] == 0):
            return ReferenceOps.argmax_rows(logits)
        return self._argmax_rows(logits)

    def rope_and_cache(self, qkv: np.ndarray, cos: np.ndarray, sin: np.ndarray, k_cache: np.ndarray,
                       v_cache: np.ndarray, slots: np.ndarray, num_heads: int, num_kv_heads: int,
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


def layer_ops() -> LayerOps:
    """Chosen once per forward pass, not per op: the fused kernels where they are built and on."""
    module = fused_ops()
    return _REFERENCE if module is None else _fused(module)
