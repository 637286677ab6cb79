#!/usr/bin/env python
"""Hugging Face transformers against conveyor, on the same requests, in one process, one after another.

    .venv/bin/python benchmarks/peers/hf_transformers.py --dataset chat --num-prompts 32

Every engine gets exactly the requests `conveyor bench serve` would send (conveyor.bench.workloads:
token-id prompts and output lengths, EOS ignored), all arriving at once, greedy, fp32, the same
weights (the GGUF dequantised and written as an HF folder by `conveyor export-hf`):

- `hf-static`: `model.generate` on consecutive batches of `--batch-size` requests, left-padded, with
  min_new_tokens = max_new_tokens = the longest output in the batch. That *is* static batching: each
  batch runs until its longest member is done, and shorter members' extra tokens are thrown away.
- `hf-cb`: transformers' own continuous batching (`continuous_batching_context_manager`, the engine
  behind `generate_batch`) with one request per prompt and its own max_new_tokens and no EOS, and an
  explicit KV budget (`--kv-cache-memory`, turned into num_blocks), max batch tokens and requests per
  batch (left alone it sizes its cache from ~90% of free RAM).
- `conveyor`: the offline engine (continuous batching, chunked prefill), `--max-num-seqs`.

Output tok/s counts only the tokens each request asked for (static batching's padding work is not
credited). The table ends with conveyor/peer ratios. transformers is installed in conveyor's venv
(test extra); nothing else is needed. Figures from a shared 2-core machine are noisy: compare ratios
from one run, not numbers across runs.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from conveyor.bench.workloads import DATASETS, BenchRequest, WorkloadConfig, describe, generate_requests

MODES = ("hf-static", "hf-cb", "conveyor")


@dataclass
class Result:
    engine: str
    duration_s: float
    output_tokens: int  # the tokens the requests asked for
    computed_tokens: int  # decode tokens actually computed (static: batch x longest, per batch)
    notes: str = ""
    first_tokens: list[list[int]] = field(default_factory=list, repr=False)  # per request, for a sanity check
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dataset", default="chat", choices=DATASETS)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=32, help="conveyor's and hf-cb's most requests per step")
    p.add_argument("--batch-size", type=int, default=None, help="hf-static batch size (default: --max-num-seqs)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="conveyor's token budget per step, and hf-cb's max_batch_tokens")
    p.add_argument("--kv-cache-memory", default="1GiB", help="KV cache of conveyor and of hf-cb")
    p.add_argument("--cb-page-size", type=int, default=256, help="hf-cb page size (tokens)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--model", default=None, help="what to export (default: the shipped GGUF)")
    p.add_argument("--hf-dir", default=None,
                   help="an exported HF folder to use (default: export into a temporary folder)")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: one per core)")
    p.add_argument("--save-result", default=None, metavar="FILE", help="write the figures as JSON")
    args = p.parse_args(argv)
    args.batch_size = args.batch_size or args.max_num_seqs
    return args


def export_folder(args: argparse.Namespace) -> tuple[Path, tempfile.TemporaryDirectory | None]:
    if args.hf_dir and (Path(args.hf_dir) / "config.json").is_file():
        return Path(args.hf_dir), None
    from conveyor.model.export import export_model

    holder = None
    target = args.hf_dir
    if target is None:
        holder = tempfile.TemporaryDirectory(prefix="conveyor-hf-")
        target = holder.name
    start = time.perf_counter()
    folder = export_model(args.model, target, torch.float32)
    print(f"exported {args.model or 'the default model'} to {folder} in {time.perf_counter() - start:.1f} s")
    return folder, holder


def load_hf(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()


@torch.inference_mode()
def run_hf_static(model: Any, requests: list[BenchRequest], batch_size: int, pad_id: int) -> Result:
    def batch_inputs(batch: list[BenchRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(r.prompt_len for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding, so every row's last position is its last prompt token
            ids[i, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
            mask[i, width - r.prompt_len:] = 1
        return ids, mask

    def generate(batch: list[BenchRequest]) -> torch.Tensor:
        ids, mask = batch_inputs(batch)
        longest = max(r.output_len for r in batch)
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
                             min_new_tokens=longest, pad_token_id=pad_id)
        assert out.shape[1] == ids.shape[1] + longest, (out.shape, ids.shape, longest)
        return out[:, ids.shape[1]:]

    generate([BenchRequest(r.prompt_token_ids[:16], 4) for r in requests[:2]])  # warm-up
    first: list[list[int]] = []
    computed = 0
    start = time.perf_counter()
    for b in range(0, len(requests), batch_size):
        batch = requests[b:b + batch_size]
        new = generate(batch)
        computed += new.numel()
        first += [new[i, :r.output_len].tolist() for i, r in enumerate(batch)]
        done = min(b + batch_size, len(requests))
        print(f"  hf-static: {done}/{len(requests)} requests, {time.perf_counter() - start:.0f} s", flush=True)
    duration = time.perf_counter() - start
    return Result("hf-static", duration, sum(r.output_len for r in requests), computed,
                  notes=f"generate, batches of {batch_size}, left padding", first_tokens=first)


@torch.inference_mode()
def run_hf_cb(model: Any, requests: list[BenchRequest], args: argparse.Namespace, pad_id: int) -> Result:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from conveyor.config import parse_memory

    cfg = model.config
    bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # fp32 K and V
    num_blocks = max(1, parse_memory(args.kv_cache_memory) // (bytes_per_token * args.cb_page_size))
    cb_config = ContinuousBatchingConfig(
        page_size=args.cb_page_size, num_blocks=num_blocks, max_batch_tokens=args.max_num_batched_tokens,
        max_requests_per_batch=args.max_num_seqs, max_memory_percent=0.5,
    )
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in requests),
                                  eos_token_id=-1, pad_token_id=pad_id)
    with model.continuous_batching_context_manager(generation_config=gen_config,
                                                   continuous_batching_config=cb_config) as manager:
        def run(batch: list[BenchRequest], tag: str) -> dict[str, Any]:
            ids = [manager.add_request(r.prompt_token_ids, request_id=f"{tag}{i}", max_new_tokens=r.output_len,
                                       eos_token_id=-1) for i, r in enumerate(batch)]
            done: dict[str, Any] = {}
            while len(done) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    done[result.request_id] = result
                    if tag == "r" and len(done) % 8 == 0:
                        print(f"  hf-cb: {len(done)}/{len(ids)} requests, {time.perf_counter() - start:.0f} s",
                              flush=True)
                elif result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread died")
            return {i: done[i] for i in ids}

        start = time.perf_counter()
        run([BenchRequest(r.prompt_token_ids[:16], 4) for r in requests[:2]], "warmup")
        start = time.perf_counter()
        results = run(requests, "r")
        duration = time.perf_counter() - start
    outs = [results[f"r{i}"] for i in range(len(requests))]
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"hf-cb: {len(errors)} requests failed, first: {errors[0]}")
    got = [len(o.generated_tokens) for o in outs]
    assert got == [r.output_len for r in requests], "hf-cb did not generate the requested lengths"
    return Result("hf-cb", duration, sum(got), sum(got),
                  notes=f"continuous batching, {num_blocks} blocks x {args.cb_page_size}, "
                        f"max_batch_tokens {args.max_num_batched_tokens}, {args.max_num_seqs} req/batch",
                  first_tokens=[list(o.generated_tokens) for o in outs])


def run_conveyor(folder: Path, requests: list[BenchRequest], args: argparse.Namespace) -> Result:
    from conveyor.bench.metrics import compute_metrics
    from conveyor.bench.offline import record_from_times
    from conveyor.config import EngineConfig
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.sampling.params import SamplingParams

    config = EngineConfig.from_kwargs(
        model=str(folder), dtype="float32", policy="continuous", max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, chunked_prefill=True,
        kv_cache_memory=args.kv_cache_memory, num_threads=args.num_threads,
    )
    engine = LLMEngine.from_config(config)
    engine.warm_up()
    outputs: dict[str, Any] = {}
    start = engine.clock()
    for i, r in enumerate(requests):
        engine.add_request(r.prompt_token_ids, SamplingParams(max_tokens=r.output_len, temperature=0.0,
                                                              ignore_eos=True), request_id=str(i), arrival_time=start)
    steps = 0
    while engine.has_unfinished_requests:
        for o in engine.step():
            if o.finished:
                outputs[o.request_id] = o
                if len(outputs) % 8 == 0:
                    print(f"  conveyor: {len(outputs)}/{len(requests)} requests, {engine.clock() - start:.0f} s",
                          flush=True)
        steps += 1
    outs = [outputs[str(i)] for i in range(len(requests))]
    records = [record_from_times(r.prompt_len, o.times, start) for r, o in zip(requests, outs)]
    duration = max(rec.start + rec.latency for rec in records)
    metrics = compute_metrics(records, duration)
    got = [len(o.token_ids) for o in outs]
    assert got == [r.output_len for r in requests], "conveyor did not generate the requested lengths"
    return Result("conveyor", duration, sum(got), sum(got),
                  notes=f"continuous + chunked prefill, max_num_seqs {args.max_num_seqs}, {steps} steps",
                  first_tokens=[list(o.token_ids) for o in outs],
                  extra={"mean_ttft_ms": metrics.stats["ttft"].mean, "mean_tpot_ms": metrics.stats["tpot"].mean,
                         "preemptions": engine.scheduler.num_preemptions})


def agreement(a: Result, b: Result, prefix: int = 32) -> str:
    """How many requests' first `prefix` greedy tokens agree (a check that both ran the same model)."""
    same = sum(x[:prefix] == y[:prefix] for x, y in zip(a.first_tokens, b.first_tokens))
    return f"{same}/{len(a.first_tokens)}"


