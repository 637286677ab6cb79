"""Cache-aware vs least-load routing over Ray replicas, on the same multi-turn requests.

For each routing policy: start `conveyor serve --replicas N --routing POLICY`, drive it with
`conveyor bench serve` (multi-turn conversations), read the per-replica counters from /metrics,
stop it. Prints, per policy, the prefix-cache hit rate (cached / prompt tokens, over every
replica), the requests and the prompt tokens each replica computed, and the load imbalance
(the busiest replica's share over the mean, minus one), then the hit-rate ratio of the two runs.

    .venv/bin/python benchmarks/replica_routing.py            # 16 conversations x 6 turns, 2 replicas
    .venv/bin/python benchmarks/replica_routing.py --replicas 2 --conversations 8 --turns 4 -- --seed 1
    .venv/bin/python benchmarks/replica_routing.py --num-kv-blocks 256   # each replica's cache holds 4,096 tokens

Arguments after `--` go to `conveyor bench serve` unchanged.
"""
from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONVEYOR = str(Path(sys.executable).parent / "conveyor")
COUNTER = re.compile(r'^conveyor:(worker_requests|worker_prompt_tokens|worker_prefix_cache_hits)_total\{([^}]*)\} (\S+)$')


def scrape(port: int) -> dict[str, dict[str, float]]:
    """{worker: {requests, prompt_tokens, cached_tokens}} from the server's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, dict[str, float]] = {}
    names = {"worker_requests": "requests", "worker_prompt_tokens": "prompt_tokens",
             "worker_prefix_cache_hits": "cached_tokens"}
    for line in text.splitlines():
        m = COUNTER.match(line)
        if m:
            worker = re.search(r'worker="([^"]+)"', m.group(2)).group(1)  # type: ignore[union-attr]
            out.setdefault(worker, {})[names[m.group(1)]] = float(m.group(3))
    return out


def wait_healthy(port: int, server: subprocess.Popen, timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode}")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit("the server did not become healthy")


def run(policy: str, args: argparse.Namespace, bench_args: list[str]) -> dict[str, dict[str, float]]:
    log = open(Path(args.out_dir) / f"server-{policy}.log", "w")
    serve = [CONVEYOR, "serve", "--replicas", str(args.replicas), "--routing", policy, "--port", str(args.port),
             "--log-level", args.log_level]
    if args.num_kv_blocks:
        serve += ["--num-kv-blocks", str(args.num_kv_blocks)]
    server = subprocess.Popen(serve, stdout=log, stderr=log, cwd=ROOT)
    try:
        wait_healthy(args.port, server)
        bench = [CONVEYOR, "bench", "serve", "--base-url", f"http://127.0.0.1:{args.port}", "--model", "smollm2-135m",
                 "--dataset", "multi-turn", "--num-prompts", str(args.conversations * args.turns),
                 "--num-turns", str(args.turns), "--input-len", str(args.input_len), "--turn-len", str(args.turn_len),
                 "--output-len", str(args.output_len), "--think-time", str(args.think_time),
                 "--request-rate", str(args.request_rate), "--disable-tqdm",
                 "--save-result", str(Path(args.out_dir) / f"bench-{policy}.json"), *bench_args]
        print(f"--- {policy}: {' '.join(bench[1:])}", flush=True)
        subprocess.run(bench, check=True, cwd=ROOT)
        return scrape(args.port)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def summary(workers: dict[str, dict[str, float]]) -> dict[str, float]:
    prompt = sum(w.get("prompt_tokens", 0) for w in workers.values())
    cached = sum(w.get("cached_tokens", 0) for w in workers.values())
    requests = [w.get("requests", 0) for w in workers.values()]
    computed = [w.get("prompt_tokens", 0) - w.get("cached_tokens", 0) for w in workers.values()]
    return {
        "hit_rate": cached / prompt if prompt else 0.0,
        "request_imbalance": max(requests) / (sum(requests) / len(requests)) - 1 if sum(requests) else 0.0,
        "computed_imbalance": max(computed) / (sum(computed) / len(computed)) - 1 if sum(computed) else 0.0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--input-len", type=int, default=256, help="first turn's prompt tokens")
    parser.add_argument("--turn-len", type=int, default=32, help="new user tokens per later turn")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--think-time", type=float, default=1.0)
    parser.add_argument("--request-rate", type=float, default=1.0, help="conversations started per second")
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="each replica's KV pool in blocks of 16 tokens (default: the server's, 1 GiB)")
    parser.add_argument("--port", type=int, default=8951)
    parser.add_argument("--log-level", default="warning", help="the servers' (debug: every routing decision)")
    parser.add_argument("--policies", nargs="+", default=["least-load", "cache-aware"])
    parser.add_argument("--out-dir", default=str(ROOT / "out" / "replica_routing"))
    args, bench_args = parser.parse_known_args()
    bench_args = [a for a in bench_args if a != "--"]
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    results = {policy: run(policy, args, bench_args) for policy in args.policies}
    print(f"\n{'routing':<12} {'hit rate':>9} {'req imbalance':>14} {'computed imbalance':>19}   per replica "
          "(requests / prompt tokens / cached)")
    for policy, workers in results.items():
        s = summary(workers)
        per = "  ".join(f"{name}: {w.get('requests', 0):.0f}/{w.get('prompt_tokens', 0):.0f}/"
                        f"{w.get('cached_tokens', 0):.0f}" for name, w in sorted(workers.items()))
        print(f"{policy:<12} {s['hit_rate']:>9.3f} {s['request_imbalance']:>13.1%} {s['computed_imbalance']:>18.1%}   {per}")
    if {"least-load", "cache-aware"} <= results.keys():
        base = summary(results["least-load"])["hit_rate"]
        aware = summary(results["cache-aware"])["hit_rate"]
        print(f"\ncache-aware hit rate / least-load: {aware / base:.2f}x" if base else "\nleast-load had no hits")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
