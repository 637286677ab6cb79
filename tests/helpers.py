"""Test helpers shared across test packages: tiny random HF checkpoints and the HF reference tokenizer.

torch is imported only where transformers needs it (making a checkpoint, the references), never by
conveyor's own code."""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

SMOLLM_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_VOCAB = 49152  # the SmolLM2 vocabulary, so the copied tokenizer fits the tiny model

_TINY_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    # head_dim != hidden/heads on purpose: Qwen3 checkpoints decouple the two.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    # A window of 8 so short prompts cross it; a scale and a logit cap that differ from the defaults.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"head_dim": 32, "sliding_window": 8, "query_pre_attn_scalar": 24, "final_logit_softcapping": 30.0}),
}


def smollm_gguf_folder() -> Path:
    from conveyor.model.loader import resolve_model_path

    return resolve_model_path(None).parent


_gguf_readers: dict[tuple[str, int, int], Any] = {}


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within it, transformers' GGUF loads share one parse per file. A tokenizer and a model from
    one GGUF parse it three times (config, vocabulary, tensors), each walking the metadata element
    by element in Python: ~20 s a parse for Gemma 3's 262,144-token vocabulary. The parse is
    read-only (a memory map), so sharing it changes nothing transformers computes."""
    import gguf

    plain = gguf.GGUFReader

    def shared(path: Any, mode: str = "r") -> Any:
        stat = Path(path).stat()
        key = (str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)
        if mode != "r":
            return plain(path, mode)
        if key not in _gguf_readers:
            _gguf_readers[key] = plain(path, mode)
        return _gguf_readers[key]

    gguf.GGUFReader = shared  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        gguf.GGUFReader = plain  # type: ignore[misc]


@lru_cache(maxsize=1)
def hf_gguf_tokenizer() -> Any:
    """transformers' tokenizer for the shipped GGUF (slow to build: cached per process)."""
    from transformers import AutoTokenizer

    with gguf_parsed_once():
        return AutoTokenizer.from_pretrained(smollm_gguf_folder(), gguf_file=SMOLLM_GGUF_NAME)


@lru_cache(maxsize=1)
def _tokenizer_files() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="conveyor-tok-"))
    hf_gguf_tokenizer().save_pretrained(folder)
    return folder


