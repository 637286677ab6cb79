"""`bench compare`'s continuous-slo policy: it passes the target to the engine, and needs one."""
from __future__ import annotations

import pytest

from conveyor.bench.compare import CompareConfig, engine_kwargs
from conveyor.bench.workloads import BenchRequest
from conveyor.config import EngineConfig


def test_continuous_slo_sets_the_target_on_top_of_continuous():
    cfg = CompareConfig(policies=["continuous", "continuous-slo"], slo_tpot_ms=250.0)
    requests = [BenchRequest([11] * 8, 4)]
    slo, plain = engine_kwargs(cfg, "continuous-slo", requests), engine_kwargs(cfg, "continuous", requests)
    assert slo == {**plain, "slo_tpot_ms": 250.0}
    assert EngineConfig.from_kwargs(**slo).scheduler.slo_tpot_ms == 250.0


def test_continuous_slo_needs_a_target():
    with pytest.raises(ValueError, match="slo_tpot_ms"):
        CompareConfig(policies=["continuous-slo"])
