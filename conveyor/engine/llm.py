"""Offline batch generation: LLM(model, **config).generate(prompts, sampling_params)."""
from __future__ import annotations

from typing import Any, Sequence, cast

from conveyor.config import EngineConfig
from conveyor.engine.detokenizer import IncrementalDetokenizer
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.outputs import RequestOutput
from conveyor.sampling.params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str | None = None, **config: Any) -> None:
        self.engine = LLMEngine.from_config(EngineConfig.from_kwargs(model=model, **config))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """Generation over an engine built already (tests and benchmarks share loaded weights)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    @property
    def tokenizer(self):  # noqa: ANN201 - the model's Tokenizer
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; results come back in the order of `prompts`, with their
        text, made incrementally as tokens arrive (a stop string ends its sample at once)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [cast(Prompt, prompts)]  # one prompt: a string or a list of token ids
        prompts = cast(Sequence[Prompt], prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, sampling_params)]
        params_of = dict(zip(ids, sampling_params))
        texts: dict[tuple[str, int], IncrementalDetokenizer] = {}
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests:
            for output in self.engine.step():
                key = (output.request_id, output.index)
                if key not in texts:
                    p = params_of[output.request_id]
                    texts[key] = IncrementalDetokenizer(self.tokenizer, p.stop, p.include_stop_str_in_output,
                                                        p.skip_special_tokens, p.min_tokens)
                detok = texts[key]
                detok.add(output.new_token_ids, ends_on_stop_token=output.ended_on_stop_token)
                if detok.stopped:  # the text reached a stop string: end the sample here, whatever else
                    if not output.finished:
                        output = self.engine.stop_sample(output.request_id, output.index, detok.stop_reason) or output
                    output.finish_reason, output.stop_reason = "stop", detok.stop_reason
                if output.finished:
                    detok.finish()
                    output.text = detok.output_text
                    results[output.request_id] = output
        return [results[i] for i in ids]

    def chat(
        self, conversations: list[dict[str, str]] | list[list[dict[str, str]]], sampling_params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [cast(list[dict[str, str]], conversations)]
        rendered = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        prompts = [self.tokenizer.encode_chat(text) for text in rendered]
        outputs = self.generate(cast(list[Prompt], prompts), sampling_params)
        for output, text in zip(outputs, rendered):
            output.prompt = text  # generated from its ids (one BOS), but named by its text, as vLLM's
        return outputs
