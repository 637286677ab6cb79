"""Seeded synthetic workloads: which requests arrive (prompt ids, input and output length) and when.

Every request is a list of random prompt token ids (drawn from the vocabulary, avoiding the
special ids below 10) and an output length that the benchmark enforces with `ignore_eos`, so the
same workload puts exactly the same work on every engine and server. Nothing is downloaded.

Datasets (`--input-len` / `--output-len` override the defaults; for the long-tailed datasets
they set the *mean* of the distribution, before clipping):

| dataset        | input length                               | output length                              |
|----------------|--------------------------------------------|--------------------------------------------|
| `random`       | uniform in L_in x [1 - r, 1 + r], L_in=128 | uniform in L_out x [1 - r, 1 + r], L_out=128 |
| `uniform`      | exactly L_in (128)                         | exactly L_out (128)                        |
| `chat`         | lognormal, mean 160, sigma 1.2, in [4, 1024] | lognormal, mean 340, sigma 0.9, in [4, 1024] |
| `seed`         | lognormal, mean 128, sigma 0.6, in [16, 1024] | lognormal, mean 300, sigma 0.9, in [8, 2048] |
| `long-prompts` | L_in (32); every k-th request L_long (1024) | L_out x [1 - r, 1 + r] (128, r 0.5); long: 16 |
| `prefix`       | a group's shared P tokens (1024) + L_in unique (32) | exactly L_out (64)            |
| `multi-turn`   | turn 1: L_in (128); turn k: the history + 32 new | exactly L_out (64)                  |
| `edit`         | a chat: rewrite ~L_in (384) tokens of stdlib source with one rename | the snippet's tokens, at most L_out |
| `questions`    | a chat: write a stdlib function from its signature and docstring | at most L_out (256): the answer |

`prefix` (vLLM's prefix-repetition dataset): `--num-groups` G groups, each sharing one
`--prefix-len` P-token prefix, every request with its own suffix; request i belongs to group i % G, so
each group's first request arrives early and the rest can hit its cached prefix. `multi-turn`:
num_prompts / `--num-turns` K conversations of K turns. Turn 1 is L_in tokens; turn k's prompt is
turn k-1's whole prompt, its generated tokens, then `--turn-len` new user tokens, sent an exponential
think time (mean `--think-time` s) after turn k-1 finished. Only first turns follow the arrival
process; later turns are released by the client (`follows`), as a chat user would send them.

`edit` is real text, where the others are random ids: request i takes the source of a module that
ships with Python (EDIT_MODULES[(i + seed * num_prompts) % 16], so another seed starts elsewhere
and a round does not find the last round's prompts cached) from its first top-level definition on, about L_in tokens of
whole lines, and asks, in the model's chat template, for the code back with that definition renamed
(`name` -> `name_renamed`) and nothing else changed: what a coding assistant does all day, and the
case where most of the answer is already in the prompt (speculative decoding's prompt lookup). It
needs the model's tokenizer (`--tokenizer`, a model name or file); the benchmark is greedy with
`ignore_eos`, so every server does the same work.

`questions` is real text too: request i asks, in the model's chat template, for a function of a
module that ships with Python, given only its signature and the first paragraph of its docstring
(QUESTION_MODULES' public functions in name order, from i + seed * num_prompts on). The answer is
the model's own (new code and prose, little of it in the prompt), L_out a cap: a benchmark of real
chats runs these until the model's end of turn (benchmarks/speculation_rounds.py --until-eos).

`r` is `--range-ratio` (as in `vllm bench serve --dataset-name random`). `chat` follows the
shape of ShareGPT conversations as the vLLM paper reports them (mean input 161, mean output 338
tokens, long right tails). `seed` has outputs averaging ~300 tokens with a long tail: in a static
batch of 32 the longest output is typically 3-5x the mean, which is the waste continuous batching
removes. `long-prompts` is a decode-heavy stream (short prompts, long outputs) with a long prompt
every `--long-prompt-every` requests (k=8), for the chunked-prefill picture; its short outputs are
spread so that decodes end, and new requests join, one at a time rather than in waves (a wave would
put the long prefill beside new prompts, where it shows in TTFT, instead of beside decodes).

Arrivals follow `vllm bench serve`: all at time 0 for rate `inf`; otherwise gamma-distributed gaps
with shape `burstiness` and mean 1/rate (burstiness 1 is a Poisson process; < 1 burstier, > 1
more regular), rescaled so the last arrival is at num_prompts / rate. Arrival draws use their own
random stream, so the same requests arrive at every rate. A rate schedule (`--rate-schedule
0:1,120:4,240:1`) makes the rate piecewise constant in time, for load that rises and falls.
"""
from __future__ import annotations

