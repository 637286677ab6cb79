"""An editor's fill-in-the-middle session, against conveyor and llama.cpp's server on the same file:
a few lines of a source file are cut out at the cursor and typed back a few characters at a time,
and at each keystroke the client asks for the middle (the text between the code before the cursor
and the code after it), one request at a time, as an editor waiting for its suggestion does.
conveyor is asked through OpenAI's `suffix` on /v1/completions (`--conveyor-infill`: through its
own /infill, the request llama-server gets, whose layout it cuts as llama-server at its default
batch of 2,048 does), llama-server through its own /infill, run as llama.vim's preset for
Qwen2.5-Coder runs it (-b 1024 -ub 1024 --cache-reuse 256). The prompts differ: /infill puts a
short repository header first and cuts the code to its batch (3/4 before the cursor, 1/4 after);
/v1/completions takes the whole file unless --truncate gives it truncate_prompt_tokens (the same
3:1 split). Both reuse the KV of the prompt's unchanged start
(prefix caching; llama.cpp's cache_prompt), and llama-server also moves cached KV that reappears at
a shifted position (--cache-reuse).

    .venv/bin/python benchmarks/fim_session.py --rounds 2
    .venv/bin/python benchmarks/fim_session.py --rounds 2 --truncate 1024
    .venv/bin/python benchmarks/fim_session.py --rounds 2 --conveyor-infill --llama-batch 2048
    .venv/bin/python benchmarks/fim_session.py --llama-batch 2048 --file conveyor/api/app.py --cursor-line 150

Prints, per server and round, the latency of a suggestion (median, p90, max; the session's first
request, on a cold cache, is left out), the prompt tokens computed per request (those not taken
from the cache) and tokens generated, and how many suggestions the two servers agree on. Each round starts both
servers afresh, one after the other (conveyor first); `--rounds 2` alternates them twice.
llama-server comes from benchmarks/peers/llama_cpp.sh --setup-only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from footprint import LLAMA_SERVER, llama_server_cmd, serving

ROOT = Path(__file__).resolve().parent.parent
CONVEYOR = Path(sys.executable).parent / "conveyor"


def post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def keystrokes(document: str, cursor_line: int, lines_cut: int, chars: int) -> list[tuple[str, str]]:
    """(code before the cursor, code after it) at each keystroke: `lines_cut` lines from
    `cursor_line` (0-based) cut out, then typed back `chars` characters at a time."""
    lines = document.splitlines(keepends=True)
    before, cut, after = "".join(lines[:cursor_line]), "".join(lines[cursor_line:cursor_line + lines_cut]), \
        "".join(lines[cursor_line + lines_cut:])
    return [(before + cut[:typed], after) for typed in range(0, len(cut) + 1, chars)]


def conveyor_request(port: int, prefix: str, suffix: str, max_tokens: int,
                     truncate: int | None = None) -> tuple[str, int, int]:
    """(the suggestion, prompt tokens computed, tokens generated)"""
    body = {"prompt": prefix, "suffix": suffix, "max_tokens": max_tokens, "temperature": 0, "stop": ["\n\n"]}
    if truncate is not None:
        body["truncate_prompt_tokens"] = truncate
    reply = post(port, "/v1/completions", body)
    usage = reply["usage"]
    return (reply["choices"][0]["text"], usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"],
            usage["completion_tokens"])


def llama_request(port: int, prefix: str, suffix: str, max_tokens: int) -> tuple[str, int, int]:
    reply = post(port, "/infill", {"input_prefix": prefix, "input_suffix": suffix, "n_predict": max_tokens,
                                   "temperature": 0, "stop": ["\n\n"], "cache_prompt": True})
    return reply["content"], int(reply["timings"]["prompt_n"]), int(reply["timings"]["predicted_n"])


def session(cmd: list[str], port: int, log: Path, ask, strokes: list[tuple[str, str]], max_tokens: int) -> dict:
    with serving(cmd, port, log):
        latencies, computed, generated, texts = [], [], [], []
        for prefix, suffix in strokes:
            started = time.perf_counter()
            text, fresh, made = ask(port, prefix, suffix, max_tokens)
            latencies.append(time.perf_counter() - started)
            computed.append(fresh)
            generated.append(made)
            texts.append(text)
        return {"latencies": latencies[1:], "computed": computed[1:], "generated": generated[1:],
                "first_s": latencies[0], "texts": texts}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="a conveyor model name or a .gguf path")
    p.add_argument("--file", default="conveyor/engine/detokenizer.py", help="the document, from the repository")
    p.add_argument("--cursor-line", type=int, default=60, help="the first line cut out (0-based)")
    p.add_argument("--lines-cut", type=int, default=3)
    p.add_argument("--chars", type=int, default=4, help="characters typed between two requests")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=4096, help="llama-server's -c (one slot)")
    p.add_argument("--cache-reuse", type=int, default=256, help="llama-server's --cache-reuse (0: off)")
    p.add_argument("--llama-batch", type=int, default=1024, help="llama-server's -b and -ub (its default: 2048 / 512)")
    p.add_argument("--truncate", type=int, default=None,
                   help="conveyor's truncate_prompt_tokens (default: the whole file, as the client sends it)")
    p.add_argument("--conveyor-infill", action="store_true",
                   help="ask conveyor through its own /infill, as llama-server is asked (default: /v1/completions)")
    p.add_argument("--out-dir", default="out/fim")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from conveyor.model.loader import resolve_model_path

    path = resolve_model_path(args.model)
    strokes = keystrokes((ROOT / args.file).read_text(), args.cursor_line, args.lines_cut, args.chars)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    def ask_conveyor(port: int, prefix: str, suffix: str, max_tokens: int) -> tuple[str, int, int]:
        return conveyor_request(port, prefix, suffix, max_tokens, args.truncate)

    servers = [("conveyor", [str(CONVEYOR), "serve", str(path), "--port", "8141", "--log-level", "warning",
                             "--num-threads", str(args.threads)], 8141,
                 llama_request if args.conveyor_infill else ask_conveyor)]
    if LLAMA_SERVER.is_file():
        # llama.vim's preset for Qwen2.5-Coder (llama-server --fim-qwen-*-default): a 1,024-token batch,
        # which also caps /infill's prompt (3/4 of it for the code before the cursor, 1/4 after),
        # and --cache-reuse, which moves the KV of a chunk the new prompt repeats at another position.
        servers.append(("llama-server", [*llama_server_cmd(path, 8142, args.threads, 1, args.context),
                                          "-b", str(args.llama_batch), "-ub", str(args.llama_batch),
                                          "--cache-reuse", str(args.cache_reuse)], 8142, llama_request))
    else:
        print("llama-server not built (benchmarks/peers/llama_cpp.sh --setup-only): conveyor alone")
    print(f"{path.name}: {args.file} lines {args.cursor_line}..{args.cursor_line + args.lines_cut - 1} typed back "
          f"{args.chars} characters a request, {len(strokes)} requests, max_tokens {args.max_tokens}, "
          f"{args.threads} threads; llama-server -b/-ub {args.llama_batch} --cache-reuse {args.cache_reuse}, "
          f"conveyor {'/infill' if args.conveyor_infill else f'truncate_prompt_tokens {args.truncate}'}")
    print(f"{'round':>5} {'server':<13} {'median ms':>9} {'p90 ms':>7} {'max ms':>7} {'cold ms':>8} "
          f"{'computed/req':>12} {'out/req':>7} {'agree':>6}")
    for round_ in range(1, args.rounds + 1):
        results = {name: session(cmd, port, out_dir / f"{name}.{round_}.log", ask, strokes, args.max_tokens)
                   for name, cmd, port, ask in servers}
        texts = [r["texts"] for r in results.values()]
        agree = sum(len(set(column)) == 1 for column in zip(*texts)) if len(texts) > 1 else len(strokes)
        for name, r in results.items():
            lat = sorted(r["latencies"])
            print(f"{round_:>5} {name:<13} {1000 * statistics.median(lat):>9.0f} "
                  f"{1000 * statistics.quantiles(lat, n=10, method='inclusive')[8]:>7.0f} {1000 * lat[-1]:>7.0f} "
                  f"{1000 * r['first_s']:>8.0f} "
                  f"{statistics.mean(r['computed']):>12.1f} {statistics.mean(r['generated']):>7.1f} "
                  f"{agree:>3}/{len(strokes)}")
        if len(results) == 2:
            ours, theirs = (statistics.median(r["latencies"]) for r in results.values())
            print(f"      conveyor's median latency {ours / theirs:.2f}x llama-server's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
