"""What a served model is, as a model list describes it (Ollama's /api/tags and /api/show): its
file, format, family, size and quantization. Plain data, no torch: the front end reads it, and a Ray
worker sends it across."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFacts:
    path: str  # the .gguf file or the HF folder served
    format: str  # "gguf" or "safetensors"
    family: str  # the architecture as the file names it: "qwen2", "llama", "gemma3"
    parameter_count: int
    quantization: str  # the file's type ("Q4_K_M", "Q5_0", "BF16", "F32")
    size_bytes: int  # of the file (of the folder's weight files)
    modified: float  # the file's mtime (seconds since the epoch)
    context_length: int  # what the model was trained for (not what this server holds)
    embedding_length: int
    num_layers: int
    num_heads: int
    num_kv_heads: int

    @property
    def parameter_size(self) -> str:
        """As Ollama writes it: "494.03M", "1.54B"."""
        count = self.parameter_count
        if count >= 10**9:
            return f"{count / 10**9:.2f}B"
        return f"{count / 10**6:.2f}M"
