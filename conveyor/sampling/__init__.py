"""Sampling parameters (pure Python). The tensor sampler lives in conveyor.sampling.sampler."""
from conveyor.sampling.params import SamplingParams
from conveyor.sampling.pooling import PoolingParams

__all__ = ["PoolingParams", "SamplingParams"]
