"""Chaos (issue 18): good greedy streams run while other clients fire every bad case at the same
server, disconnect mid-stream and send oversize bodies. Every good stream equals its clean run
token for token, /health stays 200, and no KV block is left in use afterwards."""
from __future__ import annotations

import json
import random
import threading
import time

from tests.api.conftest import TINY_MAX_REQUEST_BYTES, httpx, metric

CHAOS_SECONDS = 20
PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time", "1, 2, 3,", "Hello", "Zebras and"]


def good_body(prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True, "stream": True,
            "logprobs": 0}


def stream_tokens(client: httpx.Client, prompt: str) -> list[str]:
    tokens: list[str] = []
    with client.stream("POST", "/v1/completions", json=good_body(prompt)) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                tokens += choice["logprobs"]["tokens"]
    return tokens


def bad_cases() -> list[tuple[str, bytes]]:
    """Every case of issue 18 and then some: (path, raw body)."""
    cases = [
        {"prompt": "hi", "top_k": 9223372036854775808, "max_tokens": 2},
        {"prompt": "hi", "temperature": 1e-50, "max_tokens": 2},
        {"prompt": "hi", "seed": 2**64, "max_tokens": 2},
        {"prompt": "hi", "n": 16, "seed": 2**63 - 3, "max_tokens": 2},
        {"prompt": "hi", "max_tokens": 10**12},
        {"prompt": list(range(5, 5000)), "max_tokens": 2},
        {"prompt": [1, 10**9]},
        {"prompt": "hi", "stop": ["x"] * 50},
        {"prompt": [[1, 2], "mixed"]},
        {"prompt": "", "max_tokens": 2},
    ]
    raw = [("/v1/completions", json.dumps(c).encode()) for c in cases]
    raw += [
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\udc00"}]}'),
        ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}'),
        ("/v1/completions", b'{"prompt": "hi", "top_p": Infinity}'),
        ("/v1/completions", b'{"prompt": '),
        ("/v1/completions", b"\xff\xfe garbage"),
        ("/v1/completions", b'{"prompt": "' + b"z" * (TINY_MAX_REQUEST_BYTES + 10) + b'"}'),
        ("/v1/chat/completions", b'{"messages": []}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "' + b"w " * 60_000 + b'"}]}'),
    ]
    return raw


def test_good_streams_are_untouched_by_chaos(tiny_server):
    base = tiny_server.base_url
    with httpx.Client(base_url=base, timeout=60) as client:
        clean = {p: stream_tokens(client, p) for p in PROMPTS}
    assert all(len(t) == 20 for t in clean.values())

    stop = threading.Event()
    problems: list[str] = []
    counts = {"good": 0, "bad": 0, "disconnects": 0, "health": 0}
    lock = threading.Lock()

    def note(kind: str) -> None:
        with lock:
            counts[kind] += 1

    def good_client(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=base, timeout=60) as client:
            while not stop.is_set():
                prompt = rng.choice(PROMPTS)
                try:
                    tokens = stream_tokens(client, prompt)
                except Exception as exc:  # a good request lost is a failure too
                    problems.append(f"good request {prompt!r} failed: {exc!r}")
                    continue
                if tokens != clean[prompt]:
                    problems.append(f"{prompt!r}: {tokens} != {clean[prompt]}")
                note("good")

    def bad_client() -> None:
        cases = bad_cases()
        with httpx.Client(base_url=base, timeout=60) as client:
            while not stop.is_set():
                for path, body in cases:
                    try:
                        response = client.post(path, content=body, headers={"content-type": "application/json"})
                        if response.status_code >= 500:
                            problems.append(f"{response.status_code} for {body[:80]!r}: {response.text[:200]}")
                    except httpx.TransportError:
                        pass  # an oversize body: the server may close the connection after its 413
                    note("bad")
                health = client.get("/health")
                if health.status_code != 200:
                    problems.append(f"/health {health.status_code}")
                note("health")

    def disconnecting_client(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            body = {**good_body(rng.choice(PROMPTS)), "max_tokens": 40}
            try:
                with httpx.Client(base_url=base, timeout=60) as client:
                    with client.stream("POST", "/v1/completions", json=body) as response:
                        lines = response.iter_lines()
                        for _ in range(rng.randint(0, 6)):
                            next(lines, None)
            except httpx.TransportError:
                pass
            note("disconnects")

    threads = [threading.Thread(target=good_client, args=(i,)) for i in range(3)]
    threads += [threading.Thread(target=bad_client), threading.Thread(target=disconnecting_client, args=(7,))]
    for t in threads:
        t.start()
    time.sleep(CHAOS_SECONDS)
    stop.set()
    for t in threads:
        t.join(90)
    assert not problems, problems[:5]
    assert counts["good"] >= 6 and counts["bad"] >= 20 and counts["disconnects"] >= 3, counts

    with httpx.Client(base_url=base, timeout=30) as client:
        deadline = time.monotonic() + 10  # an abort lands within a step
        while True:
            page = client.get("/metrics").text
            idle = (metric(page, "conveyor:num_requests_running") == 0
                    and metric(page, "conveyor:num_requests_waiting") == 0
                    and metric(page, "conveyor:kv_cache_usage_perc") == 0.0)
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert idle, page
        assert client.get("/health").status_code == 200
