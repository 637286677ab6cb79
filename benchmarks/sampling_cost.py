"""What sampling settings cost a decode step: output tok/s of the same requests served greedily, at a
temperature, and with the truncations clients send (top-p, top-k, min-p, and the defaults of
llama.cpp's server and of Qwen2.5's generation_config), in one process, rotating which goes first
round by round; each figure is the median over rounds, with its ratio to plain temperature. The
prompts are chat questions in the model's template (`--random-prompts`: random token ids, whose
flat next-token distributions make the widest nuclei).

    python benchmarks/sampling_cost.py --model qwen2.5-coder-0.5b --rows 1 16 --rounds 3

A revision without this script is measured by running this one on that revision's package:
`PYTHONPATH=<worktree of the revision> python benchmarks/sampling_cost.py ...`.
"""
from __future__ import annotations

import argparse
import statistics
import time

from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.runner.model_runner import LoadedModel, load_model
from conveyor.sampling.params import SamplingParams

QUESTIONS = [
    "Write a Python function that parses a CSV file and returns the rows as dictionaries.",
    "Explain the difference between a process and a thread.",
    "Tell me a short story about a lighthouse keeper.",
    "How do I reverse a linked list in C?",
    "What should I pack for a week of hiking in the mountains?",
    "Write a SQL query that finds the ten customers who spent the most last year.",
    "Why is the sky blue?",
    "Give me three ideas for a birthday party for a seven-year-old.",
]

LLAMA_CPP_CHAIN = ("top_k", "top_p", "min_p", "temperature")  # llama.cpp's order (its API's `samplers`)

SETTINGS: dict[str, dict[str, float | int | tuple[str, ...]]] = {
    "greedy": dict(temperature=0.0),
    "temperature 0.8": dict(temperature=0.8),
    "top_p 0.95": dict(temperature=0.8, top_p=0.95),
    "top_k 40": dict(temperature=0.8, top_k=40),
    "llama.cpp defaults": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "Qwen2.5 generation_config": dict(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05),
    # llama.cpp's /completion: its defaults in its order, and with top_k 0 (off), which some clients send
    "llama.cpp chain": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, sampler_chain=LLAMA_CPP_CHAIN),
    "llama.cpp chain, top_k 0": dict(temperature=0.8, top_p=0.95, min_p=0.05, sampler_chain=LLAMA_CPP_CHAIN),
}


def prompts(loaded: LoadedModel, args: argparse.Namespace, rows: int) -> list[list[int]]:
    if args.random_prompts:
        ids = list(range(1000, 1000 + args.prompt_len))
        return [ids[i:] + ids[:i] for i in range(rows)]
    texts = [loaded.tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                                  add_generation_prompt=True) for i in range(rows)]
    return [loaded.tokenizer.encode(text) for text in texts]


def run(loaded: LoadedModel, args: argparse.Namespace, rows: int, setting: dict[str, float | int]) -> float:
    """Output tokens a second of `rows` requests served at once to their end."""
    engine = LLMEngine.from_config(EngineConfig.from_kwargs(model=args.model, max_num_seqs=rows,
                                                            num_kv_blocks=args.num_kv_blocks), loaded)
    engine.warm_up()
    for i, prompt in enumerate(prompts(loaded, args, rows)):
        engine.add_request(prompt, SamplingParams(max_tokens=args.output_len, ignore_eos=True,
                                                                   seed=i, **setting))  # type: ignore[arg-type]
    while engine.has_unfinished_requests and not any(o.new_token_ids for o in engine.step()):
        pass  # prefill: not what is measured
    started, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests:
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - started)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--random-prompts", action="store_true")
    p.add_argument("--prompt-len", type=int, default=64, help="with --random-prompts")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS), metavar="NAME",
                   help=f"of: {', '.join(SETTINGS)} (default: all)")
    args = p.parse_args()
    loaded = load_model(EngineConfig(model=args.model))
    names = ["temperature 0.8"] + [name for name in args.settings if name != "temperature 0.8"]
    for rows in args.rows:
        rates: dict[str, list[float]] = {name: [] for name in names}
        for i in range(args.rounds):
            for name in names[i % len(names):] + names[: i % len(names)]:
                rates[name].append(run(loaded, args, rows, SETTINGS[name]))
        plain = statistics.median(rates["temperature 0.8"])
        kind = "random-token prompts" if args.random_prompts else "chat prompts"
        print(f"{args.model}, {rows} row(s), {kind}, {args.output_len} tokens each, {args.rounds} rounds")
        print(f"  {'setting':28s} {'tok/s median':>12s} {'min':>7s} {'max':>7s} {'vs temperature':>15s}")
        for name in names:
            median = statistics.median(rates[name])
            print(f"  {name:28s} {median:12.1f} {min(rates[name]):7.1f} {max(rates[name]):7.1f} {median / plain:14.2f}x")


if __name__ == "__main__":
    main()
