"""Offline batch generation: LLM(model, **config).generate(prompts, sampling_params)."""
from __future__ import annotations

from typing import Any, Sequence, cast

from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.outputs import RequestOutput
from conveyor.sampling.params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str | None = None, **config: Any) -> None:
        self.engine = LLMEngine.from_config(EngineConfig.from_kwargs(model=model, **config))

    @property
    def tokenizer(self):  # noqa: ANN201 - the model's Tokenizer
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; results come back in the order of `prompts`."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [cast(Prompt, prompts)]  # one prompt: a string or a list of token ids
        prompts = cast(Sequence[Prompt], prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, sampling_params)]
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests:
            for output in self.engine.step():
                if output.finished:
                    results[output.request_id] = output
        return [results[i] for i in ids]

    def chat(
        self, conversations: list[dict[str, str]] | list[list[dict[str, str]]], sampling_params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [cast(list[dict[str, str]], conversations)]
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params)
