"""Per-request sampling parameters, validated at construction (pure Python: the scheduler imports it)."""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Callable

from conveyor.errors import InvalidRequestError
from conveyor.model.generation_defaults import recommended_sampling
from conveyor.sampling.pooling import PoolingParams
from conveyor.structured.spec import GrammarSpec

# A temperature below this samples as greedy (vLLM's _SAMPLING_EPS): dividing fp32 logits by it
# would overflow to inf/NaN, and the argmax is what such a temperature means anyway.
GREEDY_TEMPERATURE_EPS = 1e-5
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_MAX_STOP_STRINGS = 16
_MAX_N = 64
_MAX_LOGPROBS = 20
_MAX_PENALTY = 2.0  # OpenAI's range for presence/frequency penalties: [-2, 2]
_MAX_REPETITION_PENALTY = 2.0  # vLLM's: (0, 2]
_MAX_LOGIT_BIAS = 100.0  # OpenAI's: a bias is in [-100, 100]
_MAX_BAD_WORDS = 128  # vLLM's limits: bad words per request, and their tokens in all
_MAX_BAD_WORDS_TOKENS = 1024
# The engine thread tokenizes bad words and checks allowed ids at admission, where every running
# request waits on it: bound that work before it gets there.
_MAX_BAD_WORDS_CHARS = 64 * _MAX_BAD_WORDS_TOKENS
_MAX_ALLOWED_TOKEN_IDS = 2**18  # the largest vocabulary served (Gemma 3's 262,144)
# The llama.cpp samplers a sampler_chain may name (conveyor/sampling/chain.py), by their canonical names.
CHAIN_STEPS = ("top_k", "top_p", "min_p", "temperature", "infill")
log = logging.getLogger(__name__)


