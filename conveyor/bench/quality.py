"""`conveyor bench quality`: what the fast arithmetic costs in accuracy, as numbers.

The model reads a fixed text that needs no download (Python standard-library modules for code, the
standard library's own prose docstrings and the Python license for text), teacher-forced in windows,
once exactly (fp32 activations and an fp32 KV cache: the path whose greedy tokens equal
transformers') and once with the activation and KV cache dtypes under test (by default the
engine's: int8 and float16). Reported per text: perplexity of each, their ratio, and top-1
agreement (the share of positions whose argmax is the same in both). The tested path's greedy
tokens come from the exact vocabulary projection (LlamaModel.logits), as the engine's do; requests
that sample at a temperature get the projection in the tested dtype too, so the perplexity of
those logits is reported beside ("ppl sampled").
"""
from __future__ import annotations

import importlib.util
import inspect
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Fixed texts: modules of the installed standard library (their source for code; for prose, their
# docstrings and the license the interpreter ships).
CODE_MODULES = ("textwrap", "json.decoder", "heapq", "bisect", "fractions", "shlex")
PROSE_MODULES = ("argparse", "typing", "logging", "email.message", "asyncio.queues", "pathlib")


def code_text() -> str:
    return "\n\n".join(_source(m) for m in CODE_MODULES)


def prose_text() -> str:
    parts = []
    for name in PROSE_MODULES:
        module = importlib.import_module(name)
        for obj in [module, *vars(module).values()]:
            doc = inspect.getdoc(obj) if getattr(obj, "__module__", name) == name or obj is module else None
            if doc and len(doc) > 200 and doc not in parts:
                parts.append(doc)
    license_file = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "LICENSE.txt"
    if license_file.is_file():
        parts.append(license_file.read_text(encoding="utf-8", errors="replace"))
    return "\n\n".join(parts)


def _source(module: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"standard-library module {module} not found")
    return Path(spec.origin).read_text(encoding="utf-8")


@dataclass
class QualityResult:
    text: str
    tokens: int  # positions scored
    reference_ppl: float  # fp32 activations
    ppl: float  # the activation dtype under test
    top1_agreement: float
    sampled_ppl: float  # the same with the vocabulary projection in that dtype, as sampled rows take it

    @property
    def ppl_ratio(self) -> float:
        return self.ppl / self.reference_ppl

    @property
    def sampled_ppl_ratio(self) -> float:
        return self.sampled_ppl / self.reference_ppl


# (activation dtype, KV cache dtype): how a path computes.
Arithmetic = tuple[str, np.dtype]
EXACT: Arithmetic = ("float32", np.dtype(np.float32))
FLOAT16 = np.dtype(np.float16)  # the KV cache tested by default
_NLL_ROWS = 32  # rows whose exponentials are held at once


def target_nll(logits: np.ndarray, target: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] of each row, in float64 for the sums over positions. The
    log-sum-exp is taken in fp32 (max-shifted, summed pairwise: about 1e-7 relative, far inside the
    ratios reported), a few rows at a time; in float64 it would first copy the logits at twice their
    size (1 GiB for 512 rows of a 262k vocabulary) and take its exponentials at half the vector width."""
    rows = logits.astype(np.float32, copy=False)
    lse = np.empty(rows.shape[0], dtype=np.float64)
    for first in range(0, rows.shape[0], _NLL_ROWS):
        part = rows[first:first + _NLL_ROWS]
        top = part.max(axis=-1, keepdims=True)
        lse[first:first + _NLL_ROWS] = (np.log(np.exp(part - top).sum(axis=-1, dtype=np.float32)) + top[:, 0])
    return lse - rows[np.arange(len(target)), target].astype(np.float64)


def score(model: Any, ids: list[int], window: int, paths: tuple[Arithmetic, Arithmetic],
          prompt_tiles: bool = False) -> tuple[list[float], list[float], float, list[float]]:
    """Negative log-likelihoods of every next token on each path, the share of positions where
    their argmaxes agree, and the second path's negative log-likelihoods with its vocabulary
    projection in its own dtype (as a sampled row's). Windows of `window` tokens, each from an
    empty cache (a cache per path). `prompt_tiles`: the second path computes every position as a
    prompt token, on the bf16 tiles (EngineConfig.prompt_bf16_tiles)."""
    from conveyor.model.attention import AttentionMetadata, PrefillChunk
    from conveyor.runner.model_runner import allocate_kv_cache

    block_size = 16
    blocks = -(-window // block_size)
    caches = [allocate_kv_cache(model.cfg, blocks, block_size, kv_dtype) for _, kv_dtype in paths]
    table = np.arange(blocks, dtype=np.int64)
    nll: tuple[list[float], list[float]] = ([], [])
    sampled_nll: list[float] = []
    agree = total = 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        n = len(chunk) - 1
        if n < 2:
            break
        argmaxes = []
        for which, (dtype, _) in enumerate(paths):
            model.activation_dtype = dtype
            model.prompt_tiles = prompt_tiles and which == 1
            positions = np.arange(n, dtype=np.int64)
            meta = AttentionMetadata(positions, 0, None, None, [PrefillChunk(0, n, 0, table)], prompt_rows=((0, n),))
            h = model.sampling_hidden(np.array(chunk[:n], dtype=np.int64), positions, meta, caches[which], positions)
            target = np.array(chunk[1:], dtype=np.int64)
            logits = model.logits(h)
            nll[which].extend(target_nll(logits, target).tolist())
            argmaxes.append(logits.argmax(axis=-1))
            del logits
            if which == 1:
                sampled = model.logits(h, np.ones(n, dtype=np.bool_))
                sampled_nll.extend(target_nll(sampled, target).tolist())
        agree += int((argmaxes[0] == argmaxes[1]).sum())
        total += n
    return nll[0], nll[1], agree / max(1, total), sampled_nll


def run_quality(model: Any, tokenizer: object, activation_dtype: str, max_tokens: int,
                window: int, kv_cache_dtype: np.dtype = FLOAT16,
                prompt_tiles: bool = False) -> list[QualityResult]:
    results = []
    saved = getattr(model, "activation_dtype", "float32"), getattr(model, "prompt_tiles", False)
    try:
        for name, text in (("code (stdlib source)", code_text()), ("prose (stdlib docs, license)", prose_text())):
            ids = tokenizer.encode(text)[:max_tokens]  # type: ignore[attr-defined]
            ref, test, agreement, sampled = score(model, ids, window, (EXACT, (activation_dtype, kv_cache_dtype)),
                                                  prompt_tiles)
            results.append(QualityResult(name, len(ref), math.exp(sum(ref) / len(ref)), math.exp(sum(test) / len(test)),
                                         agreement, math.exp(sum(sampled) / len(sampled))))
    finally:
        model.activation_dtype, model.prompt_tiles = saved
    return results


def half_weights_in_bf16(model: Any, activation_dtype: str) -> bool:
    """Whether some of the model's products take 16-bit float weights (BF16, F16) times bf16
    activations (the default activations on a CPU with AVX512-BF16), which the report then names
    beside "int8"."""
    from conveyor.model.linear import PackedWeight, bf16_dot_available
    from conveyor.model.quantized import HALF_TYPES

    def layouts(packed: PackedWeight) -> set[str]:
        return {p.layout for p in packed.parts} if packed.parts else {packed.layout}

    held = [getattr(m, "packed", None) for m in model.modules()]
    return (activation_dtype == "int8" and bf16_dot_available()
            and any(p is not None and not layouts(p).isdisjoint(HALF_TYPES) for p in held))


def report(model_name: str, activation_dtype: str, results: list[QualityResult],
           kv_cache_dtype: np.dtype = FLOAT16, prompt_tiles: bool = False, half_weights: bool = False) -> str:
    """`half_weights`: 16-bit float weights took bf16 activations (`half_weights_in_bf16`)."""
    kv = np.dtype(kv_cache_dtype).name
    tiles = " (every position on the prompt's bf16 tiles)" if prompt_tiles else ""
    tiles += " (bf16 on the 16-bit float weights)" if half_weights else ""
    lines = [f"{model_name}: {activation_dtype} activations{tiles}, {kv} KV cache, against fp32 with an fp32 KV "
             "cache (teacher-forced)",
             f"{'text':<30} {'tokens':>7} {'ppl fp32':>9} {'ppl tested':>10} {'ratio':>7} {'top-1 agree':>11} "
             f"{'ppl sampled':>11} {'ratio':>7}"]
    for r in results:
        lines.append(f"{r.text:<30} {r.tokens:>7} {r.reference_ppl:>9.4f} {r.ppl:>10.4f} {r.ppl_ratio:>7.4f} "
                     f"{r.top1_agreement:>11.4f} {r.sampled_ppl:>11.4f} {r.sampled_ppl_ratio:>7.4f}")
    return "\n".join(lines)
