"""Command-line options derived from the config dataclasses, so that a default (and a new knob)
lives in one place: the dataclass field. `--max-num-seqs` is `SchedulerConfig.max_num_seqs`."""
from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from decimal import Decimal
from typing import Any, Callable, Iterable

from conveyor.config import (ACTIVATION_DTYPES, DTYPES, KV_CACHE_DTYPES, POLICIES, SCHEDULING_POLICIES, SIZE_LETTERS,
                             VLLM_INSTEAD, VLLM_TAKEN, EngineConfig, SchedulerConfig)
from conveyor.sampling.pooling import POOLING_TYPES

HELP = {
    "model": "smollm2-135m (default), gemma3-270m, qwen2.5-coder-0.5b, a .gguf file or an HF folder",
    "dequantize_weights": "dense fp32 weights even where the GGUF has blocks the matmul kernel reads (same results, slower)",
    "activation_dtype": "int8 (default): products on GGUF blocks quantize activations to int8 and multiply in "
                        "integers, as llama.cpp does, and on a CPU with AVX512-BF16 products on 16-bit float "
                        "(BF16, F16) weights round them (and F16 weights) to bf16; float32: exact fp32 "
                        "activations (results equal to dequantize-then-multiply, as the reference tests need)",
    "prompt_bf16_tiles": "with int8 activations on a CPU with AMX-BF16: a prompt's tokens on bf16 tiles (faster "
                         "prefill), generated tokens on the int8 kernel (default: on; no effect elsewhere)",
    "kv_cache_dtype": "what the KV cache stores: auto (default: float16, as llama.cpp's cache; for a bf16 "
                      "model too, whose activations are fp32), float16, or float32 (exact: the reference tests)",
    "block_size": "tokens per KV block",
    "speculative_config": 'speculative decoding, as a JSON object: {"method": "ngram", '
                          '"num_speculative_tokens": 24, "prompt_lookup_max": 12, "prompt_lookup_min": 3, '
                          '"adaptive": true} (fields optional; off by default)',
    "generation_config": "what a request that leaves a sampling field out (temperature, top_p, top_k, min_p, "
                         "repetition_penalty, max_tokens) gets: auto, the model's recommendation "
                         "(generation_config.json, a GGUF's general.sampling.* keys), where it has one; vllm, "
                         "OpenAI's and vLLM's defaults; or a folder holding a generation_config.json",
    "pooling_type": "how /v1/embeddings pools a prompt's final hidden states: last (the last token's), mean, "
                    "or cls (the first token's); default: what the model file says (a GGUF's pooling_type), "
                    "else last, as vLLM pools a decoder model",
    "enable_prefix_caching": "share the KV of full blocks across requests with the same prefix",
    "kv_cache_memory": "KV cache size, e.g. 1GiB or 512MiB",
    "num_kv_blocks": "KV blocks (overrides --kv-cache-memory)",
    "window_kv_pool": "sliding-window layers (Gemma 3's local ones) keep only the KV their window sees, in a "
                      "pool of their own, and the rest of the KV memory holds more context (default: on)",
    "max_model_len": "longest request, prompt plus output (default: the model's context length, at most what "
                     "the KV cache holds)",
    "num_threads": "threads a step computes on (the kernels' OpenMP threads and numpy's BLAS; default: one per "
                   "core; 1 is faster when other processes share the cores)",
    "scheduling_policy": "order of the waiting queue and of preemption: fcfs, or priority (requests' "
                         "`priority`, lowest first, then arrival)",
    "max_num_seqs": "most requests in the running batch",
    "max_num_batched_tokens": "token budget of one step",
    "slo_tpot_ms": "hold P99 TPOT under this: a controller lowers the batch cap and token budget "
                   "under --max-num-seqs / --max-num-batched-tokens as load requires",
    "slo_ttft_ms": "TTFT target: misses are counted in /metrics (conveyor:slo_ttft_misses_total)",
}
# "auto" is vLLM's spelling of the default dtype (EngineConfig.from_kwargs takes it).
CHOICES: dict[str, tuple[str, ...]] = {"policy": POLICIES, "dtype": ("auto", *DTYPES), "scheduling_policy": SCHEDULING_POLICIES,
                                       "activation_dtype": ACTIVATION_DTYPES, "kv_cache_dtype": KV_CACHE_DTYPES,
                                       "pooling_type": POOLING_TYPES}


def token_count(text: str) -> int:
    """A number of tokens as vLLM's --max-model-len takes it: 4096, 4k (4,000) or 4K (4,096), m/M, g/G."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG]?)", text.strip())
    value = Decimal(match.group(1)) * SIZE_LETTERS.get(match.group(2), 1) if match else None
    if value is None or value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"a whole number of tokens (4096, 4k, 4K), got {text!r}")
    return int(value)


token_count.__name__ = "tokens"  # argparse names a type in its errors ("invalid tokens value")
# Fields whose flag reads more than the field's type does.
TYPES: dict[str, Callable[[str], Any]] = {"max_model_len": token_count}


def _scalar_type(annotation: Any) -> type:
    """int | None -> int; str | int (a memory size) -> str; bool stays bool."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return str if str in args else args[0]
    return annotation


