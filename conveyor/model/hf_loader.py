"""Hugging Face checkpoint folders (config.json + *.safetensors + tokenizer.json) -> our types."""
from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path
from typing import Any

import torch

from conveyor.errors import ModelLoadError, UnsupportedModelError
from conveyor.model.config import ModelConfig
from conveyor.model.linear import WeightSource, blocks_kept, pack_blocks
from conveyor.model.mapped import drop_pages, map_file, rows_dropper
from conveyor.model.quantized import HALF_DTYPES, QuantizedWeight
from conveyor.model.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Gemma3ForCausalLM")


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from transformers>=5 `rope_parameters` or the older `rope_theta`/`rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    if "type" in params and "rope_type" not in params:  # pre-4.45 spelling
        params["rope_type"] = params.pop("type")
    return theta, (params if params.get("rope_type", "default") != "default" else None)


def _gemma3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma3TextConfig's switches; rope_parameters holds one dict per layer kind."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError("Gemma attention logit softcapping is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("Gemma bidirectional attention is not supported")
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"Gemma activation {cfg['hidden_activation']!r} is not supported")
    kinds = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(int(cfg["num_hidden_layers"]))
    ]
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
    cap = cfg.get("final_logit_softcapping")
    return dict(
        sliding_window=int(cfg["sliding_window"]) if cfg.get("sliding_window") else None,
        layer_types=tuple(kinds),
        rope_local_theta=float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))),
        norm_weight_offset=1.0,
        sandwich_norms=True,
        hidden_act="gelu_tanh",
        scale_embeddings=True,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=float(cap) if cap is not None else None,
    )


def hf_config(cfg: dict[str, Any], tokenizer: Tokenizer | None, where: Path) -> ModelConfig:
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{where / 'config.json'} is not a JSON object")
    archs = cfg.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"{where}: architectures {archs} not supported; conveyor runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        sizes = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")
        if not all(isinstance(cfg.get(name), int) and cfg[name] > 0 for name in sizes):
            raise ValueError(f"{', '.join(sizes)} must be positive integers, got "
                             f"{', '.join(str(cfg.get(name)) for name in sizes)}")
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        gemma = arch == "Gemma3ForCausalLM"
        extra = _gemma3_fields(cfg) if gemma else {}
        global_rope = (cfg.get("rope_parameters") or {}).get("full_attention") if gemma else None
        theta, scaling = _rope({**cfg, "rope_parameters": global_rope} if global_rope is not None else cfg)
        # Qwen3's config class defaults head_dim to 128, not hidden/heads.
        head_dim = cfg.get("head_dim") or (128 if arch == "Qwen3ForCausalLM" else hidden // heads)
        eos = cfg.get("eos_token_id")
        eos_ids = [*(eos if isinstance(eos, list) else [eos] if eos is not None else [])]
        if tokenizer is not None:
            eos_ids += tokenizer.eos_token_ids
        bos = cfg.get("bos_token_id")
        return ModelConfig(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rope_theta=theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2's attention always has q/k/v bias; its config has no switch for it.
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM" or gemma,
            rope_scaling=scaling,
            bos_token_id=bos if bos is not None else (tokenizer.bos_token_id if tokenizer else None),
            eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids)),
            architecture=arch,
            **extra,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{where / 'config.json'}: missing or invalid field: {e}") from e


# safetensors' dtype names (its format's header) -> torch's
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                       "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U64": torch.uint64, "U32": torch.uint32,
                       "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool}


def _safetensors_index(buffer: mmap.mmap) -> tuple[int, dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]]:
    """(where the data starts, name -> (dtype, shape, start, end) within the data) from the file's
    header: 8 bytes of little-endian length, then that much JSON."""
    if len(buffer) < 8:
        raise ValueError("shorter than a safetensors header")
    (length,) = struct.unpack_from("<Q", buffer, 0)
    if length > len(buffer) - 8:
        raise ValueError(f"header of {length} bytes in a file of {len(buffer)}")
    header = json.loads(bytes(buffer[8 : 8 + length]))
    data_start, data_bytes = 8 + length, len(buffer) - 8 - length
    index = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: dtype {entry['dtype']} is not supported")
        dtype, shape = _SAFETENSORS_DTYPES[entry["dtype"]], tuple(int(d) for d in entry["shape"])
        begin, end = (int(o) for o in entry["data_offsets"])
        if not 0 <= begin <= end <= data_bytes or end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{name}: data_offsets {begin}..{end} do not hold {entry['dtype']} {list(shape)}")
        index[name] = (dtype, shape, begin, end)
    return data_start, index


def load_hf_weights(folder: Path, config: ModelConfig, dtype: torch.dtype,
                    keep_halves: bool = True) -> dict[str, WeightSource]:
    """The folder's tensors in `dtype`, read through each file's memory map one tensor at a time.
    With `keep_halves` and fp32, a matrix stored in float16 or bfloat16 stays in those bytes: packed
    for the kernel (conveyor.model.linear), whose products are the fp32 ones bit for bit (the
    expansion is exact) at half the memory; an embedding no output head reuses is read by rows only
    and stays a view of the mapping. Each tensor's file pages are dropped once it is taken, so a load
    peaks near what the model holds."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors files (pytorch_model.bin is not supported)")
    weights: dict[str, WeightSource] = {}
    for f in files:
        try:
            buffer = map_file(f)
            data_start, index = _safetensors_index(buffer)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
            raise ModelLoadError(f"cannot read weights {f}: {e}") from e
        for name, (stored, shape, begin, end) in index.items():
            if config.tie_word_embeddings and name == "lm_head.weight":
                continue  # a saved copy of the embedding; the model reuses embed_tokens
            if begin == end:
                t = torch.empty(shape, dtype=stored)
            else:
                t = torch.frombuffer(buffer, dtype=stored, count=math.prod(shape), offset=data_start + begin).reshape(shape)
            if keep_halves and dtype == torch.float32 and stored in HALF_DTYPES and t.dim() == 2:
                held = QuantizedWeight.of_halves(t)
                if name == "model.embed_tokens.weight" and not config.tie_word_embeddings and blocks_kept():
                    weights[name] = held  # read by rows only: stays in the file's mapping (Embedding.load)
                    continue
                taken = rows_dropper(buffer, data_start + begin, shape[1] * stored.itemsize)
                if (packed := pack_blocks(held, taken)) is not None:
                    weights[name] = packed  # `taken` dropped its pages run by run
                    continue
            # copy: detach from the mapping, whatever the dtype
            weights[name] = t.to(dtype, copy=True) if t.is_floating_point() else t.clone()
            drop_pages(buffer, data_start + begin, data_start + end)
        drop_pages(buffer, 0, len(buffer))
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    required += [] if config.tie_word_embeddings else ["lm_head.weight"]
    missing = [n for n in required if n not in weights]
    if missing:
        raise ModelLoadError(f"{folder}: checkpoint lacks {missing}")
    return weights


def load_hf_folder(folder: Path, dtype: torch.dtype,
                   keep_halves: bool = True) -> tuple[ModelConfig, dict[str, WeightSource], Tokenizer]:
    cfg_path = folder / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {cfg_path}: {e}") from e
    hf_config(cfg, None, folder)  # reject unsupported architectures before reading a tokenizer or weights
    tokenizer = Tokenizer.from_hf_folder(folder)
    config = hf_config(cfg, tokenizer, folder)
    return config, load_hf_weights(folder, config, dtype, keep_halves), tokenizer