import math
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from conveyor.errors import ConfigError

FIRST_REGULAR_ID = 10  # ids below are special tokens (<|endoftext|>, <|im_start|>, <|im_end|>, ...)
DATASETS = ("random", "uniform", "chat", "seed", "long-prompts", "prefix", "multi-turn", "edit", "questions")
EDIT_MODULES = ("textwrap", "bisect", "heapq", "fnmatch", "shlex", "colorsys", "queue", "sched", "graphlib",
                "calendar", "dataclasses", "string", "glob", "statistics", "difflib", "base64")
QUESTION_MODULES = ("textwrap", "bisect", "heapq", "fnmatch", "shlex", "colorsys", "statistics", "difflib", "base64",
                    "string", "glob", "calendar")


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    # A conversation's later turn: the prompt sent is the previous turn's (request `follows`) whole
    # prompt, then its generated tokens, then prompt_token_ids; sent think_time s after it finished.
    follows: int | None = None
    think_time: float = 0.0

    @property
    def prompt_len(self) -> int:
        """Of a later turn: its new tokens only (the history is known once the previous turn ends)."""
        return len(self.prompt_token_ids)


def next_turn_prompt(previous_prompt: list[int], previous_output: list[int], request: BenchRequest) -> list[int]:
    """The prompt a later turn sends: the conversation so far, then its own new tokens."""
    return previous_prompt + previous_output + request.prompt_token_ids


def followers(requests: list[BenchRequest]) -> dict[int, list[int]]:
    """Request index -> the later turns it releases when it finishes."""
    out: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        if r.follows is not None:
            out.setdefault(r.follows, []).append(i)
    return out


