"""conveyor: continuous batching over a paged KV cache."""
from conveyor.config import EngineConfig, SchedulerConfig
from conveyor.engine import LLM, LLMEngine, RequestOutput
from conveyor.sampling import SamplingParams

__all__ = ["EngineConfig", "LLM", "LLMEngine", "RequestOutput", "SamplingParams", "SchedulerConfig"]
__version__ = "0.1.0"