def config_fields(config_cls: type) -> list[dataclasses.Field]:
    """The fields a user sets (nested config dataclasses have their own options)."""
    hints = typing.get_type_hints(config_cls)
    return [f for f in dataclasses.fields(config_cls)
            if not (isinstance(hints[f.name], type) and dataclasses.is_dataclass(hints[f.name]))]


def add_config_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, config_cls: type, *,
                    only: Iterable[str] | None = None, defaults: dict[str, Any] | None = None,
                    helps: dict[str, str] | None = None) -> None:
    """One `--field-name` option per field of `config_cls` (or of `only`), its default the field's
    unless `defaults` overrides it for this command."""
    hints = typing.get_type_hints(config_cls)
    wanted = None if only is None else set(only)
    for f in config_fields(config_cls):
        if wanted is not None and f.name not in wanted:
            continue
        default = (defaults or {}).get(f.name, f.default)
        kind = _scalar_type(hints[f.name])
        help_text = (helps or {}).get(f.name) or HELP.get(f.name) or ""
        if default is not None and "(default" not in help_text:  # where the text says it, in words
            help_text += f" (default: {default})" if help_text else f"default: {default}"
        flag = "--" + f.name.replace("_", "-")
        if dataclasses.is_dataclass(kind):  # a nested config given as a JSON object, as vLLM's
            parser.add_argument(flag, type=_parsed_by(kind.parse), default=default, metavar="JSON",  # type: ignore[attr-defined]
                                help=help_text)
        elif kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            parser.add_argument(flag, type=TYPES.get(f.name, kind), default=default, choices=CHOICES.get(f.name),
                                help=help_text)


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least `minimum`."""
    def parsed(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parsed.__name__ = "int"
    return parsed


def _parsed_by(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` as an argparse type whose errors reach the user: argparse replaces a ValueError's
    message with "invalid value", but prints an ArgumentTypeError's."""
    def parsed(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e

    parsed.__name__ = getattr(parse, "__name__", "parse")
    return parsed


def config_kwargs(args: argparse.Namespace, *config_classes: type) -> dict[str, Any]:
    """The parsed values of every field of `config_classes` the parser has."""
    return {f.name: getattr(args, f.name)
            for cls in config_classes for f in config_fields(cls) if hasattr(args, f.name)}


_VLLM_PREFIX = "vllm_"


def add_vllm_engine_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's engine flags, so that a vLLM command line is served where they say what conveyor does
    anyway (`--tensor-parallel-size 1`, `--trust-remote-code`, `--enforce-eager`,
    `--enable-chunked-prefill`) and told what does their work here where not (config.VLLM_INSTEAD),
    instead of argparse's bare "unrecognized arguments". Left out of --help."""
    kinds: dict[str, Callable[[str], Any]] = {"gpu_memory_utilization": float, "tensor_parallel_size": int,
                                               "tokenizer": str, "runner": str}
    for name in (*VLLM_INSTEAD, *VLLM_TAKEN):
        flag, dest = "--" + name.replace("_", "-"), _VLLM_PREFIX + name
        if name == "enable_chunked_prefill":  # another spelling of --[no-]chunked-prefill: one value, last wins
            parser.add_argument(flag, dest="chunked_prefill", action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        elif name == "kv_cache_memory_bytes":  # another spelling of --kv-cache-memory (2G, 2g, 2GiB, bytes)
            parser.add_argument(flag, dest="kv_cache_memory", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        elif name in kinds:
            parser.add_argument(flag, dest=dest, type=kinds[name], default=None, help=argparse.SUPPRESS)
        else:  # vLLM's on/off flags
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                                help=argparse.SUPPRESS)


def vllm_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The vLLM flags given (add_vllm_engine_args), as EngineConfig.from_kwargs takes them."""
    return {name.removeprefix(_VLLM_PREFIX): value for name, value in vars(args).items()
            if name.startswith(_VLLM_PREFIX) and value is not None}


def as_flags(text: str) -> str:
    """A config message for the command line: the config fields it names spelled as their flags."""
    fields = {f.name for cls in (EngineConfig, SchedulerConfig) for f in dataclasses.fields(cls)}
    fields |= {*VLLM_INSTEAD, *VLLM_TAKEN}
    one_word = {name for name in VLLM_INSTEAD if "_" not in name}  # "tokenizer": a word elsewhere too

    def flag(match: re.Match[str]) -> str:
        name = match.group(0)
        return "--" + name.replace("_", "-") if name in fields else name

    # A name with an underscore, not inside a path or a dotted name (speculative_config.model); a
    # one-word vLLM option only quoted in a list or as a hint's head ("tokenizer: ...").
    text = re.sub(r"(?<=')[a-z]+(?=')|(?<![\w./-])[a-z]+(?=: )",
                  lambda m: flag(m) if m.group(0) in one_word else m.group(0), text)
    return re.sub(r"(?<![\w./-])[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?![\w/]|\.\w)", flag, text)