@dataclass
class WorkloadConfig:
    dataset: str = "random"
    num_prompts: int = 100
    input_len: int | None = None  # None: the dataset's default (a mean for chat / seed)
    output_len: int | None = None
    range_ratio: float = 0.0  # random: lengths uniform in L x [1 - r, 1 + r]
    long_prompt_len: int = 1024  # long-prompts: the occasional long prompt
    long_prompt_every: int = 8
    long_prompt_output_len: int = 16
    num_groups: int = 16  # prefix: groups sharing a prefix
    prefix_len: int = 1024  # prefix: the shared prefix's length
    num_turns: int = 6  # multi-turn: turns per conversation
    turn_len: int = 32  # multi-turn: new user tokens per later turn
    think_time: float = 1.0  # multi-turn: mean seconds between a turn's end and the next turn
    vocab_size: int = 49152
    seed: int = 0
    tokenizer: str | None = None  # edit: the model whose tokenizer and chat template make the prompts

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ConfigError(f"unknown dataset {self.dataset!r}; choose from {', '.join(DATASETS)}")
        if self.num_prompts < 1:
            raise ConfigError("num_prompts must be positive")
        lengths = {"input_len": self.input_len, "output_len": self.output_len, "long_prompt_len": self.long_prompt_len,
                   "long_prompt_every": self.long_prompt_every, "long_prompt_output_len": self.long_prompt_output_len}
        wrong = [f"{name} {value}" for name, value in lengths.items() if value is not None and value < 1]
        if wrong:
            raise ConfigError(f"lengths must be at least 1 (input_len / output_len: leave them out for the dataset's "
                              f"default): {', '.join(wrong)}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ConfigError("range_ratio must be in [0, 1)")
        if self.vocab_size <= FIRST_REGULAR_ID:
            raise ConfigError(f"vocab_size must exceed {FIRST_REGULAR_ID}")
        if (min(self.num_groups, self.num_turns) < 1 or self.prefix_len < 0 or self.turn_len < 0
                or not self.think_time >= 0):
            raise ConfigError("num_groups and num_turns must be positive; prefix_len, turn_len and think_time >= 0")


@dataclass(frozen=True)
class _LogNormal:
    mean: float
    sigma: float
    lo: int
    hi: int

    def draw(self, rng: np.random.Generator, n: int, mean: float | None = None) -> np.ndarray:
        """Lognormal with the given mean (mu = ln(mean) - sigma^2 / 2), rounded and clipped."""
        mu = math.log(mean or self.mean) - self.sigma**2 / 2
        return np.clip(np.rint(rng.lognormal(mu, self.sigma, n)), self.lo, self.hi).astype(int)


_LONG_TAILED = {
    "chat": (_LogNormal(160, 1.2, 4, 1024), _LogNormal(340, 0.9, 4, 1024)),
    "seed": (_LogNormal(128, 0.6, 16, 1024), _LogNormal(300, 0.9, 8, 2048)),
}
_DEFAULT_LENS = {"random": (128, 128), "uniform": (128, 128), "long-prompts": (32, 128), "prefix": (32, 64),
                 "multi-turn": (128, 64)}


def _lengths(cfg: WorkloadConfig, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    n = cfg.num_prompts
    if cfg.dataset in _LONG_TAILED:
        dist_in, dist_out = _LONG_TAILED[cfg.dataset]
        return dist_in.draw(rng, n, cfg.input_len), dist_out.draw(rng, n, cfg.output_len)
    default_in, default_out = _DEFAULT_LENS[cfg.dataset]
    len_in, len_out = cfg.input_len or default_in, cfg.output_len or default_out
    if cfg.dataset == "random":
        r = cfg.range_ratio
        ins = rng.integers(max(1, int(len_in * (1 - r))), int(len_in * (1 + r)) + 1, n)
        outs = rng.integers(max(1, int(len_out * (1 - r))), int(len_out * (1 + r)) + 1, n)
        return ins, outs
    ins, outs = np.full(n, len_in), np.full(n, len_out)
    if cfg.dataset == "long-prompts":
        # Spread the short outputs so decodes finish (and new requests join) one by one, not in waves.
        r = cfg.range_ratio or 0.5
        outs = rng.integers(max(1, int(len_out * (1 - r))), int(len_out * (1 + r)) + 1, n)
        every = max(1, cfg.long_prompt_every)
        long = np.arange(n) % every == every // 2  # evenly spaced, none at the very start
        ins[long], outs[long] = cfg.long_prompt_len, cfg.long_prompt_output_len
    return ins, outs


def _prefix_requests(cfg: WorkloadConfig, rng: np.random.Generator) -> list[BenchRequest]:
    len_in, len_out = cfg.input_len or 32, cfg.output_len or 64
    prefixes = [rng.integers(FIRST_REGULAR_ID, cfg.vocab_size, cfg.prefix_len).tolist() for _ in range(cfg.num_groups)]
    return [BenchRequest(prefixes[i % cfg.num_groups] + rng.integers(FIRST_REGULAR_ID, cfg.vocab_size, len_in).tolist(),
                         len_out) for i in range(cfg.num_prompts)]


def _multi_turn_requests(cfg: WorkloadConfig, rng: np.random.Generator) -> list[BenchRequest]:
    len_in, len_out = cfg.input_len or 128, cfg.output_len or 64
    conversations = max(1, cfg.num_prompts // cfg.num_turns)
    requests: list[BenchRequest] = []
    for turn in range(cfg.num_turns):  # turn-major: every conversation's first turn is listed first
        for c in range(conversations):
            if turn == 0:
                requests.append(BenchRequest(rng.integers(FIRST_REGULAR_ID, cfg.vocab_size, len_in).tolist(), len_out))
            else:
                think = float(rng.exponential(cfg.think_time)) if cfg.think_time else 0.0
                requests.append(BenchRequest(rng.integers(FIRST_REGULAR_ID, cfg.vocab_size, cfg.turn_len).tolist(),
                                             len_out, follows=(turn - 1) * conversations + c, think_time=think))
    return requests


def _edit_snippet(module: str, min_tokens: int, count: Callable[[str], int]) -> tuple[str, str]:
    """(whole lines of the module's source from its first top-level def or class, about
    min_tokens tokens; the name that definition defines)."""
    source = Path(sysconfig.get_paths()["stdlib"], f"{module}.py").read_text(encoding="utf-8")
    lines = source.splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if re.match(r"(def|class) \w", line))
    name = re.match(r"(?:def|class) (\w+)", lines[first]).group(1)  # type: ignore[union-attr]
    end, tokens = first, 0
    while end < len(lines) and tokens < min_tokens:  # a chunk's tokens, near enough to its share of the whole
        tokens += count("".join(lines[end : end + 20]))
        end += 20
    return "".join(lines[first:end]), name


def _edit_requests(cfg: WorkloadConfig) -> list[BenchRequest]:
    if cfg.tokenizer is None:
        raise ConfigError("the edit dataset makes prompts of real text: pass the model's tokenizer (--tokenizer MODEL)")
    from conveyor.model.loader import load_tokenizer  # the model's tokenizer only, never its weights

    tokenizer = load_tokenizer(cfg.tokenizer)
    len_in = cfg.input_len or 384

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    requests = []
    for i in range(cfg.num_prompts):
        module = EDIT_MODULES[(i + cfg.seed * cfg.num_prompts) % len(EDIT_MODULES)]
        snippet, name = _edit_snippet(module, len_in, count)
        ask = (f"Rename `{name}` to `{name}_renamed` in this Python code. Reply with the whole code, changed in "
               f"that one place only, in a ```python block.\n\n```python\n{snippet}```")
        prompt = tokenizer.encode_messages([{"role": "user", "content": ask}])
        output_len = count(snippet) + 16  # the code back, with its fences
        requests.append(BenchRequest(prompt, min(output_len, cfg.output_len) if cfg.output_len else output_len))
    return requests


def _questions(modules: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(name, signature, the docstring's first paragraph) of each module's public functions with a
    docstring of a sentence or more, module by module, in name order."""
    import importlib
    import inspect

    found = []
    for module_name in modules:
        module = importlib.import_module(module_name)
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not inspect.isfunction(obj) or obj.__module__ != module_name or not obj.__doc__:
                continue
            summary = inspect.cleandoc(obj.__doc__).split("\n\n")[0]
            if len(summary) >= 40:
                found.append((name, str(inspect.signature(obj)), summary))
    return found


def _question_requests(cfg: WorkloadConfig) -> list[BenchRequest]:
    if cfg.tokenizer is None:
        raise ConfigError("the questions dataset makes prompts of real text: pass the model's tokenizer (--tokenizer MODEL)")
    from conveyor.model.loader import load_tokenizer  # the model's tokenizer only, never its weights

    tokenizer = load_tokenizer(cfg.tokenizer)
    questions = _questions(QUESTION_MODULES)
    requests = []
    for i in range(cfg.num_prompts):
        name, signature, summary = questions[(i + cfg.seed * cfg.num_prompts) % len(questions)]
        ask = (f"Write a Python function `{name}{signature}` that does this:\n\n{summary}\n\n"
               "Then explain briefly how it works.")
        requests.append(BenchRequest(tokenizer.encode_messages([{"role": "user", "content": ask}]), cfg.output_len or 256))
    return requests


def generate_requests(cfg: WorkloadConfig) -> list[BenchRequest]:
    """The workload's requests, first turns in arrival order; the same config always gives the same list."""
    rng = np.random.default_rng([cfg.seed, 0])
    if cfg.dataset == "prefix":
        return _prefix_requests(cfg, rng)
    if cfg.dataset == "multi-turn":
        return _multi_turn_requests(cfg, rng)
    if cfg.dataset == "edit":
        return _edit_requests(cfg)
    if cfg.dataset == "questions":
        return _question_requests(cfg)
    ins, outs = _lengths(cfg, rng)
    requests = []
    for n_in, n_out in zip(ins.tolist(), outs.tolist()):
        ids = rng.integers(FIRST_REGULAR_ID, cfg.vocab_size, n_in).tolist()
        requests.append(BenchRequest(ids, int(n_out)))
    return requests


RateSchedule = list[tuple[float, float]]  # (start second, requests/s from then on), by start


def parse_rate_schedule(text: str) -> RateSchedule:
    """'0:1,120:4,240:1' -> [(0, 1), (120, 4), (240, 1)]: 1 req/s from 0 s, 4 from 120 s, 1 from 240 s
    on (the last rate holds until every request has arrived)."""
    schedule = []
    for part in text.split(","):
        try:
            start, rate = (float(x) for x in part.split(":"))
        except ValueError:
            raise ConfigError(f"cannot read rate schedule {text!r}: use START_S:RATE,... e.g. 0:1,120:4,240:1") from None
        schedule.append((start, rate))
    if schedule[0][0] != 0 or any(b[0] <= a[0] for a, b in zip(schedule, schedule[1:])):
        raise ConfigError(f"rate schedule {text!r}: the first start must be 0 and starts must increase")
    if any(not 0 <= r < math.inf for _, r in schedule) or schedule[-1][1] <= 0:
        raise ConfigError(f"rate schedule {text!r}: rates must be finite, >= 0, and the last one positive")
    return schedule


def expected_arrivals(schedule: RateSchedule, until: float) -> float:
    """Requests a schedule sends on average in [0, until): its rate integrated over time."""
    total = 0.0
    for (start, rate), end in zip(schedule, [s for s, _ in schedule[1:]] + [math.inf]):
        total += rate * max(0.0, min(end, until) - start)
    return total


def _scheduled_times(num: int, schedule: RateSchedule, burstiness: float, seed: int) -> list[float]:
    # Time rescaling: gaps of mean 1 in "expected arrivals" units, mapped back through the
    # integrated rate, give a Poisson (gamma) process whose rate follows the schedule.
    rng = np.random.default_rng([seed, 1])
    gaps = np.ones(num) if math.isinf(burstiness) else rng.gamma(burstiness, 1.0 / burstiness, num)
    times, seg, done_before = [], 0, 0.0  # done_before: expected arrivals before segment `seg`
    ends = [s for s, _ in schedule[1:]] + [math.inf]
    for u in np.cumsum(gaps).tolist():
        while seg + 1 < len(schedule) and u > done_before + schedule[seg][1] * (ends[seg] - schedule[seg][0]):
            done_before += schedule[seg][1] * (ends[seg] - schedule[seg][0])
            seg += 1
        start, rate = schedule[seg]
        times.append(start + (u - done_before) / rate)
    return times


def arrival_times(num: int, request_rate: float, burstiness: float = 1.0, seed: int = 0,
                  schedule: RateSchedule | None = None) -> list[float]:
    """Seconds from the start at which each request is sent (vLLM's `get_request` schedule). With a
    `schedule` (see parse_rate_schedule) the rate follows it and `request_rate` is ignored."""
    if not burstiness > 0:  # NaN too
        raise ConfigError(f"burstiness must be positive, got {burstiness}")
    if schedule:
        return _scheduled_times(num, schedule, burstiness, seed)
    if not request_rate > 0:  # NaN too: it would never send anything
        raise ConfigError(f"the request rate must be positive (inf: all at once), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num
    if math.isinf(burstiness):
        gaps = np.full(num, 1.0 / request_rate)
    else:
        rng = np.random.default_rng([seed, 1])
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)
    times = np.cumsum(gaps)
    if times[-1] > 0:  # pin the total span to num / rate, as vLLM does, so throughput is comparable
        times *= (num / request_rate) / times[-1]
    return times.tolist()


def request_arrivals(requests: list[BenchRequest], request_rate: float, burstiness: float = 1.0, seed: int = 0,
                     schedule: RateSchedule | None = None) -> list[float]:
    """arrival_times for the requests that start a conversation (all but later turns, which get nan:
    their predecessor releases them)."""
    first = [i for i, r in enumerate(requests) if r.follows is None]
    times = arrival_times(len(first), request_rate, burstiness, seed, schedule)
    out = [math.nan] * len(requests)
    for i, t in zip(first, times):
        out[i] = t
    return out


def describe(requests: list[BenchRequest]) -> str:
    ins = np.array([r.prompt_len for r in requests])
    outs = np.array([r.output_len for r in requests])
    return (
        f"{len(requests)} requests; input mean {ins.mean():.0f} (p50 {np.median(ins):.0f}, max {ins.max()}), "
        f"output mean {outs.mean():.0f} (p50 {np.median(outs):.0f}, max {outs.max()})"
    )
