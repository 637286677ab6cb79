"""The sampling a model's own files recommend, which a request that leaves a field out gets (vLLM's
`--generation-config auto`, SGLang's model sampling defaults, llama.cpp's GGUF sampling keys).

An HF folder says it in generation_config.json, in transformers' names; vLLM reads temperature,
top_k, top_p, min_p, repetition_penalty and max_new_tokens from it, and only where they differ from
transformers' own defaults (a file that writes `"top_k": 50` repeats transformers' default, it does
not recommend 50). A GGUF file says it in llama.cpp's `general.sampling.*` keys (written from the
same generation_config.json by llama.cpp's converter). Values come back under SamplingParams'
names; whether they are valid for a request is checked where they are applied
(conveyor.sampling.params.model_defaults).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from conveyor.errors import ConfigError

log = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"
GENERATION_CONFIG_CHOICES = ("auto", "vllm")  # or a folder (EngineConfig.generation_config)
# generation_config.json field -> SamplingParams field (vLLM's list).
_HF_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
              "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# transformers' GenerationConfig defaults: a file holding one of these recommends nothing by it.
_HF_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}
# llama.cpp's GGUF keys -> SamplingParams field. Its repetition penalty (`penalty_repeat`) counts the
# last `penalty_last_n` tokens only (64 by default), where conveyor's (vLLM's) counts the prompt and
# the whole output: not the same setting, so it is reported, not applied.
_GGUF_FIELDS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p"}
_GGUF_PREFIX = "general.sampling."

Recommended = dict[str, float | int]


def _number(value: Any) -> float | int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


def from_generation_config(data: Mapping[str, Any], source: str = GENERATION_CONFIG) -> Recommended:
    """The recommended sampling in a generation_config.json's fields."""
    out: Recommended = {}
    for name, field in _HF_FIELDS.items():
        if name not in data or data[name] is None:
            continue
        value = _number(data[name])
        if value is None:
            log.warning("%s: %s is %r, not a number: not applied", source, name, data[name])
        elif name not in _HF_DEFAULTS or value != _HF_DEFAULTS[name]:
            out[field] = value
    return out


def from_gguf_metadata(meta: Mapping[str, Any]) -> Recommended:
    """The recommended sampling in a GGUF file's `general.sampling.*` keys."""
    out: Recommended = {}
    for key in sorted(k for k in meta if k.startswith(_GGUF_PREFIX)):
        field = _GGUF_FIELDS.get(key)
        value = _number(meta[key])
        if field is None:
            log.info("the GGUF recommends %s = %r, which conveyor has no setting for: not applied", key, meta[key])
        elif value is None:
            log.warning("the GGUF's %s is %r, not a number: not applied", key, meta[key])
        else:
            out[field] = value
    return out


def read_generation_config(folder: str | Path) -> Recommended:
    """A folder's generation_config.json (`--generation-config FOLDER`); none there: nothing."""
    path = Path(folder) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return from_generation_config(data, str(path))


def recommended_sampling(choice: str, model_recommends: Mapping[str, float | int]) -> Recommended:
    """What requests that leave a sampling field out get, by `EngineConfig.generation_config`:
    "auto" the model's own recommendation (`model_recommends`, read with its tokenizer), "vllm"
    nothing (OpenAI's and vLLM's defaults), or a folder's generation_config.json."""
    if choice == "auto":
        return dict(model_recommends)
    if choice == "vllm":
        return {}
    return read_generation_config(choice)  # a folder EngineConfig found holding one
