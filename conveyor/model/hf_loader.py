"""Hugging Face checkpoint folders (config.json + *.safetensors + tokenizer.json) -> our types."""
from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

from conveyor.errors import ModelLoadError, UnsupportedModelError
from conveyor.model.config import ModelConfig
from conveyor.model.linear import WeightSource, blocks_kept, held_once, pack_blocks
from conveyor.model.mapped import drop_pages, map_file, rows_dropper
from conveyor.model.quantized import QuantizedWeight, bf16_to_float32
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


# safetensors' dtype names (its format's header) -> the numpy dtype its bytes are read as: numpy has
# no bfloat16 nor 8-bit floats, so those are read as their bits and converted (`_as_float32`)
_SAFETENSORS_DTYPES: dict[str, np.dtype] = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
                       "BF16": np.dtype(np.uint16), "F8_E4M3": np.dtype(np.uint8), "F8_E5M2": np.dtype(np.uint8),
                       "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
                       "I8": np.dtype(np.int8), "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32),
                       "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_)}
_FLOATS = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


def _float8_table(exponent_bits: int, bias: int, finite_only: bool) -> np.ndarray:
    """The 256 values of an 8-bit float (OCP's E4M3FN: no infinities, S.1111.111 NaN; E5M2: IEEE-like)."""
    mantissa_bits = 7 - exponent_bits
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> mantissa_bits) & ((1 << exponent_bits) - 1)
    mantissa = codes & ((1 << mantissa_bits) - 1)
    normal = (1 + mantissa / (1 << mantissa_bits)) * np.exp2(exponent.astype(np.float64) - bias)
    subnormal = mantissa / (1 << mantissa_bits) * 2.0 ** (1 - bias)
    values = sign * np.where(exponent == 0, subnormal, normal)
    top = (1 << exponent_bits) - 1
    if finite_only:
        values[(exponent == top) & (mantissa == (1 << mantissa_bits) - 1)] = np.nan
    else:
        values[(exponent == top) & (mantissa == 0)] = sign[(exponent == top) & (mantissa == 0)] * np.inf
        values[(exponent == top) & (mantissa != 0)] = np.nan
    return values.astype(np.float32)


_FLOAT8 = {"F8_E4M3": _float8_table(4, 7, True), "F8_E5M2": _float8_table(5, 15, False)}


def _as_float32(raw: np.ndarray, stored: str) -> np.ndarray:
    """A floating tensor's values in fp32 (a new array, detached from the file's mapping)."""
    if stored == "BF16":
        return bf16_to_float32(raw)
    if stored in _FLOAT8:
        return _FLOAT8[stored][raw]
    return raw.astype(np.float32)


def _safetensors_index(buffer: mmap.mmap) -> tuple[int, dict[str, tuple[str, tuple[int, ...], int, int]]]:
    """(where the data starts, name -> (safetensors dtype, shape, start, end) within the data) from the file's
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
        index[name] = (entry["dtype"], shape, begin, end)
    return data_start, index


def load_hf_weights(folder: Path, config: ModelConfig, dtype: str = "float32",
                    keep_halves: bool = True) -> dict[str, WeightSource]:
    """The folder's tensors, read through each file's memory map one tensor at a time: floating ones
    in fp32, but for matrices kept in 16 bits. With `keep_halves` and fp32, a matrix stored in
    float16 or bfloat16 stays in those bytes: packed for the kernel (conveyor.model.linear), whose
    products are the fp32 ones bit for bit (the expansion is exact) at half the memory; an embedding
    no output head reuses is read by rows only and stays a view of the mapping. With dtype
    "bfloat16" every matrix is held as bf16 (a bfloat16 one as stored, the others rounded), in BF16
    panels where the kernel builds, the activations staying fp32. Each tensor's file pages are
    dropped once it is taken, so a load peaks near what the model holds."""
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
            raw_dtype = _SAFETENSORS_DTYPES[stored]
            raw = np.frombuffer(buffer, dtype=raw_dtype, count=math.prod(shape), offset=data_start + begin) \
                if begin != end else np.empty(0, dtype=raw_dtype)
            t = raw.reshape(shape)
            matrix = stored in _FLOATS and t.ndim == 2
            as_halves = stored in ("F16", "BF16") and matrix and (
                dtype == "float32" and keep_halves or dtype == "bfloat16" and stored == "BF16")
            if as_halves:
                held = QuantizedWeight.of_halves(t, stored)
                if name == "model.embed_tokens.weight" and not config.tie_word_embeddings and blocks_kept():
                    weights[name] = held  # read by rows only: stays in the file's mapping (Embedding.load)
                    continue
                taken = rows_dropper(buffer, data_start + begin, shape[1] * raw_dtype.itemsize)
                if (packed := pack_blocks(held, taken)) is not None:
                    weights[name] = packed  # `taken` dropped its pages run by run
                    continue
            if stored not in _FLOATS:
                weights[name] = t.copy()  # copy: detach from the mapping
            elif dtype == "bfloat16" and matrix:  # in its bf16 panels now, the fp32 values freed at once
                plain, packed = held_once(QuantizedWeight.of_halves(t.copy(), "BF16") if stored == "BF16"
                                          else _as_float32(t, stored), dtype)
                weights[name] = packed if packed is not None else QuantizedWeight.of_halves(plain, "BF16")  # type: ignore[arg-type]
            else:
                weights[name] = _as_float32(t, stored)
            drop_pages(buffer, data_start + begin, data_start + end)
        drop_pages(buffer, 0, len(buffer))
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    required += [] if config.tie_word_embeddings else ["lm_head.weight"]
    missing = [n for n in required if n not in weights]
    if missing:
        raise ModelLoadError(f"{folder}: checkpoint lacks {missing}")
    return weights


def load_hf_folder(folder: Path, dtype: str = "float32",
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
