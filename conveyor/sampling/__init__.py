"""Sampling parameters (pure Python). The tensor sampler lives in conveyor.sampling.sampler."""
from conveyor.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
