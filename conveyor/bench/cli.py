"""`conveyor bench serve|compare|roofline|steps`: argument parsing (imports nothing heavy)."""
from __future__ import annotations

import argparse
import json
import math

from conveyor.bench.compare import CompareConfig
from conveyor.bench.workloads import DATASETS
from conveyor.config import ACTIVATION_DTYPES, EngineConfig, SchedulerConfig
from conveyor.options import add_config_args, int_at_least


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (see conveyor/bench/workloads.py for the distributions)")
    g.add_argument("--dataset", "--dataset-name", dest="dataset", default="random", choices=DATASETS)
    g.add_argument("--num-prompts", type=int, default=100)
    # vLLM's bench spells the random dataset's three --random-input-len, --random-output-len, --random-range-ratio.
    g.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=None,
                   help="prompt length (random/uniform/long-prompts) or its mean (chat/seed)")
    g.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=None,
                   help="output length (random/uniform/long-prompts) or its mean (chat/seed)")
    g.add_argument("--range-ratio", "--random-range-ratio", dest="range_ratio", type=float, default=0.0,
                   help="random: lengths uniform in L x [1-r, 1+r]")
    g.add_argument("--long-prompt-len", type=int, default=1024, help="long-prompts: the long prompts' length")
    g.add_argument("--long-prompt-every", type=int, default=8, help="long-prompts: one long prompt every N requests")
    g.add_argument("--long-prompt-output-len", type=int, default=16)
    g.add_argument("--num-groups", type=int, default=16, help="prefix: groups of requests sharing a prefix")
    g.add_argument("--prefix-len", type=int, default=1024, help="prefix: the shared prefix's length")
    g.add_argument("--num-turns", type=int, default=6, help="multi-turn: turns per conversation")
    g.add_argument("--turn-len", type=int, default=32, help="multi-turn: new user tokens per later turn")
    g.add_argument("--think-time", type=float, default=1.0, help="multi-turn: mean seconds between turns")
    g.add_argument("--seed", type=int, default=0, help="seeds the lengths, token ids and arrival times")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival gaps: 1 = Poisson, < 1 burstier, > 1 more regular")
    g.add_argument("--rate-schedule", default=None, metavar="S:R,...", type=_rate_schedule,
                   help="piecewise request rates by time, e.g. 0:1,120:4,240:1 (1 req/s from 0 s, 4 from 120 s, "
                        "1 from 240 s on); overrides --request-rate")
    m = p.add_argument_group("metrics")
    m.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. --goodput ttft:2000 tpot:200 (keys ttft, tpot, e2el)")
    m.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    m.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")