def make_tiny_hf_checkpoint(
    tmp_path: Path,
    arch: str = "llama",
    *,
    tie_word_embeddings: bool = False,
    num_layers: int = 2,
    seed: int = 0,
    **config_overrides: Any,
) -> Path:
    """Write a small random-weight HF checkpoint (config, safetensors, tokenizer) and return its folder.

    Vocab is SmolLM2's (49152) and the tokenizer files are transformers' save of the GGUF tokenizer,
    so prompts encode to ids the tiny model accepts.
    """
    import torch
    import transformers

    cfg_name, model_name, extra = _TINY_ARCHS[arch]
    kwargs = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6,
    )
    kwargs.update(extra)
    kwargs.update(config_overrides)
    config = getattr(transformers, cfg_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # HF zero-inits biases and ones-inits norms; randomise so loading errors show
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    folder = Path(tmp_path) / f"tiny-{arch}"
    model.save_pretrained(folder)
    for f in _tokenizer_files().iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def tiny_reference_state_dict(folder: Path) -> dict[str, np.ndarray]:
    """What transformers itself loads from `folder`, as a plain state dict of fp32 numpy arrays."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


# llama.cpp's tensor names (convert_hf_to_gguf) -> HF's
GGUF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
GGUF_BLOCK = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
              "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def quantize_k(values: Any, qtype: str) -> Any:
    """Rows of fp32 values (a multiple of 256 each) as valid Q2_K or Q3_K blocks (gguf-py has no
    quantiser for them): scales from each 16-value group's range, codes rounded. Not llama.cpp's
    search for the best scales, only blocks whose dequantised values are near the inputs."""

    rows = values.shape[0]
    x = values.reshape(-1, 16, 16).astype(np.float32)  # superblocks of 16 groups of 16
    j = np.arange(256)
    half, r = j // 128, j % 128
    code_byte, code_shift = half * 32 + r % 32, (r // 32 * 2).astype(np.uint8)  # where value j's 2 low code bits go
    if qtype == "Q2_K":  # w = d * sc * q - dmin * m, q in 0..3, sc and m in 0..15
        low = np.minimum(x.min(axis=2), 0)
        scale, mins = (x.max(axis=2) - low) / 3, -low
        d = (scale.max(axis=1, keepdims=True) / 15).astype(np.float16)
        dmin = (mins.max(axis=1, keepdims=True) / 15).astype(np.float16)
        sc = np.clip(np.round(scale / np.maximum(d.astype(np.float32), 1e-30)), 0, 15).astype(np.uint8)
        m = np.clip(np.round(mins / np.maximum(dmin.astype(np.float32), 1e-30)), 0, 15).astype(np.uint8)
        step = np.maximum(d.astype(np.float32) * sc, 1e-30)[:, :, None]
        q = np.clip(np.round((x + (dmin.astype(np.float32) * m)[:, :, None]) / step), 0, 3).astype(np.uint8).reshape(-1, 256)
        qs = np.zeros((q.shape[0], 64), dtype=np.uint8)
        for k in range(256):
            qs[:, code_byte[k]] |= q[:, k] << code_shift[k]
        blocks = np.concatenate([sc | m << 4, qs, d.view(np.uint8), dmin.view(np.uint8)], axis=1)
    else:  # Q3_K: w = d * (s - 32) * (u - 4), u in 0..7, s a 6-bit scale
        scale = np.abs(x).max(axis=2) / 4
        d = (scale.max(axis=1, keepdims=True) / 31).astype(np.float16)
        sc = np.clip(np.round(scale / np.maximum(d.astype(np.float32), 1e-30)), 0, 31)
        step = np.maximum(d.astype(np.float32) * sc, 1e-30)[:, :, None]
        u = np.clip(np.round(x / step) + 4, 0, 7).astype(np.uint8).reshape(-1, 256)
        stored = (sc + 32).astype(np.uint8)
        scales = np.zeros((u.shape[0], 12), dtype=np.uint8)
        for i in range(16):
            scales[:, i % 8] |= (stored[:, i] & 0xF) << np.uint8(4 * (i // 8))
            scales[:, 8 + i % 4] |= (stored[:, i] >> 4) << np.uint8(2 * (i // 4))
        qs, hmask = np.zeros((u.shape[0], 64), dtype=np.uint8), np.zeros((u.shape[0], 32), dtype=np.uint8)
        for k in range(256):
            qs[:, code_byte[k]] |= (u[:, k] & 3) << code_shift[k]
            hmask[:, k % 32] |= (u[:, k] >> 2) << np.uint8(k // 32)
        blocks = np.concatenate([hmask, qs, scales, d.view(np.uint8)], axis=1)
    return blocks.reshape(rows, -1)


def write_gguf_from_hf(path: Path, arch: str, hf_folder: Path, smollm_gguf_path: Path,
                       matrices: str | Callable[[str, tuple[int, ...]], str] = "F32",
                       more_keys: dict[str, int] | None = None, add_eos_token: bool = False) -> None:
    """A GGUF as llama.cpp's convert_hf_to_gguf would write an HF checkpoint with SmolLM2's vocabulary
    (a tiny random one, or SmolLM2 exported): vectors in F32, matrices in `matrices` (a GGML type
    name, or one per tensor from its GGUF name and shape), Q2_K and Q3_K by quantize_k. `more_keys`:
    further `{arch}.KEY` integers (an embedding model's pooling_type); `add_eos_token`: the file asks
    for EOS after every text, as an embedding model's does."""
    import json

    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize
    from safetensors.torch import load_file

    from conveyor.model.gguf_loader import read_gguf

    cfg = json.loads((hf_folder / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    meta = read_gguf(smollm_gguf_path).metadata
    w = GGUFWriter(str(path), arch)
    for k, v in {"block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
                 "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
                 "attention.head_count": heads, "attention.head_count_kv": kv_heads,
                 "attention.key_length": cfg.get("head_dim") or cfg["hidden_size"] // heads, **(more_keys or {})}.items():
        w.add_uint32(f"{arch}.{k}", v)
    w.add_float32(f"{arch}.rope.freq_base", cfg.get("rope_parameters", {}).get("rope_theta") or cfg["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_eos_token_id(2)
    if add_eos_token:
        w.add_add_eos_token(True)
    names = {v: k for k, v in {**GGUF_GLOBAL, **GGUF_BLOCK}.items()}
    for name, t in load_file(str(hf_folder / "model.safetensors")).items():
        if cfg["tie_word_embeddings"] and name == "lm_head.weight":
            continue
        parts = name.split(".")
        if parts[1] == "layers":
            gname = f"blk.{parts[2]}.{names['.'.join(parts[3:-1])]}.{parts[-1]}"
        else:
            gname = names[name]
        a = t.float().numpy()
        if arch == "llama" and (".attn_q." in gname or ".attn_k." in gname):  # llama.cpp's `permute`
            n = heads if ".attn_q." in gname else kv_heads
            a = a.reshape(n, 2, a.shape[0] // n // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        name_of_type = "F32" if a.ndim != 2 else matrices if isinstance(matrices, str) else matrices(gname, a.shape)
        qtype = GGMLQuantizationType[name_of_type]
        a = np.ascontiguousarray(a)
        w.add_tensor(gname, quantize_k(a, name_of_type) if name_of_type in ("Q2_K", "Q3_K") else quantize(a, qtype),
                     raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def load_in_fresh_process(model: str, hold: str = "loaded", prelude: str = "", then: str = "") -> dict[str, Any]:
    """Loads `model` with load_model in a fresh Python process, so VmHWM is that load's alone, and
    returns VmRSS and VmHWM (KiB) while `hold` (an expression of `loaded`, the LoadedModel) is held,
    plus whatever `then` (run after, with `held` and the dict `s`) puts into `s`. `prelude`: code run
    first (helpers for `then`)."""
    import json
    import subprocess
    import sys

    script = (
        "import json, gc; from conveyor.config import EngineConfig; from conveyor.runner.model_runner import load_model\n"
        f"{prelude}\n"
        f"loaded = load_model(EngineConfig(model={model!r})); held = {hold}; del loaded; gc.collect()\n"
        "s = {l.split(':')[0]: int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(('VmRSS', 'VmHWM'))}\n"
        f"{then}\n"
        "print(json.dumps(s))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))
