"""Scheduling policies over Request state (pure Python, no torch). A scheduler owns its KV manager."""
from conveyor.config import EngineConfig, SchedulerConfig
from conveyor.kv.manager import KVCacheManager, SlidingWindow
from conveyor.scheduler.base import Scheduler, SchedulerOutput
from conveyor.scheduler.continuous import ContinuousScheduler
from conveyor.scheduler.static import StaticScheduler

POLICIES: dict[str, type[Scheduler]] = {"continuous": ContinuousScheduler, "static": StaticScheduler}


def make_scheduler(config: SchedulerConfig, kv: KVCacheManager) -> Scheduler:
    return POLICIES[config.policy](config, kv)


def build_scheduler(config: EngineConfig, num_kv_blocks: int, generated_apart: bool = False,
                    sliding_window: SlidingWindow | None = None) -> Scheduler:
    """An engine's scheduler with its KV manager of num_kv_blocks blocks. `generated_apart`: the
    runner computes prompt tokens and generated ones differently (its prompt_rows_apart);
    `sliding_window`: the pool of the model's sliding-window layers (the runner's kv_window)."""
    # Keys chain from the model's identity: a key never matches KV another model computed.
    kv = KVCacheManager(num_kv_blocks, config.block_size, config.enable_prefix_caching,
                        model_identity=f"{config.model}|{config.dtype}", generated_apart=generated_apart,
                        sliding_window=sliding_window)
    return make_scheduler(config.scheduler, kv)


__all__ = ["ContinuousScheduler", "POLICIES", "Scheduler", "SchedulerOutput", "StaticScheduler", "build_scheduler",
           "make_scheduler"]
