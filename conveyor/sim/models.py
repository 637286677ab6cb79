"""Model descriptions for the simulator: the shapes a cost model needs, nothing that holds weights.

Parameter counts follow the Llama layout: per layer q/k/v/o projections, a gated MLP (gate, up,
down) and two RMSNorm vectors; then a final norm, the embedding and the LM head (shared if tied).
A model with sliding-window layers (Gemma 3's local ones) names how many of its layers attend only
to the last `sliding_window` positions: their KV can live in a pool of its own (the engine's
window_kv_pool) and their attention reads at most a window.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from conveyor.errors import ConfigError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype: str = "bfloat16"
    tie_word_embeddings: bool = False
    max_model_len: int = 8192
    sliding_window: int | None = None  # positions a sliding-window layer's query sees, itself included
    num_window_layers: int = 0  # layers with that window; the others see the whole context

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; choose from {', '.join(DTYPE_BYTES)}")
        if not 0 <= self.num_window_layers <= self.num_layers or (self.num_window_layers > 0) != (
                self.sliding_window is not None) or (self.sliding_window is not None and self.sliding_window < 1):
            raise ConfigError(f"{self.name}: a sliding window needs sliding_window >= 1 and 1 to num_layers "
                              f"window layers, got {self.sliding_window} and {self.num_window_layers}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def layer_matmul_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        per_layer = self.layer_matmul_params + 2 * self.hidden_size
        embeddings = self.lm_head_params * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + self.hidden_size + embeddings

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer, as the engine's paged cache stores them."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def window_kv_bytes_per_token(self) -> int:
        """K and V of the sliding-window layers alone."""
        return self.kv_bytes_per_token // self.num_layers * self.num_window_layers

    @property
    def window_layer_share(self) -> float:
        return self.num_window_layers / self.num_layers

    @property
    def layer_activation_elements(self) -> int:
        """Elements each token's activations move through one layer's matmuls: every matmul reads
        its input and writes its output once (fused kernels do about this; eager code does more)."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.intermediate_size
        reads = h + q + h + i  # qkv in, o in, gate/up in, down in
        writes = (q + 2 * kv) + h + 2 * i + h
        return reads + writes


MODELS: dict[str, ModelSpec] = {
    # As conveyor runs it on a CPU: the GGUF dequantised to fp32.
    "smollm2-135m": ModelSpec("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, "float32", True, 8192),
    "llama-3-8b": ModelSpec("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, "bfloat16", False, 8192),
    "llama-2-13b": ModelSpec("llama-2-13b", 40, 5120, 40, 40, 128, 13824, 32000, "bfloat16", False, 4096),
    "llama-3-70b": ModelSpec("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256, "bfloat16", False, 8192),
    # Five local layers (a 1,024-token window) to one global; its gated MLP is counted as Llama's.
    "gemma-3-27b": ModelSpec("gemma-3-27b", 62, 5376, 32, 16, 128, 21504, 262208, "bfloat16", True, 131072,
                             sliding_window=1024, num_window_layers=52),
}


def get_model(name: str, dtype: str | None = None) -> ModelSpec:
    spec = MODELS.get(name.lower())
    if spec is None:
        raise ConfigError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    return replace(spec, dtype=dtype) if dtype else spec
