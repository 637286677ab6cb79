"""Write a loaded checkpoint (e.g. the dequantised GGUF) as a Hugging Face model folder.

The folder holds what `transformers.AutoModelForCausalLM.from_pretrained`, vLLM and conveyor's own HF
loader read: config.json, model.safetensors (HF tensor names, tied lm_head omitted as
`save_pretrained` does), tokenizer.json, tokenizer_config.json (chat template, special tokens),
generation_config.json. Peers load the very weights conveyor runs, so benchmarks compare engines,
not quantisations. Needs neither transformers nor a network.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any, Iterable

import numpy as np
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import processors

from conveyor.errors import ModelLoadError
from conveyor.model.config import ModelConfig
from conveyor.model.quantized import bf16_bits
from conveyor.model.tokenizer import Tokenizer

_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_DTYPES = ("float32", "bfloat16", "float16")  # what the weights may be written in
EXPORTED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "generation_config.json")


def hf_config_dict(config: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """config.json for `config`, readable by transformers 4.x (rope_theta / rope_scaling) and 5.x."""
    model_type = _MODEL_TYPES.get(config.architecture)
    if model_type is None:
        raise ModelLoadError(f"cannot export architecture {config.architecture}")
    eos = list(config.eos_token_ids)
    rope_parameters = {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}
    out: dict[str, Any] = {
        "architectures": [config.architecture],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": dict(config.rope_scaling) if config.rope_scaling else None,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": dtype if dtype in _DTYPES else "float32",
        "use_cache": True,
    }
    if model_type == "llama":
        out["mlp_bias"] = False
    if model_type in ("qwen2", "qwen3"):
        out["use_sliding_window"] = False
        out["sliding_window"] = None
        out["max_window_layers"] = config.num_layers
    return out


def _backend_for_hf(tokenizer: Tokenizer) -> _HFTokenizer:
    """A copy of the backend whose own post-processor adds BOS, and appends a token (an embedding
    model's EOS), exactly when conveyor's encode does."""
    backend = _HFTokenizer.from_str(tokenizer.backend.to_str())
    bos = tokenizer.token_to_str(tokenizer.bos_token_id)
    head = [(bos, int(tokenizer.bos_token_id))] if tokenizer.add_bos_token and bos is not None else []  # type: ignore[arg-type]
    end = tokenizer.token_to_str(tokenizer.eos_appended_id)
    tail = [(end, int(tokenizer.eos_appended_id))] if end is not None else []  # type: ignore[arg-type]
    if head or tail:
        def around(part: str, seq: int) -> str:
            return " ".join([*(f"{t}:{seq}" for t, _ in head), f"{part}:{seq}", *(f"{t}:{seq}" for t, _ in tail)])

        backend.post_processor = processors.TemplateProcessing(
            single=around("$A", 0), pair=f"{around('$A', 0)} {around('$B', 1)}", special_tokens=list(dict(head + tail).items()))
    # Otherwise a leftover processor (e.g. ByteLevel offsets only) is harmless; a BOS-adding one is not.
    elif backend.post_processor is not None and tokenizer.bos_token_id is not None \
            and backend.encode("a", add_special_tokens=True).ids[:1] == [tokenizer.bos_token_id]:
        backend.post_processor = None
    return backend


def tokenizer_config_dict(tokenizer: Tokenizer, model_max_length: int) -> dict[str, Any]:
    special = tokenizer.special_tokens
    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(tokenizer.add_bos_token),
        # Where the appended token is not the EOS named below, the post-processor alone says it.
        **({} if tokenizer.eos_appended_id not in (None, tokenizer.eos_token_id)
           else {"add_eos_token": tokenizer.eos_appended_id is not None}),
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        if special.get(key) is not None:
            out[key] = special[key]
    if "pad_token" not in out and "eos_token" in out:
        out["pad_token"] = out["eos_token"]  # HF generate wants one for batches; eos is the usual choice
    if tokenizer.chat_template:
        out["chat_template"] = tokenizer.chat_template
    return out


def generation_config_dict(config: ModelConfig, tokenizer: Tokenizer) -> dict[str, Any]:
    eos = list(dict.fromkeys([*config.eos_token_ids, *tokenizer.eos_token_ids]))
    pad_token = tokenizer.special_tokens.get("pad_token")
    pad = tokenizer.token_to_id(pad_token) if pad_token else None
    return {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": pad if pad is not None else (eos[0] if eos else None),
        "do_sample": False,
    }


# the dtypes written (numpy has no bfloat16: "bfloat16" is fp32 values rounded, written as their bits)
_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int64": "I64", "int32": "I32",
                       "uint8": "U8", "int8": "I8"}
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "uint8": 1, "int8": 1}


def _encoded(array: np.ndarray, dtype: str) -> np.ndarray:
    """The array's values as `dtype` stores them: floats converted (bf16 rounded to nearest even, as
    its bits), integers as they are."""
    if dtype == "bfloat16":
        return bf16_bits(array.astype(np.float32, copy=False)) if array.dtype != np.uint16 else array
    if dtype in ("float32", "float16"):
        return np.ascontiguousarray(array, dtype=dtype)
    return np.ascontiguousarray(array)


def write_safetensors(path: Path, shapes: dict[str, tuple[tuple[int, ...], str]],
                      tensors: Iterable[tuple[str, np.ndarray]], metadata: dict[str, str]) -> None:
    """A safetensors file written tensor by tensor: the header is laid out from `shapes` (name ->
    shape and dtype name, in the order `tensors` yields them), then each array's bytes follow as it
    comes, converted to its dtype (`_encoded`), so no more than one tensor is held at a time."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, (shape, dtype) in shapes.items():
        size = math.prod(shape) * _ITEMSIZE[dtype]
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    expected = iter(shapes.items())
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, tensor in tensors:
            want_name, (shape, dtype) = next(expected)
            data = _encoded(tensor, dtype)
            if name != want_name or tuple(tensor.shape) != tuple(shape) or data.dtype.itemsize != _ITEMSIZE[dtype]:
                raise ValueError(f"tensor {name} {tuple(tensor.shape)} {tensor.dtype} where the header has "
                                 f"{want_name} {shape} {dtype}")
            f.write(data.view(np.uint8).data)
    if next(expected, None) is not None:
        raise ValueError("fewer tensors than the header lists")


