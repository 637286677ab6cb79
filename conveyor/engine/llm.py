"""Offline batch generation: LLM(model, **config).generate(prompts, sampling_params), in the
shapes vLLM's offline API takes and gives (prompts as text, token ids or vLLM's dict prompts; one
output per prompt, its n samples in `.outputs`)."""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Callable, Sequence, cast

from conveyor.config import EngineConfig
from conveyor.engine.detokenizer import IncrementalDetokenizer
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob,
                                     RequestOutput, ranked_logprobs)
from conveyor.errors import InvalidRequestError, RequestFailedError
from conveyor.sampling.params import SamplingParams, model_defaults
from conveyor.sampling.pooling import PoolingParams

Prompt = str | Sequence[int]
# vLLM's TextPrompt and TokensPrompt: {"prompt": text} or {"prompt_token_ids": ids}.
PromptInput = Prompt | Mapping[str, Any]
Message = Mapping[str, Any]


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

    def get_tokenizer(self):  # noqa: ANN201 - vLLM's name for it
        return self.tokenizer

    @functools.cached_property
    def sampling_defaults(self) -> dict[str, float | int]:
        """The sampling fields the model recommends (EngineConfig.generation_config:
        generation_config.json, a GGUF's general.sampling.* keys), as SamplingParams' names."""
        return model_defaults(self.engine.config.generation_config, self.tokenizer.recommended_sampling)

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat use without sampling_params (vLLM's): SamplingParams' defaults but
        for the fields the model recommends (sampling_defaults)."""
        return SamplingParams(**self.sampling_defaults)  # type: ignore[arg-type]

    def within_context(self, prompt: Prompt, params: SamplingParams) -> SamplingParams:
        """`params` with a max_tokens the model recommends (the caller never asked for it) at most
        the room `prompt` leaves in the context, as the server's default is: a recommendation as
        long as the context must not get every prompt refused."""
        used = len(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else len(prompt)
        room = self.engine.capacity - used
        limit = room if params.max_tokens is None else min(params.max_tokens, room)
        return dataclasses.replace(params, max_tokens=limit) if room >= 1 else params

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine."""
        return self.engine

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; one output per prompt, in the order of `prompts`: its
        fields are sample 0's, and `.outputs` holds all n samples (vLLM's shape). Text is made
        incrementally as tokens arrive (a stop string ends its sample at once). If a prompt is
        refused, or the run is interrupted, the prompts already queued are withdrawn."""
        if lora_request is not None:
            raise TypeError("lora_request: LoRA adapters are not supported")
        items = _prompt_list(prompts)
        params = _params(sampling_params, len(items), self.get_default_sampling_params)
        if sampling_params is None and "max_tokens" in self.sampling_defaults:
            params = [self.within_context(prompt, p) for prompt, p in zip(items, params)]
        ids: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(items, params)):
                try:
                    ids.append(self.engine.add_request(prompt, p))
                except Exception as exc:
                    exc.add_note(f"prompts[{i}] was refused; the {i} queued before it were withdrawn")
                    raise
            return self._run(ids, dict(zip(ids, params)), use_tqdm)
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: None = None,
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in order (vLLM's `LLM.embed`): the prompt's final hidden states
        pooled as `pooling_params` says (default: the engine's, LLMEngine.default_pooling).
        `truncate_prompt_tokens`: keep each prompt's last k tokens (-1: as many as a request holds)."""
        items = _prompt_list(prompts)
        if truncate_prompt_tokens is not None:
            if truncate_prompt_tokens == 0 or truncate_prompt_tokens < -1:
                raise InvalidRequestError("truncate_prompt_tokens must be -1 (as many as a request holds) or at least "
                                          f"1, got {truncate_prompt_tokens}", param="truncate_prompt_tokens")
            keep = self.engine.capacity if truncate_prompt_tokens == -1 else truncate_prompt_tokens
            items = [(self.tokenizer.encode(p) if isinstance(p, str) else list(p))[-keep:] for p in items]
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            given = pooling_params or self.engine.default_pooling
            params: SamplingParams | list[SamplingParams] = SamplingParams.for_pooling(given)
        elif isinstance(pooling_params, Sequence) and all(isinstance(p, PoolingParams) for p in pooling_params):
            if len(pooling_params) != len(items):
                raise ValueError(f"give one PoolingParams, or one per prompt ({len(items)}), not {len(pooling_params)}")
            params = [SamplingParams.for_pooling(p) for p in pooling_params]
        else:
            raise TypeError(f"pooling_params takes a PoolingParams or a list of them, got {type(pooling_params).__name__}")
        outputs = self.generate(cast(list[PromptInput], items), params, use_tqdm, lora_request)
        for out in outputs:
            if out.embedding is None:  # the engine failed it (failure isolation) or it was aborted
                raise out.error or RequestFailedError(f"request {out.request_id!r} ended without its embedding "
                                                      f"({out.finish_reason})")
        return [EmbeddingRequestOutput(out.request_id, out.prompt_token_ids, EmbeddingOutput(cast(list[float], out.embedding)),
                                       out.prompt) for out in outputs]

    def _run(self, ids: list[str], params_of: dict[str, SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        texts: dict[tuple[str, int], IncrementalDetokenizer] = {}
        logprobs: dict[tuple[str, int], list[dict[int, float]]] = {}
        prompt_logprobs: dict[str, list[dict[int, float] | None]] = {}
        done: dict[str, dict[int, RequestOutput]] = {request_id: {} for request_id in ids}
        bar = _progress_bar(len(ids)) if use_tqdm else None
        try:
            while self.engine.has_unfinished_requests:
                for output in self.engine.step():
                    p = params_of.get(output.request_id)
                    if p is None:  # queued on the engine directly, not by this call: run, but not returned
                        continue
                    key = (output.request_id, output.index)
                    if key not in texts:
                        texts[key] = IncrementalDetokenizer(self.tokenizer, p.stop, p.include_stop_str_in_output,
                                                            p.skip_special_tokens, p.min_tokens)
                    detok = texts[key]
                    detok.add(output.new_token_ids, ends_on_stop_token=output.ended_on_stop_token)
                    if p.logprobs is not None:
                        logprobs.setdefault(key, []).extend(output.logprobs or [])
                    if output.prompt_logprobs is not None:
                        prompt_logprobs.setdefault(output.request_id, output.prompt_logprobs)
                    if detok.stopped:  # the text reached a stop string: end the sample here, whatever else
                        if not output.finished:
                            output = self.engine.stop_sample(output.request_id, output.index,
                                                             detok.stop_reason) or output
                        output.finish_reason, output.stop_reason = "stop", detok.stop_reason
                    if output.finished:
                        detok.finish()
                        output.text = detok.output_text
                        output.logprobs = logprobs.get(key, []) if p.logprobs is not None else None
                        ended = done[output.request_id]
                        ended[output.index] = output
                        if output.error is not None:  # the engine failed the request: every sample ends so
                            for index in range(p.n):
                                ended.setdefault(index, dataclasses.replace(output, index=index, text=""))
                        if bar is not None and len(ended) == p.n:
                            bar.update()
        finally:
            if bar is not None:
                bar.close()
        results = []
        for request_id in ids:
            p = params_of[request_id]
            samples = [done[request_id][i] for i in range(p.n)]
            ranked: list[list[dict[int, Logprob]] | None] = []
            for sample in samples:  # vLLM's Logprob objects, which are the floats they were as well
                ranked.append(None if sample.logprobs is None else [
                    self._ranked(step, token, p.logprobs or 0) for step, token in zip(sample.logprobs, sample.token_ids)])
                sample.logprobs = cast(list[dict[int, float]] | None, ranked[-1])
            first = samples[0]
            if request_id in prompt_logprobs:
                first.prompt_logprobs = [None if step is None else dict(self._ranked(step, token, p.prompt_logprobs or 0))
                                         for step, token in zip(prompt_logprobs[request_id], first.prompt_token_ids)]
            first.outputs = [CompletionOutput(s.index, s.text or "", list(s.token_ids), _cumulative(s), r,
                                              s.finish_reason, s.stop_reason) for s, r in zip(samples, ranked)]
            results.append(first)
        return results

    def _ranked(self, step: dict[int, float], chosen: int, top: int) -> dict[int, Logprob]:
        decode = self.tokenizer.decode
        return ranked_logprobs(step, chosen, top, lambda token: decode([token], skip_special_tokens=False))

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Renders each conversation with the chat template (the model's, or `chat_template`),
        then generates (vLLM's LLM.chat): one conversation or a list of them."""
        one = bool(messages) and isinstance(messages[0], Mapping)
        conversations = cast(Sequence[Sequence[Message]], [messages] if one else messages)
        render: dict[str, Any] = {"add_generation_prompt": add_generation_prompt,
                                  "continue_final_message": continue_final_message, "chat_template": chat_template}
        if tools is not None:
            render["tools"] = tools
        render.update(chat_template_kwargs or {})  # vLLM lets them override the options above
        rendered = [self.tokenizer.apply_chat_template([dict(m) for m in c], **render) for c in conversations]
        if tools and conversations and rendered[0] == self.tokenizer.apply_chat_template(
                [dict(m) for m in conversations[0]], **{**render, "tools": None}):
            raise InvalidRequestError("tools reach the model only through a chat template that renders them, and "
                                      "this one does not: pass chat_template= one that does", param="tools")
        prompts = [self.tokenizer.encode_chat(text) for text in rendered]
        outputs = self.generate(cast(list[PromptInput], prompts), sampling_params, use_tqdm, lora_request)
        for output, text in zip(outputs, rendered):
            output.prompt = text  # generated from its ids (one BOS), but named by its text, as vLLM's
        return outputs


def _prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[Prompt]:
    """One prompt or a list of them, as generate and embed take them, as a list of texts or ids."""
    one = isinstance(prompts, (str, Mapping)) or (bool(prompts) and isinstance(cast(Sequence, prompts)[0], int))
    given = [cast(PromptInput, prompts)] if one else cast(Sequence[PromptInput], prompts)
    return [_prompt(p, i) for i, p in enumerate(given)]


def _prompt(prompt: PromptInput, index: int) -> Prompt:
    if not isinstance(prompt, Mapping):
        return prompt
    if len(prompt) != 1 or not {"prompt", "prompt_token_ids"} & set(prompt):
        raise TypeError(f"prompts[{index}]: a dict prompt is {{'prompt': text}} or {{'prompt_token_ids': ids}} "
                        f"(vLLM's); got the keys {sorted(prompt)}")
    return cast(Prompt, prompt.get("prompt", prompt.get("prompt_token_ids")))


def _params(given: SamplingParams | Sequence[SamplingParams] | None, count: int,
            default: Callable[[], SamplingParams]) -> list[SamplingParams]:
    if given is None or isinstance(given, SamplingParams):
        return [given or default()] * count
    if isinstance(given, (str, bytes, Mapping)) or not isinstance(given, Sequence) \
            or not all(isinstance(p, SamplingParams) for p in given):
        raise TypeError(f"sampling_params takes a SamplingParams or a list of them, got {type(given).__name__}")
    if len(given) != count:
        raise ValueError(f"give one SamplingParams, or one per prompt ({count}), not {len(given)}")
    return list(given)


def _cumulative(output: RequestOutput) -> float | None:
    """The sum of the chosen tokens' logprobs, where they were asked for (vLLM's cumulative_logprob)."""
    if output.logprobs is None:
        return None
    return sum(step[token] for step, token in zip(output.logprobs, output.token_ids) if token in step)


def _progress_bar(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="prompts", unit="prompt")