@dataclass
class SamplingParams:
    """What to generate and when to stop, as in vLLM/OpenAI.

    temperature 0 means greedy. top_k <= 0 disables top-k (vLLM uses -1); top_p 1 disables nucleus.
    A seed makes a sampled request reproducible regardless of what it is batched with.

    Logit adjustments, applied in this order before temperature (as vLLM): allowed_token_ids
    (every other token is masked out), bad words (a banned sequence's last token is masked out
    where the output so far ends with the rest of it; a one-token one always), min_tokens (EOS and
    stop_token_ids cannot be sampled until that many tokens are out), logit_bias (token id ->
    bias added to its logit), repetition_penalty (vLLM's: over prompt and output tokens, a
    positive logit is divided by it, a negative one multiplied), then frequency_penalty and
    presence_penalty (OpenAI's: logit -= count * frequency + (count > 0) * presence, counts over
    output tokens). min_p (drop tokens less likely than min_p times the likeliest) applies to the
    tempered distribution, with top-k and top-p. Logprobs are always of the model's own
    distribution, before any of these.

    Stop strings (`stop`) are searched for where text is made (LLM.generate and the server's
    detokenizer), never on the engine thread, and only from min_tokens tokens on (vLLM); the
    engine stops on token ids only. A structured output ends with its grammar, so it takes
    neither min_tokens nor ignore_eos.
    """

    max_tokens: int | None = 16  # None: until the context is full (vLLM's; the engine sets it at admission)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = 1  # independent samples of one prompt; they share the prompt's KV blocks
    logprobs: int | None = None  # top alternatives to report per generated token (0..20)
    prompt_logprobs: int | None = None  # top alternatives to report per prompt token (0..20), as vLLM
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_p: float = 0.0
    min_tokens: int = 0
    skip_special_tokens: bool = True  # in the output text
    structured: GrammarSpec | None = None  # constrain the output to a JSON schema, regex, choice or grammar
    # vLLM's: the prefix cache shares blocks only between requests with the same salt (None is a
    # salt of its own), so one tenant cannot time its way to another's prompts.
    cache_salt: str | None = None
    allowed_token_ids: list[int] | None = None  # only these may be sampled (None: all)
    # With --scheduling-policy priority: lower is served sooner (vLLM's); 0 otherwise.
    priority: int = 0
    # Words that must not be generated: the engine tokenizes each (as it starts a text and after a
    # space, as vLLM) into bad_words_token_ids, which callers holding token ids may also fill.
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # An embedding request (SamplingParams.for_pooling): it computes its prompt and returns a vector
    # pooled from its hidden states, sampling nothing (conveyor/sampling/pooling.py).
    pooling: PoolingParams | None = None
    # llama.cpp's order of samplers (its API's `samplers`; conveyor/sampling/chain.py): these steps
    # (top_k, top_p, min_p, temperature, infill), in this order, on the distribution the logit
    # adjustments leave, then a draw; a step not named is not applied, temperature included.
    # None: vLLM's order (temperature, then min_p, top-k and top-p of the tempered distribution).
    sampler_chain: tuple[str, ...] | None = None

    @classmethod
    def for_pooling(cls, pooling: PoolingParams, priority: int = 0, cache_salt: str | None = None) -> "SamplingParams":
        """An embedding request's parameters: max_tokens 1, as vLLM gives a pooling request (it samples
        no token, and the engine lets its prompt fill the context)."""
        return cls(max_tokens=1, temperature=0.0, pooling=pooling, priority=priority, cache_salt=cache_salt)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])  # None is none, as vLLM takes it
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self._check_types()
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        for name in ("temperature", "top_p"):
            if not math.isfinite(getattr(self, name)):
                raise InvalidRequestError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1 (or None: until the context is full), "
                                      f"got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if len(self.stop) > _MAX_STOP_STRINGS or any(not s for s in self.stop):
            raise InvalidRequestError(f"stop takes at most {_MAX_STOP_STRINGS} non-empty strings")
        if not 1 <= self.n <= _MAX_N:
            raise InvalidRequestError(f"n must be in [1, {_MAX_N}], got {self.n}")
        if self.logprobs is not None and not 0 <= self.logprobs <= _MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {_MAX_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX + 1 - self.n:
            # Sample i of n uses seed + i; every one must fit a 64-bit generator seed.
            raise InvalidRequestError(f"seed must fit in a signed 64-bit integer (less n - 1), got {self.seed}")
        if any(not 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative token ids")
        if self.cache_salt is not None and not self.cache_salt:
            raise InvalidRequestError("cache_salt must be a non-empty string if given")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not 0 < len(self.allowed_token_ids) <= _MAX_ALLOWED_TOKEN_IDS or any(t < 0 for t in self.allowed_token_ids):
                raise InvalidRequestError(
                    f"allowed_token_ids must be a non-empty list of at most {_MAX_ALLOWED_TOKEN_IDS} token ids")
        self.bad_words = list(self.bad_words)
        self.bad_words_token_ids = [list(ids) for ids in self.bad_words_token_ids]
        if len(self.bad_words) > _MAX_BAD_WORDS or any(not w.strip() for w in self.bad_words) \
                or sum(len(w) for w in self.bad_words) > _MAX_BAD_WORDS_CHARS:
            raise InvalidRequestError(f"bad_words takes at most {_MAX_BAD_WORDS} non-blank strings of "
                                      f"{_MAX_BAD_WORDS_CHARS} characters in all")
        if sum(len(ids) for ids in self.bad_words_token_ids) > _MAX_BAD_WORDS_TOKENS \
                or any(not ids or min(ids) < 0 for ids in self.bad_words_token_ids):
            raise InvalidRequestError(
                f"bad words take at most {_MAX_BAD_WORDS_TOKENS} tokens in all, each word at least one",
                param="bad_words")
        self._check_logit_adjustments()
        if self.pooling is not None:
            self._check_pooling()
        if self.sampler_chain is not None:
            self.sampler_chain = tuple(self.sampler_chain)
            unknown = [step for step in self.sampler_chain if step not in CHAIN_STEPS]
            if unknown:
                raise InvalidRequestError(f"sampler_chain takes steps of {', '.join(CHAIN_STEPS)}; got {unknown}",
                                          param="sampler_chain")

    def _check_pooling(self) -> None:
        generating = [name for name, used in (
            ("max_tokens", self.max_tokens != 1), ("n", self.n != 1), ("logprobs", self.logprobs is not None),
            ("prompt_logprobs", self.prompt_logprobs is not None), ("structured", self.structured is not None),
            ("min_tokens", self.min_tokens != 0)) if used]
        if generating:
            raise InvalidRequestError(f"an embedding request samples no tokens: {', '.join(generating)} cannot be "
                                      "set with pooling (SamplingParams.for_pooling)", param=generating[0])

    def _check_logit_adjustments(self) -> None:
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= _MAX_LOGPROBS:
            raise InvalidRequestError(f"prompt_logprobs must be in [0, {_MAX_LOGPROBS}], got {self.prompt_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -_MAX_PENALTY <= getattr(self, name) <= _MAX_PENALTY:
                raise InvalidRequestError(f"{name} must be in [-{_MAX_PENALTY:g}, {_MAX_PENALTY:g}], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= _MAX_REPETITION_PENALTY:
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, {_MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= (self.max_tokens if self.max_tokens is not None else self.min_tokens):
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens ({self.max_tokens})], got {self.min_tokens}")
        # A complete grammar allows nothing more, so neither could be honoured past its end.
        if self.structured is not None and self.min_tokens > 0:
            raise InvalidRequestError("min_tokens cannot be combined with a structured output (a complete grammar "
                                      "allows no more tokens)", param="min_tokens")
        if self.structured is not None and self.ignore_eos:
            raise InvalidRequestError("ignore_eos cannot be combined with a structured output (a complete grammar "
                                      "allows no more tokens)", param="ignore_eos")
        bad = [t for t, b in self.logit_bias.items() if t < 0 or not -_MAX_LOGIT_BIAS <= b <= _MAX_LOGIT_BIAS]
        if bad:
            raise InvalidRequestError(
                f"logit_bias takes token ids >= 0 with biases in [-{_MAX_LOGIT_BIAS:g}, {_MAX_LOGIT_BIAS:g}]; "
                f"bad entries for: {bad[:5]}")

    def _check_types(self) -> None:
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        checks = [
            ("max_tokens", self.max_tokens is None or is_int(self.max_tokens)),
            ("temperature", is_num(self.temperature)),
            ("top_k", is_int(self.top_k)),
            ("top_p", is_num(self.top_p)),
            ("seed", self.seed is None or is_int(self.seed)),
            ("stop", all(isinstance(s, str) for s in self.stop)),
            ("stop_token_ids", all(is_int(t) for t in self.stop_token_ids)),
            ("ignore_eos", isinstance(self.ignore_eos, bool)),
            ("include_stop_str_in_output", isinstance(self.include_stop_str_in_output, bool)),
            ("n", is_int(self.n)),
            ("logprobs", self.logprobs is None or is_int(self.logprobs)),
            ("prompt_logprobs", self.prompt_logprobs is None or is_int(self.prompt_logprobs)),
            ("presence_penalty", is_num(self.presence_penalty)),
            ("frequency_penalty", is_num(self.frequency_penalty)),
            ("repetition_penalty", is_num(self.repetition_penalty)),
            ("min_p", is_num(self.min_p)),
            ("min_tokens", is_int(self.min_tokens)),
            ("skip_special_tokens", isinstance(self.skip_special_tokens, bool)),
            ("logit_bias", isinstance(self.logit_bias, dict)
             and all(is_int(k) and is_num(v) for k, v in self.logit_bias.items())),
            ("structured", self.structured is None or isinstance(self.structured, GrammarSpec)),
            ("cache_salt", self.cache_salt is None or isinstance(self.cache_salt, str)),
            ("priority", is_int(self.priority) and INT64_MIN <= self.priority <= INT64_MAX),
            ("allowed_token_ids", self.allowed_token_ids is None or (
                isinstance(self.allowed_token_ids, (list, tuple)) and all(is_int(t) for t in self.allowed_token_ids))),
            ("bad_words", isinstance(self.bad_words, (list, tuple)) and all(isinstance(w, str) for w in self.bad_words)),
            ("bad_words_token_ids", isinstance(self.bad_words_token_ids, (list, tuple)) and all(
                isinstance(ids, (list, tuple)) and all(is_int(t) for t in ids) for ids in self.bad_words_token_ids)),
            ("pooling", self.pooling is None or isinstance(self.pooling, PoolingParams)),
        ]
        for name, ok in checks:
            if not ok:
                raise InvalidRequestError(f"{name} has the wrong type: {getattr(self, name)!r}")

    def for_sample(self, index: int) -> "SamplingParams":
        """Parameters of the index-th of n samples: one sample each, seeds kept distinct."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)

    def bounded(self, vocab_size: int) -> "SamplingParams":
        """A validated copy (so fields changed after construction are checked again) with the
        vocabulary-dependent values made safe for the sampler's tensors: a top_k above the
        vocabulary keeps every token, so it is clipped to it."""
        return replace(self, top_k=min(self.top_k, vocab_size))

    def with_bad_words_tokenized(self, encode: Callable[[str], list[int]]) -> "SamplingParams":
        """A copy whose bad_words_token_ids also hold each bad word's tokens (`encode` adds no
        special tokens), as vLLM makes them: the word as it starts a text, and after a space where
        the space joins its first token into another token of the same count (" word" in BPE
        vocabularies). Applying it again adds nothing."""
        sequences = list(self.bad_words_token_ids)
        for word in self.bad_words:
            plain = encode(word.lstrip())
            spaced = encode(" " + word.lstrip())
            for ids in (plain, spaced) if spaced[:1] != plain[:1] and len(spaced) == len(plain) else (plain,):
                if ids and ids not in sequences:
                    sequences.append(ids)
        return replace(self, bad_words_token_ids=sequences)

    @property
    def greedy(self) -> bool:
        """Whether the token is the argmax of the adjusted logits (a sampler chain's infill step
        may pick another, and a chain without its temperature step samples at 1)."""
        if self.sampler_chain is None:
            return self.temperature < GREEDY_TEMPERATURE_EPS
        return (self.temperature < GREEDY_TEMPERATURE_EPS and "temperature" in self.sampler_chain
                and "infill" not in self.sampler_chain)

    @property
    def penalized(self) -> bool:
        """Uses a penalty that needs the tokens seen so far."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def model_defaults(generation_config: str, recommended: Mapping[str, float | int]) -> dict[str, float | int]:
    """What a request that leaves a sampling field out gets, by EngineConfig.generation_config
    ("auto": `recommended`, the model's own, Tokenizer.recommended_sampling; "vllm": nothing; or a
    folder's generation_config.json), as SamplingParams fields. A value a request could not take is
    left out with a warning (a model file's bad value must not fail every request); what applies is
    logged, as vLLM logs it."""
    source = "the model" if generation_config == "auto" else generation_config
    checked: dict[str, float | int] = {}
    for name, value in recommended_sampling(generation_config, recommended).items():
        try:
            SamplingParams(**{name: value})  # type: ignore[arg-type]
        except InvalidRequestError as exc:
            log.warning("%s recommends %s = %r, which a request cannot take (%s): not applied", source, name, value, exc)
            continue
        checked[name] = value
    if checked:
        log.info("sampling fields a request leaves out take what %s recommends: %s (--generation-config vllm "
                 "turns this off)", source, ", ".join(f"{k} {v}" for k, v in checked.items()))
    return checked
