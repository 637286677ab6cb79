"""The engine loop and the offline entry point."""
from conveyor.engine.llm import LLM
from conveyor.engine.llm_engine import LLMEngine, Runner
from conveyor.engine.outputs import RequestOutput

__all__ = ["LLM", "LLMEngine", "RequestOutput", "Runner"]
