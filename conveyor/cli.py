"""Command line: `conveyor serve` starts the OpenAI-compatible server; `conveyor generate` runs
prompts through the offline engine; `conveyor export-hf` writes the model as an HF folder."""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's knobs, named as vLLM names them."""
    parser.add_argument("--model", default=None, help="smollm2-135m (default), gemma3-270m, a .gguf file or an HF folder")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--dequantize-weights", action="store_true",
                        help="stream dense fp32 weights even where the GGUF has Q4_1/Q8_0 blocks (same results, slower)")
    parser.add_argument("--policy", default="continuous", choices=["continuous", "static"])
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--slo-tpot-ms", type=float, default=None,
                        help="hold P99 TPOT under this: a controller lowers the batch cap and token budget "
                             "under --max-num-seqs / --max-num-batched-tokens as load requires")
    parser.add_argument("--slo-ttft-ms", type=float, default=None,
                        help="TTFT target: misses are counted in /metrics (conveyor:slo_ttft_misses_total)")
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch threads (default: one per core; 1 is faster when other processes share the cores)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype,
        dequantize_weights=args.dequantize_weights,
        policy=args.policy,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        chunked_prefill=args.chunked_prefill,
        slo_tpot_ms=args.slo_tpot_ms,
        slo_ttft_ms=args.slo_ttft_ms,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        seed=args.seed,
        num_threads=args.num_threads,
    )


def _generate(args: argparse.Namespace) -> int:
    from conveyor import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sample_seed,
        stop=args.stop or [],
        ignore_eos=args.ignore_eos,
    )
    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(args.prompts or prompts, outputs):
        print(f"### {prompt!r}\n{out.text}\n[finish: {out.finish_reason}, {len(out.token_ids)} tokens]\n")
    generated = sum(len(o.token_ids) for o in outputs)
    print(f"{len(outputs)} requests, {generated} tokens in {elapsed:.2f} s: {generated / elapsed:.1f} output tok/s")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from conveyor.api.server import run_server
    from conveyor.config import EngineConfig
    from conveyor.distributed.deploy import DeploymentConfig

    model = args.model_path or args.model
    config = EngineConfig.from_kwargs(model=model, **engine_kwargs(args))
    names = args.served_model_name or [model or "smollm2-135m"]
    return run_server(
        config,
        host=args.host,
        port=args.port,
        served_model_names=names,
        api_key=args.api_key or None,
        max_waiting_requests=args.max_waiting_requests,
        shutdown_grace_s=args.shutdown_timeout,
        log_level=args.log_level,
        deployment=DeploymentConfig(args.replicas, args.prefill_workers, args.decode_workers, args.ray_address,
                                    args.worker_cpus),
    )


def _add_serve_parser(commands: argparse._SubParsersAction) -> None:
    srv = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API (completions, chat, metrics)")
    srv.add_argument("model_path", nargs="?", default=None, metavar="MODEL", help="same as --model")
    add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--max-waiting-requests", type=int, default=256,
                     help="bound of the waiting queue; beyond it requests get 503 with Retry-After")
    srv.add_argument("--api-key", default=os.environ.get("CONVEYOR_API_KEY"),
                     help="require 'Authorization: Bearer KEY' on /v1/* (default: $CONVEYOR_API_KEY)")
    srv.add_argument("--served-model-name", action="append", default=None,
                     help="model name(s) clients use (repeatable; default: the model argument)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds in-flight requests get to finish after SIGTERM")
    srv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ray = srv.add_argument_group("scale-out on Ray (see README: Scaling out)")
    ray.add_argument("--replicas", type=int, default=1, help="engine replicas as Ray actors behind this front end")
    ray.add_argument("--prefill-workers", type=int, default=0, help="prefill workers (disaggregated serving)")
    ray.add_argument("--decode-workers", type=int, default=0, help="decode workers (disaggregated serving)")
    ray.add_argument("--ray-address", default=None,
                     help="join an existing Ray cluster ('auto' or host:port) instead of starting a local one")
    ray.add_argument("--worker-cpus", type=float, default=1.0, help="CPUs Ray reserves per worker")
    srv.set_defaults(func=_serve)


def _export_hf(args: argparse.Namespace) -> int:
    import torch

    from conveyor.model.export import export_model

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    folder = export_model(args.model, args.out_dir, dtype)
    print(f"wrote an HF checkpoint ({args.dtype}) to {folder}")
    return 0


def _add_export_parser(commands: argparse._SubParsersAction) -> None:
    exp = commands.add_parser("export-hf", help="write the model (e.g. the dequantised GGUF) as an HF folder")
    exp.add_argument("out_dir", metavar="OUT_DIR", help="folder to write (created; files in it are overwritten)")
    exp.add_argument("--model", default=None, help="smollm2-135m (default), gemma3-270m, a .gguf file or an HF folder")
    exp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    exp.set_defaults(func=_export_hf)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="conveyor", description="LLM serving with continuous batching")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="run prompts offline and print the completions")
    add_engine_args(gen)
    gen.add_argument("prompts", nargs="*", help="prompts (default: one per line on stdin)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sample-seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.set_defaults(func=_generate)
    _add_serve_parser(commands)
    _add_export_parser(commands)
    from conveyor.bench.cli import add_bench_parser

    add_bench_parser(commands)
    from conveyor.sim.cli import add_simulate_parser

    add_simulate_parser(commands)

    args = parser.parse_args(argv)
    from conveyor.errors import ConveyorError

    try:
        return args.func(args)
    except ConveyorError as exc:
        print(f"conveyor: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
