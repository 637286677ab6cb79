"""conveyor: continuous batching over a paged KV cache."""
from conveyor.model.memory import share_one_heap

# First, before numpy's BLAS and the kernels' OpenMP start threads of their own: see share_one_heap.
share_one_heap()

from conveyor.config import EngineConfig, SchedulerConfig  # noqa: E402
from conveyor.engine import LLM, LLMEngine, RequestOutput  # noqa: E402
from conveyor.sampling import PoolingParams, SamplingParams  # noqa: E402

__all__ = ["EngineConfig", "LLM", "LLMEngine", "PoolingParams", "RequestOutput", "SamplingParams", "SchedulerConfig"]
__version__ = "0.1.0"
