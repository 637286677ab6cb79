"""Command line: `conveyor serve` starts the OpenAI-compatible server; `conveyor chat` talks to one
in the terminal; `conveyor generate` runs prompts through the offline engine; `conveyor export-hf`
writes the model as an HF folder."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from conveyor.distributed.deploy import DeploymentConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's knobs, named as vLLM names them: one option per config field (conveyor/options.py)."""
    from conveyor.config import EngineConfig, SchedulerConfig
    from conveyor.options import add_config_args, add_vllm_engine_args

    add_config_args(parser, EngineConfig)
    add_config_args(parser, SchedulerConfig)
    add_vllm_engine_args(parser)


def engine_kwargs(args: argparse.Namespace) -> dict:
    from conveyor.config import EngineConfig, SchedulerConfig
    from conveyor.options import config_kwargs, vllm_engine_kwargs

    given = {k: v for k, v in config_kwargs(args, EngineConfig, SchedulerConfig).items() if k != "model"}
    return {**given, **vllm_engine_kwargs(args)}


# `conveyor generate`'s sampling where neither its flags nor the model's recommendation say: greedy.
GENERATE_SAMPLING: dict[str, float | int] = {"max_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                                             "min_p": 0.0, "repetition_penalty": 1.0}


def _generate(args: argparse.Namespace) -> int:
    from conveyor import LLM, SamplingParams

    # What the engine says while it starts (e.g. "building C++ kernels, first start only").
    logging.basicConfig(format="%(message)s")
    logging.getLogger("conveyor").setLevel(logging.INFO)
    from conveyor.errors import ConfigError

    given = {name: getattr(args, name) for name in GENERATE_SAMPLING if getattr(args, name) is not None}
    fixed = dict(seed=args.sample_seed, stop=args.stop or [], ignore_eos=args.ignore_eos)
    SamplingParams(**{**GENERATE_SAMPLING, **given}, **fixed)  # refused before a load
    if not args.prompts and sys.stdin.isatty():
        print("reading prompts from stdin, one a line (end with Ctrl-D)", file=sys.stderr)
    prompts = args.prompts or [line.rstrip("\r\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise ConfigError("no prompts: give them as arguments, or one a line on stdin")
    llm = LLM(args.model, **engine_kwargs(args))
    # A flag given, else what the model recommends (--generation-config), else this command's own.
    params = SamplingParams(**{**GENERATE_SAMPLING, **llm.sampling_defaults, **given}, **fixed)
    inputs: list[str] | list[list[int]] = prompts
    if args.chat:
        inputs = [llm.tokenizer.encode_messages([{"role": "user", "content": p}]) for p in prompts]
    each = [params if "max_tokens" in given else llm.within_context(p, params) for p in inputs]
    start = time.perf_counter()
    outputs = llm.generate(inputs, each)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(args.prompts or prompts, outputs):
        print(f"### {prompt!r}\n{out.text}\n[finish: {out.finish_reason}, {len(out.token_ids)} tokens]\n")
    generated = sum(len(o.token_ids) for o in outputs)
    print(f"{len(outputs)} requests, {generated} tokens in {elapsed:.2f} s: {generated / elapsed:.1f} output tok/s")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from conveyor.api.server import run_server
    from conveyor.config import EngineConfig
    from conveyor.errors import ConfigError

    if args.model_path and args.model and args.model_path != args.model:
        raise ConfigError(f"two models given: {args.model_path!r} and --model {args.model!r}; pass one")
    if args.api_key is not None and not args.api_key.strip():
        raise ConfigError("--api-key (or CONVEYOR_API_KEY) is empty: leave it out to serve without a key")
    model = args.model_path or args.model
    config = EngineConfig.from_kwargs(model=model, **engine_kwargs(args))
    names = args.served_model_name or [model or "smollm2-135m"]
    if not all(name.strip() for name in names):
        raise ConfigError("--served-model-name is empty")
    if model is None and len(names) > 1 and _looks_like_a_model(names[-1]):
        # vLLM's form takes every word after the flag: a model given after it was taken for a name.
        raise ConfigError(f"--served-model-name took {names[-1]!r}, which is a model: give the model first "
                          "(conveyor serve MODEL --served-model-name NAME ...)")
    if args.max_log_len is not None and not args.enable_log_requests:
        raise ConfigError("--max-log-len cuts the lines --enable-log-requests writes: give both")
    chat_template = _chat_template(args.chat_template) if args.chat_template is not None else None
    _check_address(args.host, args.port)
    return run_server(
        config,
        host=args.host,
        port=args.port,
        served_model_names=names,
        api_key=args.api_key or None,
        allowed_origins=args.allowed_origins,
        max_waiting_requests=args.max_waiting_requests,
        max_request_bytes=args.max_request_bytes,
        max_stored_responses=args.max_stored_responses,
        max_stored_responses_bytes=args.max_stored_responses_memory,
        shutdown_grace_s=args.shutdown_timeout,
        log_level=args.log_level,
        access_log=not args.disable_uvicorn_access_log,
        uvicorn_log_level=args.uvicorn_log_level,
        chat_template=chat_template,
        deployment=_deployment(args),
        log_requests=args.enable_log_requests,
        max_log_len=args.max_log_len,
    )


def _deployment(args: argparse.Namespace) -> "DeploymentConfig":
    """The Ray deployment the flags ask for; its worker options are refused without one."""
    from conveyor.distributed.deploy import DeploymentConfig
    from conveyor.errors import ConfigError

    deployment = DeploymentConfig(args.replicas, args.prefill_workers, args.decode_workers, args.ray_address)
    ray_only = {"--worker-cpus": args.worker_cpus, "--routing": args.routing}
    given = [flag for flag, value in ray_only.items() if value is not None]
    if given and not deployment.distributed:
        verb = "apply" if len(given) > 1 else "applies"
        raise ConfigError(f"{' and '.join(given)} {verb} to Ray workers: serve with --replicas N (N > 1), "
                          "--prefill-workers / --decode-workers or --ray-address")
    return dataclasses.replace(deployment, **{name: value for name, value in (
        ("worker_num_cpus", args.worker_cpus), ("routing", args.routing)) if value is not None})


def _add_serve_parser(commands: argparse._SubParsersAction) -> None:
    from conveyor.config import (
        DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_STORED_RESPONSES, DEFAULT_MAX_STORED_RESPONSES_BYTES,
    )
    from conveyor.distributed.router import ROUTING_POLICIES
    from conveyor.options import int_at_least

    srv = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API (completions, chat, metrics)")
    srv.add_argument("model_path", nargs="?", default=None, metavar="MODEL", help="same as --model")
    add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    srv.add_argument("--port", type=_port, default=8000, help="port to listen on (default: 8000)")
    srv.add_argument("--max-waiting-requests", type=int_at_least(1), default=256,
                     help="bound of the waiting queue; beyond it requests get 503 with Retry-After")
    srv.add_argument("--max-request-bytes", type=int_at_least(1024), default=DEFAULT_MAX_REQUEST_BYTES,
                     help="largest request body accepted; a larger one gets 413 without being read "
                          f"(default {DEFAULT_MAX_REQUEST_BYTES})")
    srv.add_argument("--max-stored-responses", type=_count, default=DEFAULT_MAX_STORED_RESPONSES, metavar="N",
                     help="/v1/responses kept in memory for previous_response_id and GET, the least recently "
                          f"used dropped first; 0 keeps none (default {DEFAULT_MAX_STORED_RESPONSES})")
    srv.add_argument("--max-stored-responses-memory", type=_memory, default=DEFAULT_MAX_STORED_RESPONSES_BYTES,
                     metavar="SIZE", help="the most memory stored /v1/responses take, roughly (their text); past it "
                                          "the least recently used are dropped (default "
                                          f"{DEFAULT_MAX_STORED_RESPONSES_BYTES // 2**20}MiB)")
    srv.add_argument("--api-key", default=os.environ.get("CONVEYOR_API_KEY"),
                     help="require 'Authorization: Bearer KEY' on /v1/* (default: $CONVEYOR_API_KEY)")
    srv.add_argument("--allowed-origins", type=_origins, default=["*"], metavar="ORIGINS",
                     help="origins whose browser pages may call the API (CORS): comma-separated "
                          "(http://a.example,https://b.example) or vLLM's JSON list; default any ('*', as vLLM); "
                          "'' allows none")
    srv.add_argument("--served-model-name", nargs="+", action="extend", default=None, metavar="NAME",
                     help="the name(s) clients use, as vLLM takes them (several after the flag, or the flag "
                          "repeated); the first is the one responses name (default: the model argument)")
    srv.add_argument("--shutdown-timeout", type=_seconds, default=30.0,
                     help="seconds in-flight requests get to finish after SIGTERM (default: 30)")
    srv.add_argument("--log-level", type=str.lower, default="info", choices=["debug", "info", "warning", "error"])
    srv.add_argument("--chat-template", default=None, metavar="FILE",
                     help="a Jinja chat template to use instead of the model's (e.g. one that renders tools): "
                          "a file, or the template itself")
    vllm = srv.add_argument_group("vLLM's serving flags, taken as its command lines write them")
    vllm.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="tool calls are always found when a request sends tools (tool_choice auto)")
    vllm.add_argument("--tool-call-parser", choices=["hermes"], default=None,
                      help="the format tool calls are parsed in: hermes (<tool_call>{...}</tool_call>, Qwen's), "
                           "the only one, always on")
    vllm.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request")
    vllm.add_argument("--uvicorn-log-level", type=str.lower, default=None,
                      choices=["critical", "error", "warning", "info", "debug", "trace"],
                      help="the HTTP server's own log level (default: --log-level)")
    logged = vllm.add_mutually_exclusive_group()
    logged.add_argument("--enable-log-requests", action="store_true",
                        help="log each request's prompts (text and token ids) and sampling parameters as it "
                             "reaches the engine")
    logged.add_argument("--disable-log-requests", action="store_true",
                        help="requests are not logged (the default; vLLM's older spelling)")
    vllm.add_argument("--max-log-len", type=_count, default=None, metavar="N",
                      help="with --enable-log-requests: at most N tokens and N characters of each prompt "
                           "(default: whole)")
    ray = srv.add_argument_group("scale-out on Ray (see docs/SERVING.md: Scaling out on Ray)")
    ray.add_argument("--replicas", type=int, default=1, help="engine replicas as Ray actors behind this front end")
    ray.add_argument("--prefill-workers", type=int, default=0, help="prefill workers (disaggregated serving)")
    ray.add_argument("--decode-workers", type=int, default=0, help="decode workers (disaggregated serving)")
    ray.add_argument("--ray-address", default=None,
                     help="join an existing Ray cluster ('auto' or host:port) instead of starting a local one")
    ray.add_argument("--worker-cpus", type=float, default=None, help="CPUs Ray reserves per worker (default: 1)")
    ray.add_argument("--routing", choices=ROUTING_POLICIES, default=None,
                     help="how requests are placed: where their prefix is cached, balanced against load "
                          "(cache-aware; least-load when prefix caching is off), or least outstanding tokens "
                          f"(default: {ROUTING_POLICIES[0]})")
    srv.set_defaults(func=_serve)


def _chat(args: argparse.Namespace) -> int:
    from conveyor.chat import ChatConfig, run_chat

    return run_chat(ChatConfig(args.url, args.model_name, args.system_prompt, args.api_key, args.quick))


def _add_chat_parser(commands: argparse._SubParsersAction) -> None:
    from conveyor.chat import DEFAULT_URL

    chat = commands.add_parser("chat", help="chat in the terminal with a running server (as vllm chat)")
    chat.add_argument("--url", default=DEFAULT_URL, help=f"the server's OpenAI API (default: {DEFAULT_URL})")
    chat.add_argument("--model-name", default=None, help="the model to ask (default: the first the server lists)")
    chat.add_argument("--system-prompt", default=None, help="a system message to start the conversation with")
    chat.add_argument("--api-key", default=None,
                      help="bearer key, sent to --url (default: $CONVEYOR_API_KEY, else $OPENAI_API_KEY)")
    chat.add_argument("-q", "--quick", default=None, metavar="MESSAGE",
                      help="send this one message, print the answer and end")
    chat.set_defaults(func=_chat)


def _export_hf(args: argparse.Namespace) -> int:
    from conveyor.model.export import export_model

    from conveyor.errors import ConfigError

    if not str(args.out_dir).strip():
        raise ConfigError("export-hf: the output folder is empty")
    folder = export_model(args.model, args.out_dir, args.dtype)
    print(f"wrote an HF checkpoint ({args.dtype}) to {folder}")
    return 0


def _add_export_parser(commands: argparse._SubParsersAction) -> None:
    from conveyor.options import HELP

    exp = commands.add_parser("export-hf", help="write the model (e.g. the dequantised GGUF) as an HF folder")
    exp.add_argument("out_dir", metavar="OUT_DIR", help="folder to write (created; files in it are overwritten)")
    exp.add_argument("--model", default=None, help=HELP["model"])
    exp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    exp.set_defaults(func=_export_hf)


def _looks_like_a_model(word: str) -> bool:
    """A model's name or path as a user writes it after a flag: a known name, a .gguf file, an HF
    folder, or a hub-style "org/name" (which conveyor never downloads: the error says so next)."""
    from conveyor.model.loader import is_model_name

    path = Path(word).expanduser()
    return (is_model_name(word) or word.lower().endswith(".gguf") or "/" in word
            or (path / "config.json").is_file())


def _chat_template(given: str) -> str:
    """--chat-template: a file's text, or the template itself written inline (as vLLM takes it),
    checked before the model loads."""
    from conveyor.errors import ConfigError
    from conveyor.model.tokenizer import ChatTemplateError, compile_chat_template

    if "{{" in given or "{%" in given:  # before any file lookup: a template is no valid path (too long a name)
        text = given
    else:
        try:
            text = Path(given).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"--chat-template {given!r} is neither a file nor a Jinja template") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read --chat-template {given}: {exc}") from None
    try:
        compile_chat_template(text)
    except ChatTemplateError as exc:
        raise ConfigError(f"--chat-template: {exc}") from None
    return text


def _check_address(host: str, port: int) -> None:
    """Before the model loads (seconds to minutes): the address must resolve and be free to bind."""
    import socket

    from conveyor.errors import ConfigError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"--host {host!r} does not resolve: {exc}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
        try:
            probe.bind(address)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port} (--host / --port): {exc.strerror}") from None


