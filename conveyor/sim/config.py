"""A simulated run's configuration and result, and what every simulated deployment builds from
it: the cost model, the KV pool size, the policy's label."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from conveyor.bench.results import RunResult
from conveyor.bench.workloads import WorkloadConfig
from conveyor.config import EngineConfig, parse_memory
from conveyor.errors import ConfigError
from conveyor.kv import SlidingWindow, split_kv_memory
from conveyor.sim.hardware import HardwareSpec, get_hardware
from conveyor.sim.models import ModelSpec, get_model
from conveyor.sim.profiled import DEFAULT_PROFILE, ProfiledCostModel
from conveyor.sim.roofline import RooflineCostModel
from conveyor.sim.runner import CostModel


@dataclass
class SimConfig:
    hardware: str = "h100"
    model: str = "llama-3-8b"
    dtype: str | None = None  # None: the model description's
    tp: int = 1
    cost_model: str = "roofline"  # or "profiled"
    profile: str = DEFAULT_PROFILE
    roofline_json: str | None = None  # for hardware this-machine
    efficiency: float | None = None  # scales the hardware's peaks (roofline)
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: str | None = None  # total KV pool; default: device memory x utilization - weights
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    request_rate: float = math.inf
    burstiness: float = 1.0
    rate_schedule: str | None = None  # e.g. "0:1,120:4,240:1" (bench/workloads.py); overrides request_rate
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig.from_kwargs options
    percentiles: list[float] = field(default_factory=lambda: [99.0])
    goodput: dict[str, float] = field(default_factory=dict)
    # Deployment (conveyor/sim/disagg.py): prefill/decode workers (0 = colocated), colocated replicas,
    # and the handover link in bytes/s per device (None: the hardware description's).
    prefill_workers: int = 0
    decode_workers: int = 0
    replicas: int = 1
    kv_transfer_bandwidth: float | None = None
    # With engine["speculative_config"]: the chance each proposed token is accepted, given that the
    # ones before it were (a workload's; the measured ones are in docs/BENCHMARKS.md)
    spec_acceptance: float = 0.7

    def __post_init__(self) -> None:
        if not 0.0 <= self.spec_acceptance <= 1.0:
            raise ConfigError(f"spec_acceptance must be in [0, 1], got {self.spec_acceptance}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_transfer_bandwidth is not None and not 0 < self.kv_transfer_bandwidth < math.inf:
            raise ConfigError(f"kv_transfer_bandwidth must be a positive number of bytes/s, got {self.kv_transfer_bandwidth}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")


# The simulator tracks every block of the pool in Python: past this many it would take the host's
# memory (a pool of billions of blocks is a typing error, not a deployment).
MAX_SIM_BLOCKS = 10**7


def max_model_len(cfg: SimConfig, model: ModelSpec) -> int:
    """--max-model-len, at most the model's context length (as vLLM refuses a longer one)."""
    if cfg.max_model_len is not None and cfg.max_model_len > model.max_model_len:
        raise ConfigError(f"--max-model-len {cfg.max_model_len} is over {model.name}'s context length "
                          f"{model.max_model_len}")
    return cfg.max_model_len or model.max_model_len


@dataclass
class SimRun:
    result: RunResult  # what `bench compare` produces for one (policy, rate)
    wall_s: float  # host seconds the simulation took
    num_steps: int
    num_kv_blocks: int
    cost_model: str
    workers: list[Any] = field(default_factory=list)  # disagg.Lane per engine of a multi-engine deployment
    kv_window: SlidingWindow | None = None  # the sliding-window layers' own pool (kv_pools)


def build_cost_model(cfg: SimConfig) -> tuple[CostModel, ModelSpec, HardwareSpec | None]:
    model = get_model(cfg.model, cfg.dtype)
    if cfg.cost_model == "profiled":
        return ProfiledCostModel.load(cfg.profile), model, None
    if cfg.cost_model != "roofline":
        raise ConfigError(f"unknown cost model {cfg.cost_model!r}; choose roofline or profiled")
    hardware = get_hardware(cfg.hardware, cfg.roofline_json, cfg.efficiency)
    return RooflineCostModel(model, hardware, cfg.tp), model, hardware


def kv_pools(cfg: SimConfig, model: ModelSpec, hardware: HardwareSpec | None,
             engine_config: EngineConfig) -> tuple[int, SlidingWindow | None]:
    """(blocks of the main pool, the sliding-window layers' pool or None), as the engine splits its
    KV memory (conveyor.kv.split_kv_memory) when the model has both kinds of layers and
    window_kv_pool is on. The memory: explicit blocks, else an explicit pool size, else (roofline)
    what the devices hold after the weights, as vLLM's gpu_memory_utilization: device memory x
    utilization, minus weights, over tp devices; the profiled model describes conveyor's engine on
    this machine: its default pool."""
    block_size = engine_config.block_size
    block_bytes = block_size * model.kv_bytes_per_token
    if cfg.kv_cache_memory is not None:
        pool = parse_memory(cfg.kv_cache_memory)
        if hardware is not None and pool > cfg.tp * hardware.memory_bytes - model.weight_bytes:
            raise ConfigError(f"--kv-cache-memory {cfg.kv_cache_memory} is more than {cfg.tp} x {hardware.name} hold "
                              f"beside {model.name}'s {model.weight_bytes / 1e9:.1f} GB of weights")
    elif cfg.num_kv_blocks or cfg.cost_model == "profiled":  # the profile describes conveyor's engine here
        pool = parse_memory(EngineConfig().kv_cache_memory)
    else:
        if hardware is None:
            hardware = get_hardware(cfg.hardware, cfg.roofline_json)
        pool = int(cfg.tp * hardware.memory_bytes * cfg.gpu_memory_utilization - model.weight_bytes)
        if pool < block_bytes:
            raise ConfigError(
                f"{model.name} ({model.weight_bytes / 1e9:.1f} GB of {model.dtype} weights) leaves no KV memory on "
                f"{cfg.tp} x {hardware.name} ({hardware.memory_bytes / 1e9:.0f} GB each at utilization "
                f"{cfg.gpu_memory_utilization}); raise --tp"
            )
    if model.sliding_window is not None and model.num_window_layers < model.num_layers and engine_config.window_kv_pool:
        window_bytes = block_size * model.window_kv_bytes_per_token
        sched = engine_config.scheduler
        blocks, window = split_kv_memory(model.sliding_window, block_size, sched.max_num_seqs,
                                         sched.max_num_batched_tokens, block_bytes - window_bytes, window_bytes, pool,
                                         cfg.num_kv_blocks)
    else:
        blocks, window = cfg.num_kv_blocks or pool // block_bytes, None
    if blocks < 1:
        also = " and the sliding-window pool's (never written) first block" if model.sliding_window else ""
        raise ConfigError(f"KV memory {pool} bytes holds less than one block of {block_bytes} bytes{also}")
    if blocks > MAX_SIM_BLOCKS:
        raise ConfigError(f"a KV pool of {blocks:,} blocks is more than the simulator tracks ({MAX_SIM_BLOCKS:,}): "
                          "lower --num-kv-blocks / --kv-cache-memory / --tp, or raise --block-size")
    return int(blocks), window


def policy_label(engine_config: EngineConfig) -> str:
    sched = engine_config.scheduler
    if sched.policy == "static":
        return "static"
    return "continuous" if sched.chunked_prefill else "continuous-naive"
