"""Vectorised sampling: greedy, temperature, top-k, top-p, per-request seeds, in one pass per step.

Each sampled row draws one uniform number and inverts its CDF. The number comes from the
request's own generator when it has a seed, so its draws do not depend on its batch-mates.
"""
from __future__ import annotations

import weakref
from typing import Sequence

import torch

from conveyor.engine.outputs import SamplerOutput
from conveyor.request import Request


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._generator = torch.Generator().manual_seed(seed)
        self._request_generators: weakref.WeakKeyDictionary[Request, torch.Generator] = weakref.WeakKeyDictionary()

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """logits: fp32 [len(requests), vocab]."""
        tokens = self._sample(logits, requests)
        wanted = [r.sampling_params.logprobs for r in requests]
        if all(k is None for k in wanted):
            return SamplerOutput(tokens)
        return SamplerOutput(tokens, self._logprobs(logits, tokens, wanted))

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: list[int], wanted: list[int | None]) -> list[dict[int, float] | None]:
        # Of the model's own distribution (before temperature and truncation), as vLLM reports them.
        rows = [i for i, k in enumerate(wanted) if k is not None]
        logp = torch.log_softmax(logits[rows], dim=-1)
        top = max(wanted[i] for i in rows)  # type: ignore[type-var]
        top_values, top_ids = logp.topk(top, dim=-1) if top else (logp[:, :0], logp[:, :0].long())
        chosen = logp[torch.arange(len(rows)), torch.tensor([tokens[i] for i in rows])]
        result: list[dict[int, float] | None] = [None] * len(tokens)
        for j, i in enumerate(rows):
            k = wanted[i]
            entry = dict(zip(top_ids[j, :k].tolist(), top_values[j, :k].tolist()))
            entry[tokens[i]] = float(chosen[j])
            result[i] = entry
        return result

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        params = [r.sampling_params for r in requests]
        greedy = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy.tolist()
        temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params])
        scaled = logits / temperature[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            scaled = self._truncate(scaled, params)
        cdf = scaled.softmax(dim=-1).cumsum(dim=-1)
        uniform = self._uniforms(requests) * cdf[:, -1]
        sampled = torch.searchsorted(cdf, uniform[:, None]).squeeze(1).clamp_(max=logits.shape[-1] - 1)
        is_greedy = torch.tensor([p.greedy for p in params])
        return torch.where(is_greedy, greedy, sampled).tolist()

    @staticmethod
    def _truncate(logits: torch.Tensor, params: Sequence) -> torch.Tensor:
        vocab = logits.shape[-1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]).clamp_(max=vocab)
        ranks = torch.arange(vocab)[None, :]
        drop = ranks >= top_k[:, None]
        top_p = torch.tensor([p.top_p for p in params])
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it does.
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= top_p[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)

    # A seeded request that moves to another engine (KV handover) takes its draws along with it.
    def generator_state(self, request: Request) -> torch.Tensor | None:
        gen = self._request_generators.get(request)
        return None if gen is None else gen.get_state()

    def set_generator_state(self, request: Request, state: torch.Tensor) -> None:
        self._request_generators[request] = torch.Generator().set_state(state)

    # A step that raised is run again on part of its batch (LLMEngine's failure isolation): the
    # retry must draw the numbers the first try would have drawn.
    def save_rng_state(self, requests: Sequence[Request]) -> tuple[torch.Tensor, dict[Request, torch.Tensor | None]]:
        """The shared generator and the seeded generators of `requests` (None: not created yet)."""
        seeded = {}
        for request in requests:
            if request.sampling_params.seed is not None:
                gen = self._request_generators.get(request)
                seeded[request] = None if gen is None else gen.get_state()
        return self._generator.get_state(), seeded

    def restore_rng_state(self, state: tuple[torch.Tensor, dict[Request, torch.Tensor | None]]) -> None:
        shared, seeded = state
        self._generator.set_state(shared)
        for request, request_state in seeded.items():
            if request_state is None:
                self._request_generators.pop(request, None)
            else:
                self._request_generators[request].set_state(request_state)

    def _uniforms(self, requests: Sequence[Request]) -> torch.Tensor:
        uniform = torch.rand(len(requests), generator=self._generator)
        for i, request in enumerate(requests):
            seed = request.sampling_params.seed
            if seed is None:
                continue
            gen = self._request_generators.get(request)
            if gen is None:
                gen = torch.Generator().manual_seed(seed)
                self._request_generators[request] = gen
            uniform[i] = torch.rand(1, generator=gen)
        return uniform