_ORIGIN = re.compile(r"\*|[a-z][a-z0-9+.-]*://[^/\s,]+", re.IGNORECASE)


def _origins(text: str) -> list[str]:
    """--allowed-origins: "a,b" or '["a", "b"]' (vLLM's spelling); each "*" or scheme://host[:port]."""
    if text.lstrip().startswith("["):
        try:
            origins = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise argparse.ArgumentTypeError("a JSON list of origin strings")
    else:
        origins = [o.strip() for o in text.split(",") if o.strip()]
    for origin in origins:
        if not _ORIGIN.fullmatch(origin):
            raise argparse.ArgumentTypeError(f"{origin!r} is not an origin: '*' or scheme://host[:port], no path")
    return origins


def _port(text: str) -> int:
    number = int(text)
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {number}")
    return number


def _memory(text: str) -> int:
    from conveyor.config import parse_memory
    from conveyor.errors import ConfigError

    try:
        return parse_memory(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count(text: str) -> int:
    number = int(text)
    if number < 0:
        raise argparse.ArgumentTypeError(f"a count, 0 or more, got {number}")
    return number


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"a number of seconds, 0 or more, got {text}")
    return value


# argparse names a type in its errors ("invalid port value: 'abc'").
_port.__name__, _seconds.__name__, _count.__name__ = "port", "seconds", "count"


