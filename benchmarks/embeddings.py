"""Embeddings served: conveyor's /v1/embeddings against llama-server's (`--embeddings`), on the same
GGUF file, the same texts and the same pooling (the last token's, normalized), both servers up at
once and the rounds alternating which goes first.

Two workloads, as a retrieval application makes them:
- ingest: passages of the repository's own source (~PASSAGE_CHARS characters each, cut at line
  ends) sent in requests of --inputs-per-request passages, --concurrency requests in flight;
  passages and input tokens per second, end to end. Each round sends passages of its own, so that
  no server finds a round's texts in its prefix cache (conveyor would: a last-token embedding of a
  text seen before computes one token);
- query: one short question per request, one request at a time; the median latency.
It also prints how alike the two servers' vectors are (cosine of each passage's pair): both pool
the same hidden states, conveyor with its int8 products, llama.cpp with its own.

    .venv/bin/python benchmarks/embeddings.py --model qwen2.5-coder-0.5b --rounds 3

llama-server comes from benchmarks/peers/llama_cpp.sh --setup-only; without it conveyor runs alone.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from footprint import LLAMA_SERVER, ROOT, llama_server_cmd, serving

CONVEYOR = ROOT / ".venv/bin/conveyor"
PASSAGE_CHARS = 1200
QUERIES = ["how does the scheduler preempt a request", "where are KV blocks freed", "what does the sampler do with top_p",
           "how is a GGUF file read", "which kernel multiplies int8 activations", "how are stop strings found",
           "what limits the size of a request body", "how does prefix caching key a block"]


def passages(count: int) -> list[str]:
    """`count` passages of the package's source, in a fixed order, each cut at a line end."""
    found: list[str] = []
    for path in sorted((ROOT / "conveyor").rglob("*.py")):
        text, start = path.read_text(), 0
        while start < len(text) and len(found) < count:
            end = text.find("\n", start + PASSAGE_CHARS)
            end = len(text) if end < 0 else end + 1
            if end - start > PASSAGE_CHARS // 2:
                found.append(f"# {path.relative_to(ROOT)}\n{text[start:end]}")
            start = end
        if len(found) == count:
            return found
    raise SystemExit(f"only {len(found)} passages in the package")


def embed(port: int, texts: list[str]) -> tuple[list[list[float]], int]:
    body = json.dumps({"input": texts, "encoding_format": "float"}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/embeddings", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as reply:
        answer = json.loads(reply.read())
    vectors = [item["embedding"] for item in sorted(answer["data"], key=lambda d: d["index"])]
    return vectors, int(answer["usage"]["prompt_tokens"])


def ingest(port: int, texts: list[str], per_request: int, concurrency: int) -> tuple[float, int, list[list[float]]]:
    """(seconds, input tokens, vectors) for every passage, `concurrency` requests in flight."""
    groups = [texts[i: i + per_request] for i in range(0, len(texts), per_request)]
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda group: embed(port, group), groups))
    elapsed = time.perf_counter() - started
    return elapsed, sum(tokens for _, tokens in answers), [v for vectors, _ in answers for v in vectors]


def query_latency(port: int, repeats: int) -> float:
    latencies = []
    for i in range(repeats * len(QUERIES)):
        started = time.perf_counter()
        embed(port, [QUERIES[i % len(QUERIES)]])
        latencies.append(time.perf_counter() - started)
    return statistics.median(latencies)


def cosine(a: list[float], b: list[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b))
    return dot / math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="a conveyor model name or a .gguf path")
    p.add_argument("--passages", type=int, default=96)
    p.add_argument("--inputs-per-request", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4, help="ingest requests in flight; llama-server's --parallel")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=2048, help="llama-server's -b and -ub (a passage must fit one)")
    p.add_argument("--out-dir", default="out/embeddings")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from conveyor.model.loader import resolve_model_path

    path = resolve_model_path(args.model)
    every = passages(args.passages * args.rounds + 2)
    warm_up, rounds = every[:2], [every[2 + r * args.passages: 2 + (r + 1) * args.passages] for r in range(args.rounds)]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    slots = args.concurrency * args.inputs_per_request
    servers = {"conveyor": ([str(CONVEYOR), "serve", str(path), "--port", "8151", "--log-level", "warning",
                             "--num-threads", str(args.threads), "--pooling-type", "last",
                             "--max-num-seqs", str(slots)], 8151)}
    if LLAMA_SERVER.is_file():
        servers["llama-server"] = ([*llama_server_cmd(path, 8152, args.threads, slots, slots * 1024),
                                    "--embeddings", "--pooling", "last", "-b", str(args.batch), "-ub", str(args.batch)],
                                   8152)
    else:
        print("llama-server not built (benchmarks/peers/llama_cpp.sh --setup-only): conveyor alone")
    print(f"{path.name}: {args.passages} passages of ~{PASSAGE_CHARS} characters, {args.inputs_per_request} a request, "
          f"{args.concurrency} requests in flight; queries one at a time; {args.threads} threads; pooling last")
    print(f"{'round':>5} {'server':<13} {'ingest s':>8} {'passages/s':>10} {'tokens/s':>9} {'query ms':>8}")
    rates: dict[str, list[float]] = {name: [] for name in servers}
    queries: dict[str, list[float]] = {name: [] for name in servers}
    vectors: dict[str, list[list[float]]] = {}  # the last round's
    with ExitStack() as stack:
        for name, (cmd, port) in servers.items():
            stack.enter_context(serving(cmd, port, out_dir / f"{name}.log"))
            embed(port, warm_up)
        for round_ in range(1, args.rounds + 1):
            order = list(servers) if round_ % 2 else list(reversed(servers))
            texts = rounds[round_ - 1]
            for name in order:
                port = servers[name][1]
                seconds, tokens, vectors[name] = ingest(port, texts, args.inputs_per_request, args.concurrency)
                latency = query_latency(port, 2)
                rates[name].append(len(texts) / seconds)
                queries[name].append(latency)
                print(f"{round_:>5} {name:<13} {seconds:>8.2f} {len(texts) / seconds:>10.2f} {tokens / seconds:>9.0f} "
                      f"{1000 * latency:>8.1f}")
    if len(servers) == 2:
        ratios = sorted(a / b for a, b in zip(rates["conveyor"], rates["llama-server"]))
        latency_ratios = sorted(a / b for a, b in zip(queries["conveyor"], queries["llama-server"]))
        cosines = sorted(cosine(a, b) for a, b in zip(vectors["conveyor"], vectors["llama-server"]))
        print(f"ingest passages/s, conveyor / llama-server: min {ratios[0]:.2f}x, median {statistics.median(ratios):.2f}x, "
              f"max {ratios[-1]:.2f}x")
        print(f"query latency, conveyor / llama-server: min {latency_ratios[0]:.2f}x, median "
              f"{statistics.median(latency_ratios):.2f}x, max {latency_ratios[-1]:.2f}x")
        print(f"cosine of the two servers' vectors per passage: min {cosines[0]:.5f}, median "
              f"{statistics.median(cosines):.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
