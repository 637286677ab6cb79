"""Scheduling policies over Request state (pure Python, no torch)."""
from conveyor.config import SchedulerConfig
from conveyor.kv.manager import KVCacheManager
from conveyor.scheduler.base import Scheduler, SchedulerOutput
from conveyor.scheduler.continuous import ContinuousScheduler
from conveyor.scheduler.static import StaticScheduler

POLICIES: dict[str, type[Scheduler]] = {"continuous": ContinuousScheduler, "static": StaticScheduler}


def make_scheduler(config: SchedulerConfig, kv: KVCacheManager) -> Scheduler:
    return POLICIES[config.policy](config, kv)


__all__ = ["ContinuousScheduler", "POLICIES", "Scheduler", "SchedulerOutput", "StaticScheduler", "make_scheduler"]