def export_hf_folder(
    config: ModelConfig,
    weights: dict[str, np.ndarray],
    tokenizer: Tokenizer,
    out_dir: str | Path,
    dtype: str = "float32",
) -> Path:
    """Writes the five files of an HF checkpoint into `out_dir` (created; existing files overwritten):
    floating arrays in `dtype` ("float32", "bfloat16" or "float16"), integer ones as they are."""
    if dtype not in _DTYPES:
        raise ValueError(f"export writes weights in one of {_DTYPES}, not {dtype!r}")
    shapes = {name: (tuple(t.shape), dtype if np.issubdtype(t.dtype, np.floating) else t.dtype.name)
              for name, t in weights.items()}
    return _write_folder(config, shapes, iter(weights.items()), tokenizer, Path(out_dir), dtype)


def _write_folder(config: ModelConfig, shapes: dict[str, tuple[tuple[int, ...], str]],
                  tensors: Iterable[tuple[str, np.ndarray]], tokenizer: Tokenizer, folder: Path,
                  dtype: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if config.tie_word_embeddings:  # transformers re-ties it; vLLM reads tie_word_embeddings
        shapes = {n: s for n, s in shapes.items() if n != "lm_head.weight"}
        tensors = ((n, t) for n, t in tensors if n != "lm_head.weight")
    elif "lm_head.weight" not in shapes:
        raise ModelLoadError("untied checkpoint without lm_head.weight")
    write_safetensors(folder / "model.safetensors", shapes, tensors, {"format": "pt"})

    def dump(name: str, obj: dict[str, Any]) -> None:
        (folder / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    dump("config.json", hf_config_dict(config, dtype))
    _backend_for_hf(tokenizer).save(str(folder / "tokenizer.json"))
    dump("tokenizer_config.json", tokenizer_config_dict(tokenizer, config.max_position_embeddings))
    dump("generation_config.json", generation_config_dict(config, tokenizer))
    return folder


def export_model(model: str | None, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Exports `model` (a name, .gguf or HF folder; None = the default GGUF) to `out_dir`. A GGUF is
    dequantized one matrix at a time as it is written: memory holds one tensor, not the model."""
    from conveyor.model.gguf_loader import gguf_config, hf_name, iter_dequantized, read_gguf
    from conveyor.model.loader import load_checkpoint, resolve_model_path

    path = resolve_model_path(model)
    if not path.is_file():
        ckpt = load_checkpoint(str(path), "float32", keep_blocks=False)  # fp32 values, rounded to `dtype` as written
        dense = {n: w for n, w in ckpt.weights.items() if isinstance(w, np.ndarray)}
        return export_hf_folder(ckpt.config, dense, ckpt.tokenizer, out_dir, dtype)
    gf = read_gguf(path)
    tokenizer = Tokenizer.from_gguf(gf.metadata)
    config = gguf_config(gf, tokenizer)
    arch = gf.metadata["general.architecture"]
    shapes = {hf_name(t.name, arch): (t.shape, dtype) for t in gf.tensors.values()}
    gf.buffer.close()
    tensors = iter_dequantized(path)
    return _write_folder(config, shapes, tensors, tokenizer, Path(out_dir), dtype)
