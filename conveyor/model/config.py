"""Architecture description of a Llama-family decoder; variants differ only in these switches.

Gemma 3 is the same decoder with more of them on: sliding-window layers between global ones (each
kind with its own RoPE base), norms that scale by 1 + weight, a norm on the output of attention and
of the MLP before each joins the residual, GELU(tanh) gating and an embedding scaled by sqrt(hidden)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k before RoPE
    # HF-style rope_scaling dict (e.g. {"rope_type": "llama3", "factor": 8.0, ...}) or None.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"
    # Gemma 3 (all off for Llama):
    sliding_window: int | None = None  # tokens a sliding-window layer sees, itself included
    # "sliding_attention" / "full_attention" per layer; empty: every layer is full attention
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None  # RoPE base of the sliding-window layers (None: rope_theta)
    norm_weight_offset: float = 0.0  # a norm scales by offset + weight (Gemma stores weight - 1)
    sandwich_norms: bool = False  # RMSNorm on the attention and MLP outputs before the residual add
    hidden_act: str = "silu"  # the gate's activation: "silu" or "gelu_tanh"
    scale_embeddings: bool = False  # multiply the embedding by sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (None: head_dim)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # How the file says to pool an embedding ("last", "mean", "cls"; a GGUF's {arch}.pooling_type);
    # None: it does not say
    pooling_type: str | None = None

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, None for full attention."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token per element byte (multiply by the dtype's size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim
