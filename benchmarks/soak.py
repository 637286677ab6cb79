"""Bounded soak of `conveyor serve`: good greedy streams run for --minutes while a client fires
bad requests (every case of issue 18) at --bad-rate per second and a share of good-looking streams
disconnect early. Reports good requests lost or altered (against each prompt's clean run), leaked
KV blocks (KV usage and running/waiting requests once idle), and the server's RSS after warm-up
and at the end.

    .venv/bin/python benchmarks/soak.py --minutes 10
    .venv/bin/python benchmarks/soak.py --minutes 2 --max-num-seqs 8   # what docs/BENCHMARKS.md ran
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.api.conftest import httpx, metric, start_server  # noqa: E402
from tests.api.test_chaos import PROMPTS, bad_cases, good_body, stream_tokens  # noqa: E402

MAX_REQUEST_BYTES = 256 * 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--good-clients", type=int, default=3, help="concurrent good streams")
    parser.add_argument("--bad-rate", type=float, default=10.0, help="bad requests per second")
    parser.add_argument("--disconnect-share", type=float, default=0.2,
                        help="share of streams that hang up after a few chunks")
    parser.add_argument("--warmup-s", type=float, default=30.0, help="RSS is taken as the baseline after this")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--model", default=None, help="default: the shipped SmolLM2-135M")
    args = parser.parse_args()

    server_args = ["--max-num-seqs", str(args.max_num_seqs), "--max-request-bytes", str(MAX_REQUEST_BYTES),
                   "--num-threads", "2"]
    server = start_server(*([args.model] if args.model else []), *server_args)
    base = server.base_url
    proc = psutil.Process(server.proc.pid)
    try:
        with httpx.Client(base_url=base, timeout=120) as client:
            clean = {p: stream_tokens(client, p) for p in PROMPTS}
        stop = threading.Event()
        lock = threading.Lock()
        stats = {"good": 0, "lost": 0, "altered": 0, "bad": 0, "bad_5xx": 0, "disconnects": 0, "health_fail": 0}
        examples: list[str] = []

        def count(key: str, example: str | None = None) -> None:
            with lock:
                stats[key] += 1
                if example and len(examples) < 5:
                    examples.append(example)

        def good_client(seed: int) -> None:
            rng = random.Random(seed)
            with httpx.Client(base_url=base, timeout=120) as client:
                while not stop.is_set():
                    prompt = rng.choice(PROMPTS)
                    if rng.random() < args.disconnect_share:
                        try:
                            with httpx.Client(base_url=base, timeout=120) as own:  # hung up on with it
                                with own.stream("POST", "/v1/completions",
                                                json={**good_body(prompt), "max_tokens": 40}) as r:
                                    lines = r.iter_lines()
                                    for _ in range(rng.randint(0, 6)):
                                        next(lines, None)
                        except httpx.TransportError:
                            pass
                        count("disconnects")
                        continue
                    try:
                        tokens = stream_tokens(client, prompt)
                    except Exception as exc:
                        count("lost", repr(exc))
                        continue
                    if tokens != clean[prompt]:
                        count("altered", f"{prompt!r}: {tokens}")
                    count("good")

        def bad_client() -> None:
            cases = bad_cases()
            rng = random.Random(0)
            with httpx.Client(base_url=base, timeout=120) as client:
                next_at = time.monotonic()
                while not stop.is_set():
                    path, body = rng.choice(cases)
                    try:
                        r = client.post(path, content=body, headers={"content-type": "application/json"})
                        if r.status_code >= 500:
                            count("bad_5xx", f"{r.status_code} {r.text[:120]}")
                    except httpx.TransportError:
                        pass  # an oversize body: the connection may close after the 413
                    count("bad")
                    if stats["bad"] % 20 == 0 and client.get("/health").status_code != 200:
                        count("health_fail")
                    next_at += 1.0 / args.bad_rate
                    time.sleep(max(0.0, next_at - time.monotonic()))

        threads = [threading.Thread(target=good_client, args=(i,)) for i in range(args.good_clients)]
        threads.append(threading.Thread(target=bad_client))
        for t in threads:
            t.start()
        started = time.monotonic()
        time.sleep(min(args.warmup_s, args.minutes * 60))
        rss_warm = proc.memory_info().rss
        samples = [rss_warm]
        while time.monotonic() - started < args.minutes * 60:
            time.sleep(5)
            samples.append(proc.memory_info().rss)
        stop.set()
        for t in threads:
            t.join(180)
        with httpx.Client(base_url=base, timeout=30) as client:
            deadline = time.monotonic() + 15
            while True:
                page = client.get("/metrics").text
                running = metric(page, "conveyor:num_requests_running")
                waiting = metric(page, "conveyor:num_requests_waiting")
                kv = metric(page, "conveyor:kv_cache_usage_perc")
                if (running, waiting, kv) == (0, 0, 0.0) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        rss_end = proc.memory_info().rss
        report = {
            "minutes": args.minutes, **stats, "running_after": running, "waiting_after": waiting,
            "kv_usage_after": kv, "rss_after_warmup_mb": round(rss_warm / 2**20, 1),
            "rss_end_mb": round(rss_end / 2**20, 1), "rss_max_mb": round(max(samples) / 2**20, 1),
            "rss_end_vs_warm": round(rss_end / rss_warm, 3),
        }
        print(json.dumps(report, indent=1))
        for example in examples:
            print("example:", example)
        ok = (stats["lost"] == stats["altered"] == stats["bad_5xx"] == stats["health_fail"] == 0
              and (running, waiting, kv) == (0, 0, 0.0) and rss_end <= 1.10 * rss_warm)
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1
    finally:
        server.stop()


if __name__ == "__main__":
    raise SystemExit(main())
