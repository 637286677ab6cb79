"""Speculative decoding against no speculation on one workload, in one process, alternating which
goes first round by round (a single pair of runs moves by ~20% on a shared 2-core machine).

Every run takes a fresh engine on the same loaded weights, warms it up, then serves the workload's
requests all at once (at most --max-num-seqs at a time) to the end; each request is seeded, so a
sampled run draws the same tokens with and without speculation.

    python benchmarks/speculation_rounds.py --model qwen2.5-coder-0.5b --dataset chat --num-prompts 16 \\
        --temperature 1.0 --rounds 4
    python benchmarks/speculation_rounds.py --model qwen2.5-coder-0.5b --dataset questions --until-eos \\
        --num-prompts 16 --temperature 0.7 --rounds 4

`--until-eos`: each request ends at the model's end of turn (its output length a cap), as a real
answer does, instead of running to its length with `ignore_eos`; the seeded draws make both runs
generate the same tokens, so their tok/s compare the same work.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from conveyor.bench.workloads import DATASETS, WorkloadConfig, generate_requests
from conveyor.config import EngineConfig, SpeculativeConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.runner.model_runner import LoadedModel, load_model
from conveyor.sampling.params import SamplingParams


def run(loaded: LoadedModel, args: argparse.Namespace, requests: list, spec: SpeculativeConfig | None) -> float:
    """Output tokens a second over the whole run."""
    engine = LLMEngine.from_config(EngineConfig.from_kwargs(
        model=args.model, num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        speculative_config=spec), loaded)
    engine.warm_up()
    for i, r in enumerate(requests):
        engine.add_request(r.prompt_token_ids, SamplingParams(max_tokens=r.output_len, temperature=args.temperature,
                                                              seed=i, ignore_eos=not args.until_eos))
    started, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests:
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - started)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--dataset", default="chat", choices=DATASETS)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: --num-prompts")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--until-eos", action="store_true", help="requests end at the model's end of turn (a cap, not a length)")
    p.add_argument("--num-kv-blocks", type=int, default=4096)
    p.add_argument("--speculative-config", type=SpeculativeConfig.parse, default=SpeculativeConfig(),
                   help='a JSON object, as `conveyor serve` takes it (default: {"method": "ngram"})')
    args = p.parse_args()
    args.max_num_seqs = args.max_num_seqs or args.num_prompts
    loaded = load_model(EngineConfig(model=args.model))
    requests = generate_requests(WorkloadConfig(dataset=args.dataset, num_prompts=args.num_prompts,
                                                vocab_size=loaded.model.cfg.vocab_size, tokenizer=args.model))
    ratios = []
    for i in range(args.rounds):
        order = [None, args.speculative_config] if i % 2 == 0 else [args.speculative_config, None]
        rates = {json.dumps(spec is not None): run(loaded, args, requests, spec) for spec in order}
        plain, speculating = rates["false"], rates["true"]
        ratios.append(speculating / plain)
        first = "plain" if i % 2 == 0 else "speculating"
        print(f"round {i + 1} ({first} first): without {plain:.1f} tok/s, with {speculating:.1f} tok/s, "
              f"ratio {speculating / plain:.3f}", flush=True)
    print(f"{args.model} {args.dataset} x{args.num_prompts}, temperature {args.temperature}: ratio min "
          f"{min(ratios):.3f}, median {statistics.median(ratios):.3f}, max {max(ratios):.3f}")


if __name__ == "__main__":
    main()
