"""`conveyor simulate`: the real scheduler on a cost model, at GPU scale, in virtual time.

    conveyor simulate --hardware h100 --model llama-3-8b --workload chat --rate 10 --policy continuous
    conveyor simulate ... --sweep rate --slo ttft:500 tpot:50          # highest rate meeting P99 SLOs
    conveyor simulate ... --sweep max-num-seqs --slo tpot:30           # best batch cap under the SLOs
    conveyor simulate fit --num-threads 1 --output out/sim/profile.json  # measure this machine's engine
    conveyor simulate --hardware this-machine --cost-model profiled --model smollm2-135m ...
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import time

from conveyor.bench.cli import _add_workload_args, _workload
from conveyor.bench.workloads import DATASETS
from conveyor.config import EngineConfig, SchedulerConfig
from conveyor.options import add_config_args, int_at_least
from conveyor.sim.hardware import ALIASES, HARDWARE_NAMES, hardware_key
from conveyor.sim.models import MODELS
from conveyor.sim.profiled import DEFAULT_PROFILE


def _engine_kwargs(args: argparse.Namespace) -> dict:
    """Every SchedulerConfig field the parser has (so scheduler options added later flow through)."""
    kwargs = {name: getattr(args, name) for name in SchedulerConfig.__dataclass_fields__ if hasattr(args, name)}
    kwargs["block_size"] = args.block_size
    kwargs["enable_prefix_caching"] = args.enable_prefix_caching
    kwargs["speculative_config"] = args.speculative_config
    kwargs["window_kv_pool"] = args.window_kv_pool
    return {k: v for k, v in kwargs.items() if v is not None}


def sim_config(args: argparse.Namespace):  # noqa: ANN201 - SimConfig (imported lazily)
    from conveyor.bench.metrics import parse_goodput, parse_selection
    from conveyor.sim.config import SimConfig

    _, percentiles = parse_selection(None, args.metric_percentiles)
    return SimConfig(
        hardware=args.hardware, model=args.model, dtype=args.dtype, tp=args.tp, cost_model=args.cost_model,
        roofline_json=args.roofline_json, efficiency=args.efficiency,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len, workload=_workload(args),
        request_rate=args.rate, burstiness=args.burstiness, rate_schedule=args.rate_schedule,
        engine=_engine_kwargs(args),
        percentiles=sorted({*percentiles, 99.0}), goodput=parse_goodput(args.goodput),
        prefill_workers=args.prefill_workers, decode_workers=args.decode_workers, replicas=args.replicas,
        kv_transfer_bandwidth=None if args.kv_transfer_bandwidth is None else args.kv_transfer_bandwidth * 1e9,
        **({} if args.spec_acceptance is None else {"spec_acceptance": args.spec_acceptance}),
        **({} if args.profile is None else {"profile": args.profile}),
    )


def _refuse_unused(args: argparse.Namespace) -> None:
    """Options that only mean something beside another one: given alone they would be ignored."""
    from conveyor.errors import ConfigError

    if not args.sweep and (args.slo or args.sweep_values):
        raise ConfigError("--slo and --sweep-values are for --sweep rate|max-num-seqs")
    if args.dataset in ("edit", "questions"):
        raise ConfigError(f"the {args.dataset} dataset's prompts are a real model's text: run it with `conveyor bench`, "
                          "not the simulator")
    if args.profile is not None and args.cost_model != "profiled":
        raise ConfigError("--profile is the profiled cost model's: give it with --cost-model profiled")
    if args.roofline_json is not None and hardware_key(args.hardware) != "this-machine":
        raise ConfigError("--roofline-json describes this machine: give it with --hardware this-machine")
    if args.spec_acceptance is not None and args.speculative_config is None:
        raise ConfigError("--spec-acceptance is for a run with --speculative-config")
    if args.sweep == "max-num-seqs" and any(v != int(v) or v < 1 for v in args.sweep_values or ()):
        raise ConfigError(f"--sweep max-num-seqs takes whole caps of at least 1, got {args.sweep_values}")


def _run(args: argparse.Namespace) -> int:
    from conveyor.bench.metrics import format_result, parse_selection
    from conveyor.sim.report import write_outputs
    from conveyor.sim.simulate import run_simulation
    from conveyor.sim.sweep import format_sweep, parse_slos, sweep_max_num_seqs, sweep_rate

    _refuse_unused(args)
    cfg = sim_config(args)
    selected, _ = parse_selection(args.percentile_metrics, args.metric_percentiles)
    wall0 = time.perf_counter()
    if args.sweep:
        slos = parse_slos(args.slo)
        if not slos:
            raise SystemExit("conveyor simulate: --sweep needs --slo KEY:MS ... (e.g. --slo ttft:500 tpot:50)")
        if args.sweep == "rate":
            result = sweep_rate(cfg, slos, args.sweep_values, args.slo_percentile, echo=print)
        else:
            caps = [int(v) for v in args.sweep_values or [8, 16, 32, 64, 128, 256, 512]]
            result = sweep_max_num_seqs(cfg, slos, caps, args.slo_percentile, echo=print)
        print(format_sweep(result, slos, args.slo_percentile))
        runs = [p.run for p in result.points]
        extra = {"sweep": {"knob": result.knob, "slos_ms": slos, "percentile": args.slo_percentile,
                           "best": None if result.best is None else result.best.value}}
    else:
        run = run_simulation(cfg)
        window = (f" (+ {run.kv_window.num_blocks - 1} blocks for the sliding-window layers' "
                  f"{run.kv_window.tokens}-token windows)" if run.kv_window else "")
        print(f"cost model: {run.cost_model}; KV pool {run.num_kv_blocks} blocks of {cfg.engine['block_size']} tokens"
              + window + (" per worker" if run.workers else ""))
        if run.workers:
            print(_deployment_line(cfg, run.result.offline.extra))
        print(format_result(run.result.metrics, selected, request_rate=cfg.request_rate))
        cache = {k: v for k, v in run.result.offline.extra.items() if k.startswith(("prefix", "cached", "ttft_mean"))}
        if cache:
            print("prefix cache: " + ", ".join(f"{k} {v:.3g}" for k, v in cache.items()))
        runs, extra = [run], {}
    steps = sum(r.num_steps for r in runs)
    print(f"simulated {sum(r.result.metrics.completed for r in runs)} requests, {steps} engine steps "
          f"in {time.perf_counter() - wall0:.1f} s wall time")
    if args.output_dir:
        written = write_outputs(cfg, runs, args.output_dir, plots=not args.no_plots, extra=extra)
        print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _deployment_line(cfg, extra: dict) -> str:  # noqa: ANN001 - SimConfig
    devices = f"{extra['devices']} x {cfg.hardware}" + (f" (tp {cfg.tp} per worker)" if cfg.tp > 1 else "")
    line = f"deployment: {extra['deployment']} on {devices}, {cfg.tp} for one colocated engine; requests per worker: "
    line += ", ".join(f"{w['name']} {w['requests']}" for w in extra["workers"])
    if extra["handovers"]:
        line += (f"\nKV handover: {extra['handovers']} requests, {extra['kv_transfer_bytes'] / 1e9:.2f} GB at "
                 f"{extra['kv_transfer_gbs']:g} GB/s per device, mean {extra['kv_transfer_ms_mean']:.2f} ms")
    return line


def _fit(args: argparse.Namespace) -> int:
    from conveyor.sim.profile_steps import ProfileGrid, profile_engine

    grid = ProfileGrid(repeats=args.repeats)
    if args.batch_sizes:
        grid.batch_sizes = args.batch_sizes
    if args.contexts:
        grid.contexts = args.contexts
    if args.prompt_lens:
        grid.prompt_lens = args.prompt_lens
    grid.chunk_episodes = args.chunk_episodes
    kwargs = dict(model=args.model, dtype=args.dtype, num_threads=args.num_threads,
                  kv_cache_memory=args.kv_cache_memory, block_size=args.block_size)
    print(f"measuring the real engine's step times ({len(grid.episodes())} episodes) ...")
    profile = profile_engine(kwargs, grid)
    path = profile.save(args.output)
    terms = ", ".join(f"{k} {v * 1e3:.4g} ms" for k, v in profile.coefficients.items() if v)
    print(f"fitted {profile.num_samples} steps (R^2 {profile.r2:.3f}, median |error| "
          f"{100 * profile.median_abs_rel_error:.1f}%): {terms}\nwrote {path}")
    return 0


def _add_fit_parser(sub: argparse._SubParsersAction) -> None:
    fit = sub.add_parser("fit", help="measure the real engine's step times on this machine; fit the profiled model")
    add_config_args(fit, EngineConfig, only=("model", "dtype", "num_threads", "kv_cache_memory", "block_size"),
                    defaults={"num_threads": 1}, helps={"num_threads": "a step's threads; use what the engine will run with"})
    fit.add_argument("--batch-sizes", type=int_at_least(1), nargs="+", default=None)
    fit.add_argument("--contexts", type=int_at_least(1), nargs="+", default=None)
    fit.add_argument("--prompt-lens", type=int_at_least(1), nargs="+", default=None, help="whole prompts measured alone")
    fit.add_argument("--chunk-episodes", action=argparse.BooleanOptionalAction, default=True,
                     help="also measure prompts cut into chunks beside running decodes")
    fit.add_argument("--repeats", type=int, default=1, help="run the grid this many times (noisy machines)")
    fit.add_argument("--output", default=DEFAULT_PROFILE)
    fit.set_defaults(func=_fit)


def add_simulate_parser(commands: argparse._SubParsersAction) -> None:
    # No abbreviations: the parent would otherwise claim `fit`'s options as prefixes of its own.
    sim = commands.add_parser("simulate", help="simulate serving on described hardware with the real scheduler",
                              allow_abbrev=False)
    _add_fit_parser(sim.add_subparsers(dest="sim_command"))  # optional: `conveyor simulate fit`
    hw = sim.add_argument_group("hardware, model and cost model")
    hw.add_argument("--hardware", default="h100", choices=[*HARDWARE_NAMES, *ALIASES])
    hw.add_argument("--model", default="llama-3-8b", choices=list(MODELS))
    hw.add_argument("--dtype", default=None, help="override the model description's dtype (bfloat16, fp8, float32)")
    hw.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    hw.add_argument("--cost-model", default="roofline", choices=["roofline", "profiled"])
    hw.add_argument("--profile", default=None,
                    help=f"with --cost-model profiled: the profiled model's JSON (`conveyor simulate fit`; "
                         f"default {DEFAULT_PROFILE})")
    hw.add_argument("--roofline-json", default=None, help="for --hardware this-machine (`conveyor bench roofline`)")
    hw.add_argument("--efficiency", type=float, default=None, help="achieved fraction of peak FLOP/s and bandwidth")
    hw.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    hw.add_argument("--kv-cache-memory", default=None,
                    help="KV pool size (default: memory x utilization - weights; profiled: the engine's default 1GiB)")
    hw.add_argument("--num-kv-blocks", type=int, default=None)
    hw.add_argument("--max-model-len", type=int, default=None)
    eng = sim.add_argument_group("engine (the real scheduler's knobs)")
    # A GPU's batch cap: 256 (vLLM's default), not the CPU engine's. No scheduling policy: the
    # workloads carry no priorities, so priority order would be arrival order.
    knobs = [f.name for f in dataclasses.fields(SchedulerConfig) if f.name != "scheduling_policy"]
    add_config_args(eng, SchedulerConfig, only=knobs, defaults={"max_num_seqs": 256},
                    helps={"slo_ttft_ms": "TTFT target: misses are counted, not dropped"})
    add_config_args(eng, EngineConfig, only=("block_size", "enable_prefix_caching", "speculative_config",
                                             "window_kv_pool"))
    eng.add_argument("--spec-acceptance", type=float, default=None,
                     help="with --speculative-config: the chance each proposed token is accepted, given that "
                          "the ones before it were (the workload's; default 0.7)")
    dep = sim.add_argument_group("deployment (each worker is a whole device or tp group: P+D workers use P+D x tp)")
    dep.add_argument("--prefill-workers", type=int, default=0, help="prefill/decode disaggregation (with --decode-workers)")
    dep.add_argument("--decode-workers", type=int, default=0)
    dep.add_argument("--replicas", type=int, default=1, help="colocated engines sharing the arrivals (equal hardware)")
    dep.add_argument("--kv-transfer-bandwidth", type=float, default=None, metavar="GB/S",
                     help="prefill->decode KV link, gigabytes/s per device (default: the hardware's; h100 50)")
    sim.add_argument("--rate", "--request-rate", dest="rate", type=float, default=math.inf,
                     help="requests/s (Poisson, or gamma with --burstiness); inf = all at once")
    _add_workload_args(sim)
    sim.add_argument("--workload", dest="dataset", choices=DATASETS, default=argparse.SUPPRESS, help="same as --dataset")
    plan = sim.add_argument_group("capacity planning")
    plan.add_argument("--sweep", choices=["rate", "max-num-seqs"], default=None)
    plan.add_argument("--sweep-values", type=float, nargs="+", default=None,
                      help="rates or caps to try (rate default: double then bisect; caps default 8..512)")
    plan.add_argument("--slo", nargs="+", default=None, metavar="KEY:MS", help="e.g. --slo ttft:500 tpot:50")
    plan.add_argument("--slo-percentile", type=float, default=99.0)
    sim.add_argument("--output-dir", default=None, help="write table.txt, sim.json (trace, per request) and plots")
    sim.add_argument("--no-plots", action="store_true")
    sim.set_defaults(func=_run)
