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
from dataclasses import dataclass

import numpy as np

from conveyor.errors import ConfigError

FIRST_REGULAR_ID = 10  # ids below are special tokens (<|endoftext|>, <|im_start|>, <|im_end|>, ...)
DATASETS = ("random", "uniform", "chat", "seed", "long-prompts")


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


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
    vocab_size: int = 49152
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"unknown dataset {self.dataset!r}; choose from {', '.join(DATASETS)}")
        if self.num_prompts < 1:
            raise ValueError("num_prompts must be positive")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError("range_ratio must be in [0, 1)")
        if self.vocab_size <= FIRST_REGULAR_ID:
            raise ValueError(f"vocab_size must exceed {FIRST_REGULAR_ID}")


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
_DEFAULT_LENS = {"random": (128, 128), "uniform": (128, 128), "long-prompts": (32, 128)}


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


def generate_requests(cfg: WorkloadConfig) -> list[BenchRequest]:
    """The workload's requests, in arrival order; the same config always gives the same list."""
    rng = np.random.default_rng([cfg.seed, 0])
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
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    if schedule:
        return _scheduled_times(num, schedule, burstiness, seed)
    if request_rate <= 0:
        raise ValueError("request_rate must be positive (use inf for all at once)")
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


def describe(requests: list[BenchRequest]) -> str:
    ins = np.array([r.prompt_len for r in requests])
    outs = np.array([r.output_len for r in requests])
    return (
        f"{len(requests)} requests; input mean {ins.mean():.0f} (p50 {np.median(ins):.0f}, max {ins.max()}), "
        f"output mean {outs.mean():.0f} (p50 {np.median(outs):.0f}, max {outs.max()})"
    )
