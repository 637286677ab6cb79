"""GGUF checkpoints -> (ModelConfig, HF-named weights, Tokenizer): blocks packed, the rest dense.

The metadata is parsed here rather than with `gguf.GGUFReader`: the reader builds numpy views for
each of the vocabulary strings, which takes seconds; this parse is far quicker (docs/PERF.md).
Block formats come from `gguf.constants`; common quant types are dequantised here in numpy
(bit-identical to `gguf.quants.dequantize` and faster), the rest with `gguf.quants.dequantize`.
Matrices in the block types the matmul kernel reads (Q4_0/1, Q5_0/1, Q8_0, Q2_K-Q6_K, F16, BF16) are
kept only as their blocks, which it streams.
"""
from __future__ import annotations

import logging

import mmap
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from conveyor.errors import ModelLoadError, UnsupportedModelError
from conveyor.model.config import ModelConfig
from conveyor.model.linear import WeightSource, held_once, pack_blocks
from conveyor.model.mapped import drop_pages, map_file, rows_dropper
from conveyor.model.quantized import QuantizedWeight, bf16_to_float32, kernel_keeps
from conveyor.model.tokenizer import Tokenizer

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
          "gemma3": "Gemma3ForCausalLM"}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
# Gemma's four norms a layer: llama.cpp's ffn_norm is the one before the MLP, as in Llama, but
# HF calls that pre_feedforward_layernorm and post_attention_layernorm norms the attention output.
_GEMMA3_BLOCK_NAMES = {
    **_BLOCK_NAMES, "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# llama.cpp's Gemma 3: every sixth layer is global, the local layers rotate with base 10000
# (neither is in the file).
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # row-major order (GGUF lists dims innermost first)
    qtype: GGMLQuantizationType
    offset: int  # absolute, in the file
    nbytes: int


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    buffer: mmap.mmap


def read_gguf(path: str | Path, with_arrays: bool = True) -> GGUFFile:
    """Parse a GGUF v2/v3 header; tensor data stays memory-mapped. `with_arrays` False leaves the
    metadata's arrays (the vocabulary, its merges and scores: 10^5 values, tens of MiB as Python
    objects) out of `metadata`, for a caller that needs only the tensors."""
    path = Path(path)
    try:
        return _parse(path, map_file(path), with_arrays)
    except struct.error as e:  # a read past the end: the header says more than the file holds
        raise ModelLoadError(f"cannot read GGUF file {path}: it ends inside its header, so it is truncated "
                             f"(an interrupted download or copy?): {e}") from e
    except (OSError, ValueError, UnicodeDecodeError, KeyError) as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e


def _parse(path: Path, buf: mmap.mmap, with_arrays: bool = True) -> GGUFFile:
    if buf[:4] != b"GGUF":
        raise ValueError("not a GGUF file (bad magic)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version}")
    pos = 24

    def read(fmt: str) -> Any:
        nonlocal pos
        (value,) = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return value

    def read_str() -> str:
        nonlocal pos
        n = read("<Q")
        pos += n
        return buf[pos - n : pos].decode("utf-8", errors="replace")

    length = struct.Struct("<Q").unpack_from

    def read_value(vtype: int) -> Any:
        nonlocal pos
        if vtype == _STRING:
            return read_str()
        if vtype != _ARRAY:
            return read(_SCALARS[vtype])
        itype, count = read("<I"), read("<Q")
        if not with_arrays:
            skip_array(itype, count)
            return None
        if itype in _SCALARS:  # one unpack for the whole array (a vocabulary's token types, scores)
            fmt = f"<{count}{_SCALARS[itype][1]}"
            values = list(struct.unpack_from(fmt, buf, pos))
            pos += struct.calcsize(fmt)
            return values
        if itype == _STRING:  # a vocabulary or its merges: 10^5 strings, read in one tight loop
            strings = []
            for _ in range(count):
                (n,) = length(buf, pos)
                strings.append(buf[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace"))
                pos += 8 + n
            return strings
        return [read_value(itype) for _ in range(count)]

    def skip_array(itype: int, count: int) -> None:
        nonlocal pos
        if itype in _SCALARS:
            pos += count * struct.calcsize(_SCALARS[itype])
        elif itype == _STRING:
            for _ in range(count):
                pos += 8 + length(buf, pos)[0]
        elif itype == _ARRAY:
            for _ in range(count):
                skip_array(read("<I"), read("<Q"))
        else:
            raise ValueError(f"unknown GGUF array element type {itype}")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = read_str()
        value = read_value(read("<I"))
        if value is not None or with_arrays:
            metadata[key] = value
    infos = []
    for _ in range(n_tensors):
        name, ndim = read_str(), read("<I")
        dims = struct.unpack_from(f"<{ndim}Q", buf, pos)
        pos += 8 * ndim
        qtype, offset = GGMLQuantizationType(read("<I")), read("<Q")
        infos.append((name, tuple(reversed(dims)), qtype, offset))
    align = int(metadata.get("general.alignment", 32))
    data_start = (pos + align - 1) // align * align
    tensors = {}
    for name, shape, qtype, offset in infos:
        block, size = GGML_QUANT_SIZES[qtype]
        nbytes = prod(shape) // block * size
        if data_start + offset + nbytes > len(buf):
            raise ValueError(f"tensor {name} extends past the end of the file (truncated?)")
        tensors[name] = GGUFTensor(name, shape, qtype, data_start + offset, nbytes)
    return GGUFFile(path, metadata, tensors, buf)


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16).astype(np.float32)


def _raw(gf: GGUFFile, t: GGUFTensor) -> np.ndarray:
    """The tensor's bytes, a view of the file's mapping."""
    return np.frombuffer(gf.buffer, dtype=np.uint8, count=t.nbytes, offset=t.offset)


def dequantize(gf: GGUFFile, t: GGUFTensor) -> np.ndarray:
    """One tensor as fp32, in row-major shape, a copy (detached from the file mapping). numpy's
    element-wise ops run on the calling thread: one thread, which is what dequantising's many small
    ops want when other processes share the cores (docs/PERF.md)."""
    raw = _raw(gf, t)
    Q = GGMLQuantizationType
    if t.qtype == Q.F32:
        out = raw.view(np.float32).copy()
    elif t.qtype == Q.F16:
        out = raw.view(np.float16).astype(np.float32)
    elif t.qtype == Q.BF16:
        out = bf16_to_float32(raw.view(np.uint16))
    elif t.qtype == Q.Q8_0:  # 32 int8 values and one fp16 scale per block
        b = raw.reshape(-1, 34)
        out = _half(b, 0) * np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.float32)
    elif t.qtype in (Q.Q4_0, Q.Q4_1):  # low nibbles are values 0-15 of a block, high nibbles 16-31
        b = raw.reshape(-1, 18 if t.qtype == Q.Q4_0 else 20)
        qs = b[:, -16:]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32)
        out = _half(b, 0) * (q - 8) if t.qtype == Q.Q4_0 else _half(b, 0) * q + _half(b, 2)
    else:
        rows = raw.reshape(prod(t.shape[:-1]), -1)
        out = np.ascontiguousarray(quants.dequantize(rows, t.qtype), dtype=np.float32)
    return out.reshape(t.shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's `permute`: llama.cpp's RoPE rotates adjacent pairs, HF's rotates halves.
    A contiguous copy."""
    # permute viewed rows as (head, 2, half) and stored them as (head, half, 2); swap back.
    return np.ascontiguousarray(
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA3_BLOCK_NAMES if arch == "gemma3" else _BLOCK_NAMES
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in names:
        raise UnsupportedModelError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


def _gemma3_fields(meta: dict[str, Any], num_layers: int, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    if meta.get("gemma3.attn_logit_softcapping") is not None:
        raise UnsupportedModelError("Gemma attention logit softcapping is not supported")
    window = meta.get("gemma3.attention.sliding_window")
    kinds = tuple("full_attention" if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 or window is None else "sliding_attention"
                  for i in range(num_layers))
    cap = meta.get("gemma3.final_logit_softcapping")
    return dict(
        sliding_window=int(window) if window is not None else None,
        layer_types=kinds,
        rope_local_theta=GEMMA3_LOCAL_ROPE_THETA,
        norm_weight_offset=1.0,
        sandwich_norms=True,
        hidden_act="gelu_tanh",
        scale_embeddings=True,
        # Not in the file: llama.cpp scales by head_dim, except the 27B (62 layers) by hidden / heads.
        query_pre_attn_scalar=float(hidden // heads if num_layers == 62 else head_dim),
        final_logit_softcapping=float(cap) if cap else None,
    )


# llama.cpp's enum in `{arch}.pooling_type`: 0 none, 1 mean, 2 cls, 3 last, 4 rank (a reranker's)
_GGUF_POOLING_TYPES = {1: "mean", 2: "cls", 3: "last"}
_GGUF_RANK_POOLING = 4
log = logging.getLogger(__name__)


def gguf_config(gf: GGUFFile, tokenizer: Tokenizer) -> ModelConfig:
    meta = gf.metadata
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} in {gf.path} is not supported ({sorted(_ARCHS)})")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"GGUF file {gf.path} lacks metadata {arch}.{name}")
        return value

    if meta.get(f"{arch}.pooling_type") == _GGUF_RANK_POOLING:
        log.warning("%s is a reranker (pooling_type rank), which conveyor does not serve as one: it generates, and "
                    "/v1/embeddings pools by --pooling-type", gf.path)
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count") or hidden // heads
    num_layers = int(key("block_count"))
    extra = _gemma3_fields(meta, num_layers, hidden, heads, int(head_dim)) if arch == "gemma3" else {}
    rope_scaling = None
    if meta.get(f"{arch}.rope.scaling.type") not in (None, "none"):
        rope_scaling = {"rope_type": meta[f"{arch}.rope.scaling.type"], "factor": float(key("rope.scaling.factor"))}
        if (orig := meta.get(f"{arch}.rope.scaling.original_context_length")) is not None:
            rope_scaling["original_max_position_embeddings"] = int(orig)
    return ModelConfig(
        vocab_size=gf.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(head_dim),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in gf.tensors,
        attention_bias="blk.0.attn_q.bias" in gf.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in gf.tensors,
        rope_scaling=rope_scaling,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        architecture=_ARCHS[arch],
        pooling_type=_GGUF_POOLING_TYPES.get(meta.get(f"{arch}.pooling_type", 0)),
        **extra,
    )


def _release(gf: GGUFFile, t: GGUFTensor) -> None:
    """Drops the file pages of a tensor already taken (packed or dequantized), so that a load
    holds at most one tensor's pages at a time beside what it built, not the whole file."""
    drop_pages(gf.buffer, t.offset, t.offset + t.nbytes)


def _blocks(gf: GGUFFile, t: GGUFTensor) -> QuantizedWeight | None:
    """The tensor's blocks as they lie in the file, one row per output feature, where the kernel
    can read them."""
    if not kernel_keeps(t.qtype.name, t.shape):
        return None
    return QuantizedWeight(t.qtype.name, _raw(gf, t).reshape(t.shape[0], -1))


def load_gguf(
    path: str | Path, dtype: str = "float32", keep_blocks: bool = True
) -> tuple[ModelConfig, dict[str, WeightSource], Tokenizer]:
    """HF-named weights, read through the file's memory map one tensor at a time: with `keep_blocks`
    and fp32, a matrix in blocks the kernel reads is packed from the file's bytes into its panels
    (its only copy: conveyor.model.linear), except an embedding the file does not reuse as its
    output head: read by rows only, it stays a view of the mapping. Every other tensor is
    dequantized to fp32 (a matrix of a "bfloat16" model then rounded to bf16 and packed as BF16
    panels: conveyor.model.linear.held_once). Each tensor's file pages are dropped once it is taken
    (a packed matrix's a run of rows at a time), so a load peaks near what the model holds."""
    gf = read_gguf(path)
    if "token_embd.weight" not in gf.tensors:
        raise ModelLoadError(f"GGUF file {gf.path} has no token_embd.weight")
    if "rope_freqs.weight" in gf.tensors:  # llama3-style per-frequency RoPE factors
        raise UnsupportedModelError(f"{gf.path}: GGUF rope_freqs (llama3 RoPE scaling) is not supported")
    tokenizer = Tokenizer.from_gguf(gf.metadata)
    config = gguf_config(gf, tokenizer)
    arch = gf.metadata["general.architecture"]
    # The metadata's arrays (a vocabulary, its merges, scores: tens of MiB of Python objects) are
    # built into the tokenizer now: freed before the weights load, they are not part of its peak.
    gf.metadata = {k: v for k, v in gf.metadata.items() if not isinstance(v, list)}
    weights: dict[str, WeightSource] = {}
    untied = "output.weight" in gf.tensors
    for t in gf.tensors.values():
        name = hf_name(t.name, arch)
        heads = _permuted_heads(t, arch, config)
        blocks = _blocks(gf, t) if keep_blocks and dtype == "float32" else None
        if blocks is not None and t.name == "token_embd.weight" and untied:
            weights[name] = blocks  # read by rows only: stays in the file's mapping (Embedding.load)
        else:
            taken = None
            if blocks is not None and heads is not None:  # a row is one output feature's blocks: permute rows alike
                blocks = QuantizedWeight(blocks.qtype, _unpermute(blocks.blocks, heads))
            elif blocks is not None:
                taken = rows_dropper(gf.buffer, t.offset, blocks.blocks.shape[1])
            # Packing is one large op a run of rows, worth every thread; dequantising is many small ones.
            packed = pack_blocks(blocks, taken) if blocks is not None else None
            if packed is not None:
                weights[name] = packed
            elif dtype == "float32" or len(t.shape) != 2:
                weights[name] = _dense(gf, t, config, heads)
            else:  # a matrix of a bf16 model, in its bf16 panels (its fp32 dequantization freed at once)
                plain, held = held_once(_dense(gf, t, config, heads), dtype)
                weights[name] = held if held is not None else QuantizedWeight.of_halves(plain, "BF16")  # type: ignore[arg-type]
        _release(gf, t)
    # Then the rest: the header (a 151,936-token vocabulary's strings and merges are ~10 MiB) and the
    # neighbours' pages the kernel mapped along with each tensor's (fault-around), ~60 KiB a tensor.
    drop_pages(gf.buffer, 0, len(gf.buffer))
    return config, weights, tokenizer


def _dense(gf: GGUFFile, t: GGUFTensor, config: ModelConfig, heads: int | None) -> np.ndarray:
    """The tensor in fp32 with HF's conventions: norms without llama.cpp's offset (as
    transformers' GGUF load keeps them), q/k rows in HF's RoPE order (`heads`: theirs, for llama)."""
    w = dequantize(gf, t)
    if config.norm_weight_offset and t.name.endswith("norm.weight"):
        w = w - config.norm_weight_offset
    return _unpermute(w, heads) if heads is not None else w


def _permuted_heads(t: GGUFTensor, arch: str, config: ModelConfig) -> int | None:
    if arch != "llama" or not (".attn_q." in t.name or ".attn_k." in t.name):
        return None
    return config.num_heads if ".attn_q." in t.name else config.num_kv_heads


def iter_dequantized(path: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor as an HF-named fp32 array, one at a time (export writes each as it comes)."""
    gf = read_gguf(path)
    config = gguf_config(gf, Tokenizer.from_gguf(gf.metadata))
    arch = gf.metadata["general.architecture"]
    for t in gf.tensors.values():
        yield hf_name(t.name, arch), _dense(gf, t, config, _permuted_heads(t, arch, config))
        _release(gf, t)