def format_table(results: list[Result]) -> str:
    ours = next((r for r in results if r.engine == "conveyor"), None)
    head = f"{'engine':<10} {'duration s':>10} {'out tokens':>10} {'computed':>9} {'out tok/s':>9} {'conveyor/x':>10}" \
           f" {'same 32 tok':>11}  notes"
    lines = [head, "-" * len(head)]
    for r in results:
        ratio = "-" if ours is None else f"{ours.output_throughput / r.output_throughput:.2f}x"
        agree = "-" if ours is None or r is ours else agreement(ours, r)
        lines.append(f"{r.engine:<10} {r.duration_s:>10.1f} {r.output_tokens:>10} {r.computed_tokens:>9} "
                     f"{r.output_throughput:>9.1f} {ratio:>10} {agree:>11}  {r.notes}")
    return "\n".join(lines)


def _load() -> str:
    """The 1-minute load average: other processes on the cores make every figure here erratic."""
    return f"load average {os.getloadavg()[0]:.2f}, this run adds ~{torch.get_num_threads()}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.num_threads or os.cpu_count() or 1)
    folder, holder = export_folder(args)
    try:
        workload = WorkloadConfig(dataset=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len,
                                  output_len=args.output_len, seed=args.seed)
        requests = generate_requests(workload)
        print(f"workload {args.dataset}: {describe(requests)}")
        print(f"fp32, greedy, EOS ignored, all requests at t=0, {torch.get_num_threads()} torch threads")
        pad_id = int(json.loads((folder / "generation_config.json").read_text()).get("pad_token_id") or 0)
        results: list[Result] = []
        hf_modes = [m for m in args.modes if m.startswith("hf-")]
        if hf_modes:
            model = load_hf(folder)
            for mode in hf_modes:
                print(f"running {mode} ...", flush=True)
                if mode == "hf-static":
                    results.append(run_hf_static(model, requests, args.batch_size, pad_id))
                else:
                    results.append(run_hf_cb(model, requests, args, pad_id))
                print(f"  {mode}: {results[-1].output_throughput:.1f} output tok/s ({_load()})", flush=True)
            del model
            gc.collect()
        if "conveyor" in args.modes:
            print("running conveyor ...", flush=True)
            results.append(run_conveyor(folder, requests, args))
            print(f"  conveyor: {results[-1].output_throughput:.1f} output tok/s ({_load()})", flush=True)
        table = format_table(results)
        print()
        print(table)
        if args.save_result:
            path = Path(args.save_result)
            path.parent.mkdir(parents=True, exist_ok=True)
            rows = [{**{k: v for k, v in asdict(r).items() if k != "first_tokens"},
                     "output_throughput": r.output_throughput} for r in results]
            path.write_text(json.dumps({"args": {k: (None if isinstance(v, float) and math.isinf(v) else v)
                                                 for k, v in vars(args).items()},
                                        "workload": describe(requests), "results": rows, "table": table}, indent=1))
            print(f"saved {path}")
    finally:
        if holder is not None:
            holder.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