def _dashed(arg: str) -> str:
    """--max_model_len=8 as --max-model-len=8: vLLM's parser takes either spelling of a flag."""
    if not arg.startswith("--"):
        return arg
    flag, equals, value = arg.partition("=")
    return flag.replace("_", "-") + equals + value


def main(argv: Sequence[str] | None = None) -> int:
    from conveyor import __version__

    parser = argparse.ArgumentParser(prog="conveyor", description="LLM serving with continuous batching")
    parser.add_argument("--version", action="version", version=f"conveyor {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="run prompts offline and print the completions")
    add_engine_args(gen)
    gen.add_argument("prompts", nargs="*", help="prompts (default: one per line on stdin)")
    own = "default: what the model recommends (--generation-config), else {}"
    gen.add_argument("--max-tokens", type=int, help=own.format(GENERATE_SAMPLING["max_tokens"]))
    gen.add_argument("--temperature", type=float, help=own.format("0: greedy"))
    gen.add_argument("--top-p", type=float, help=own.format("1: off"))
    gen.add_argument("--top-k", type=int, help=own.format("0: off"))
    gen.add_argument("--min-p", type=float, help=own.format("0: off"))
    gen.add_argument("--repetition-penalty", type=float, help=own.format("1: off"))
    gen.add_argument("--sample-seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.set_defaults(func=_generate)
    _add_serve_parser(commands)
    _add_chat_parser(commands)
    _add_export_parser(commands)
    from conveyor.bench.cli import add_bench_parser

    add_bench_parser(commands)
    from conveyor.sim.cli import add_simulate_parser

    add_simulate_parser(commands)

    args = parser.parse_args([_dashed(arg) for arg in (sys.argv[1:] if argv is None else argv)])
    from conveyor.errors import ConfigError, ConveyorError
    from conveyor.options import as_flags

    try:
        return args.func(args)
    except (ConveyorError, OSError) as exc:  # OSError: a path given that cannot be read or written
        print(f"conveyor: error: {as_flags(str(exc)) if isinstance(exc, ConfigError) else exc}", file=sys.stderr)
        return 2


def run() -> None:
    """The `conveyor` command: main, and Ctrl-C as a shell expects of it (exit 130, no traceback)."""
    try:
        code = main()
    except KeyboardInterrupt:
        # While a model loads or prompts run, the work is on a thread inside the kernels' C++ code, and an
        # interpreter finalizing around it aborts the process ("terminate called ..."): leave without
        # finalizing. Only here, in the command's own process: main() called in-process re-raises.
        print("conveyor: interrupted", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    sys.exit(code)


if __name__ == "__main__":
    run()