def _rate_schedule(text: str) -> str:
    from conveyor.bench.workloads import parse_rate_schedule

    try:
        parse_rate_schedule(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The in-process engine's model options (compare, roofline)."""
    add_config_args(p, EngineConfig, only=("model", "dtype", "dequantize_weights", "kv_cache_dtype", "num_threads"))


def _workload(args: argparse.Namespace, vocab_size: int = 49152):  # noqa: ANN202 - WorkloadConfig
    from conveyor.bench.workloads import WorkloadConfig

    return WorkloadConfig(
        dataset=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, long_prompt_len=args.long_prompt_len,
        long_prompt_every=args.long_prompt_every, long_prompt_output_len=args.long_prompt_output_len,
        num_groups=args.num_groups, prefix_len=args.prefix_len, num_turns=args.num_turns, turn_len=args.turn_len,
        think_time=args.think_time,
        vocab_size=vocab_size, seed=args.seed, tokenizer=getattr(args, "tokenizer", None),
    )


def _run_serve(args: argparse.Namespace) -> int:
    from conveyor.bench.metrics import parse_goodput, parse_selection
    from conveyor.bench.serve_client import ServeConfig, main

    selected, percentiles = parse_selection(args.percentile_metrics, args.metric_percentiles)
    cfg = ServeConfig(
        model=args.model, workload=_workload(args, args.vocab_size),
        base_url=args.base_url or f"http://{args.host}:{args.port}", endpoint=args.endpoint,
        request_rate=args.request_rate, burstiness=args.burstiness, rate_schedule=args.rate_schedule,
        max_concurrency=args.max_concurrency,
        goodput=parse_goodput(args.goodput), selected_metrics=selected, percentiles=percentiles,
        save_result=args.save_result, disable_tqdm=args.disable_tqdm, ready_timeout_s=args.ready_timeout,
        label=args.label, extra_body=_extra_body(args.extra_body),
    )
    if args.api_key:
        cfg.api_key = args.api_key
    return main(cfg)


def _extra_body(text: str | None) -> dict:
    if text is None:
        return {}
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"conveyor bench serve: --extra-body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise SystemExit("conveyor bench serve: --extra-body must be a JSON object")
    return body


def _run_compare(args: argparse.Namespace) -> int:
    from conveyor.bench.compare import CompareConfig, main
    from conveyor.bench.metrics import parse_goodput, parse_selection

    _, percentiles = parse_selection(None, args.metric_percentiles)
    cfg = CompareConfig(
        workload=_workload(args), request_rates=args.request_rate, burstiness=args.burstiness,
        rate_schedule=args.rate_schedule, slo_tpot_ms=args.slo_tpot_ms,
        policies=args.policies, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        chunk_size=args.chunk_size, kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching, speculative_config=args.speculative_config,
        model=args.model, dtype=args.dtype, dequantize_weights=args.dequantize_weights, kv_cache_dtype=args.kv_cache_dtype,
        num_threads=args.num_threads,
        output_dir=args.output_dir,
        percentiles=percentiles,
        goodput=parse_goodput(args.goodput), warmup=not args.no_warmup, plots=not args.no_plots,
        progress=not args.disable_tqdm,
    )
    return main(cfg)


def _run_roofline(args: argparse.Namespace) -> int:
    from pathlib import Path

    from conveyor.bench.roofline import report, run_roofline, save
    from conveyor.config import EngineConfig
    from conveyor.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_config(EngineConfig.from_kwargs(
        model=args.model, dtype=args.dtype, dequantize_weights=args.dequantize_weights, kv_cache_dtype=args.kv_cache_dtype,
        num_threads=args.num_threads,
        max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=max(2048, args.context * max(args.batch_sizes)),
    ))
    result = run_roofline(engine, sorted(args.batch_sizes), args.context, args.steps)
    print(report(result))
    save(result, Path(args.output_dir))
    print(f"wrote {args.output_dir}/roofline.json and roofline.png")
    return 0


def _run_quality(args: argparse.Namespace) -> int:
    import numpy as np

    from conveyor.bench.quality import half_weights_in_bf16, report, run_quality
    from conveyor.config import EngineConfig
    from conveyor.model.linear import bf16_tiles_available
    from conveyor.runner.model_runner import load_model

    loaded = load_model(EngineConfig(model=args.model, num_threads=args.num_threads))
    kv_dtype = np.dtype(args.kv_cache_dtype)
    if args.activation_dtype == "float32" and kv_dtype == np.float32:
        raise SystemExit("bench quality: float32 activations with a float32 KV cache is the reference itself")
    if args.prompt_tiles and (args.activation_dtype != "int8" or not bf16_tiles_available()):
        raise SystemExit("bench quality --prompt-tiles: needs int8 activations and a CPU with AMX-BF16 tiles")
    results = run_quality(loaded.model, loaded.tokenizer, args.activation_dtype, args.max_tokens, args.window, kv_dtype,
                          args.prompt_tiles)
    print(report(args.model or "smollm2-135m", args.activation_dtype, results, kv_dtype, args.prompt_tiles,
                 half_weights_in_bf16(loaded.model, args.activation_dtype)))
    return 0


def _run_steps(args: argparse.Namespace) -> int:
    from conveyor.bench.steps import StepsConfig, load_hf_reference, run_steps
    from conveyor.config import EngineConfig
    from conveyor.engine.llm_engine import LLMEngine

    cfg = StepsConfig(batch_sizes=args.batch_sizes, contexts=args.contexts, steps=args.steps, repeats=args.repeats,
                      hf=args.hf, activation_dtypes=args.activation_dtypes or [], prefill=args.prefill)
    longest = max(max(cfg.batch_sizes) * max(cfg.contexts), cfg.prefill)
    engine = LLMEngine.from_config(EngineConfig.from_kwargs(
        model=args.model, dtype=args.dtype, dequantize_weights=args.dequantize_weights, kv_cache_dtype=args.kv_cache_dtype,
        num_threads=args.num_threads,
        max_num_seqs=max(cfg.batch_sizes), max_num_batched_tokens=max(args.max_num_batched_tokens, min(longest, 8192)),
    ))
    run_steps(engine, cfg, load_hf_reference(args.dtype) if cfg.hf else None)
    return 0


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmarks: load a server, or compare scheduling policies in-process")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    srv = sub.add_parser("serve", help="load an OpenAI-compatible server and report vLLM's serving metrics")
    srv.add_argument("--base-url", default=None,
                     help="the server's address (default: http://HOST:PORT, as vLLM's bench makes it)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--endpoint", default="/v1/completions")
    srv.add_argument("--model", required=True, help="the model name the server serves")
    srv.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf sends all at once")
    srv.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    srv.add_argument("--vocab-size", type=int, default=49152, help="prompt token ids are drawn below this")
    srv.add_argument("--tokenizer", default=None, metavar="MODEL",
                     help="edit and questions datasets: the served model (a conveyor model name or its .gguf / HF folder), "
                          "whose tokenizer and chat template make the prompts")
    srv.add_argument("--api-key", default=None,
                     help="bearer token, sent to the server (default: $CONVEYOR_API_KEY, else $OPENAI_API_KEY)")
    srv.add_argument("--save-result", default=None, metavar="FILE", help="write the result JSON here")
    srv.add_argument("--label", default="conveyor-bench")
    srv.add_argument("--ready-timeout", type=float, default=60.0,
                     help="seconds to wait for GET /v1/models to answer before starting (0: no check)")
    srv.add_argument("--disable-tqdm", action="store_true")
    srv.add_argument("--extra-body", default=None, metavar="JSON",
                     help="fields merged into every request body (e.g. a peer server's own options)")
    _add_workload_args(srv)
    srv.set_defaults(func=_run_serve)

    cmp = sub.add_parser("compare", help="run the engine in-process under several policies and request rates")
    _add_model_args(cmp)
    cmp.add_argument("--request-rate", type=float, nargs="+", default=[math.inf], metavar="R",
                     help="one or more rates (req/s); inf = all at once")
    cmp.add_argument("--policies", nargs="+", default=["static", "continuous-naive", "continuous-chunked"],
                     choices=["static", "continuous", "continuous-naive", "continuous-chunked", "continuous-slo",
                              "continuous-spec"])
    cmp.add_argument("--slo-tpot-ms", type=float, default=None, help="the TPOT target of the continuous-slo policy")
    add_config_args(cmp, CompareConfig, only=("max_num_seqs", "max_num_batched_tokens", "chunk_size",
                                              "kv_cache_memory", "block_size", "enable_prefix_caching",
                                              "speculative_config"), helps={
        "max_num_batched_tokens": "token budget per step of static, continuous and (at least) continuous-naive",
        "speculative_config": "continuous-spec's speculative decoding, a JSON object (default: n-gram lookup, "
                              "the engine's defaults)",
        "chunk_size": "token budget per step of continuous-chunked"})
    cmp.add_argument("--output-dir", default="out/compare")
    cmp.add_argument("--no-plots", action="store_true")
    cmp.add_argument("--no-warmup", action="store_true")
    cmp.add_argument("--disable-tqdm", action="store_true")
    _add_workload_args(cmp)
    cmp.set_defaults(func=_run_compare)

    roof = sub.add_parser("roofline", help="measure bandwidth and FLOPS, predict and find the decode batch knee")
    _add_model_args(roof)
    roof.add_argument("--batch-sizes", type=int_at_least(1), nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    roof.add_argument("--context", type=int_at_least(1), default=128, help="tokens of context each request decodes at")
    roof.add_argument("--steps", type=int_at_least(1), default=8, help="timed decode steps per batch size (median)")
    roof.add_argument("--output-dir", default="out/roofline")
    roof.set_defaults(func=_run_roofline)

    quality = sub.add_parser("quality", help="perplexity and top-1 agreement of int8 activations and a float16 KV "
                                            "cache against fp32, teacher-forced on standard-library code and prose")
    add_config_args(quality, EngineConfig, only=("model", "num_threads"))
    quality.add_argument("--activation-dtype", choices=list(ACTIVATION_DTYPES), default="int8",
                         help="the activations to score")
    quality.add_argument("--kv-cache-dtype", choices=["float16", "float32"], default="float16",
                         help="the KV cache to score")
    quality.add_argument("--prompt-tiles", action="store_true",
                         help="score int8 with every position computed as a prompt token on the bf16 tiles "
                              "(CPUs with AMX-BF16; what a prompt's tokens take by default there)")
    quality.add_argument("--max-tokens", type=int_at_least(2), default=4096, help="tokens of each text scored")
    quality.add_argument("--window", type=int_at_least(2), default=512, help="tokens a teacher-forced window holds")
    quality.set_defaults(func=_run_quality)

    steps = sub.add_parser("steps", help="time whole decode steps across batch sizes (optionally beside transformers)")
    _add_model_args(steps)
    steps.add_argument("--batch-sizes", type=int_at_least(1), nargs="+", default=[1, 8, 32, 64])
    steps.add_argument("--contexts", type=int_at_least(1), nargs="+", default=[128], help="prompt lengths drawn per request")
    steps.add_argument("--steps", type=int_at_least(1), default=16, help="timed decode steps per batch size and repeat")
    steps.add_argument("--repeats", type=int_at_least(1), default=3)
    add_config_args(steps, SchedulerConfig, only=("max_num_batched_tokens",),
                    helps={"max_num_batched_tokens": "token budget of a prefill step (raised to fit the prompts)"})
    steps.add_argument("--hf", action="store_true", help="also time transformers' forward pass (the test extra)")
    steps.add_argument("--activation-dtypes", nargs="+", choices=list(ACTIVATION_DTYPES), metavar="DTYPE",
                       help="activation dtypes run back to back each repeat, the first the ratios' base "
                            f"(choices: {', '.join(ACTIVATION_DTYPES)}; default: the engine's)")
    steps.add_argument("--prefill", type=int_at_least(0), default=0, metavar="N",
                       help="also time a fresh N-token prompt's prefill")
    steps.set_defaults(func=_run_steps)
