"""The server driven by the official openai client: completions and chat, streaming and not, n,
stop strings, seeds, logprobs, 32 concurrent streams against the offline engine, disconnects."""
from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.api.conftest import MODEL, Server, httpx, metric

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def offline():
    from conveyor import LLM

    return LLM(max_num_seqs=64)


def greedy_offline(offline, prompts, max_tokens: int, chat: bool = False) -> list:
    from conveyor import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    if chat:
        prompts = [offline.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    # On a worker thread, like the server's engine loop: on a busy 2-core machine torch's OpenMP
    # pool is several times slower driven from the main thread.
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(offline.generate, prompts, params).result()


def test_models_health_and_metric_names(server, http):
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert http.get("/health").json() == {"status": "ok"}
    page = http.get("/metrics").text
    for name in (
        "conveyor:num_requests_running", "conveyor:num_requests_waiting", "conveyor:kv_cache_usage_perc",
        "conveyor:num_preemptions_total", "conveyor:prompt_tokens_total", "conveyor:generation_tokens_total",
        "conveyor:time_to_first_token_seconds_bucket", "conveyor:time_per_output_token_seconds_bucket",
        "conveyor:inter_token_latency_seconds_bucket", "conveyor:e2e_request_latency_seconds_bucket",
        "conveyor:request_queue_time_seconds_bucket", "conveyor:batch_size_bucket",
        # the process's own, as vLLM's page has them
        "process_resident_memory_bytes", "process_cpu_seconds_total", "python_info", "python_gc_collections_total",
    ):
        assert name in page, name
    resident = next(float(line.split()[1]) for line in page.splitlines()
                    if line.startswith("process_resident_memory_bytes "))
    status = dict(line.split(":", 1) for line in open(f"/proc/{server.proc.pid}/status").read().splitlines() if ":" in line)
    assert resident == pytest.approx(int(status["VmRSS"].split()[0]) * 1024, rel=0.1)  # the server process's own


def test_completion_and_stream_equal_offline_greedy(client, offline):
    expected = greedy_offline(offline, [PROMPT], 16)[0]
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    assert full.choices[0].text == expected.text
    assert full.choices[0].finish_reason == expected.finish_reason
    assert full.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert full.usage.completion_tokens == len(expected.token_ids)

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_and_stream_equal_offline_greedy(client, offline):
    question = "What is the capital of France?"
    expected = greedy_offline(offline, [question], 24, chat=True)[0]
    messages = [{"role": "user", "content": question}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == expected.text
    assert full.choices[0].finish_reason == expected.finish_reason

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=24,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_n2_gives_two_finished_choices(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=2)
    assert sorted(c.index for c in full.choices) == [0, 1]
    assert all(c.finish_reason in ("stop", "length") and c.text for c in full.choices)
    assert full.usage.completion_tokens <= 16

    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a color."}],
                                            max_tokens=8, temperature=1.0, seed=7, n=2, stream=True)
    texts, finished = {0: "", 1: ""}, {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert set(finished) == {0, 1} and all(texts.values())


def test_stop_string_cuts_text_streamed_and_not(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    words = base.split()
    assert len(words) >= 3, base
    stop = words[2]  # a stop string in the middle of the greedy answer
    cut = base[: base.index(stop)]
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "@@"])
    assert full.choices[0].text == cut and full.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop,
                                            stream=True))
    pieces = [c.choices[0].text for c in chunks]
    assert "".join(pieces) == cut and chunks[-1].choices[0].finish_reason == "stop"
    assert all(stop not in "".join(pieces[: i + 1]) for i in range(len(pieces)))


def test_seed_reproducible(client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0,
                                         seed=seed).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert len({sample(s) for s in (1, 2, 3)} | {first}) > 1  # the seed does change the draw


def test_logprobs_shapes(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == full.choices[0].text
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and logprob <= 0
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)  # greedy: the chosen token is the best
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # Sampled: the chosen token is always among top_logprobs (OpenAI's legacy shape: up to k + 1).
    hot = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.5, seed=3,
                                    logprobs=1).choices[0].logprobs
    assert all(token in top and top[token] == logprob and len(top) <= 2
               for token, logprob, top in zip(hot.tokens, hot.token_logprobs, hot.top_logprobs))
    assert any(len(top) == 2 for top in hot.top_logprobs), "no unlikely token drawn: the test shows nothing"

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 and e.bytes for e in content)


def test_stream_of_multibyte_text_is_whole_characters(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Écris « café crème » et ☕ trois fois."}],
            "max_tokens": 32, "temperature": 0}
    full = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    pieces = []
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces += [c["delta"].get("content", "") for c in json.loads(line[6:])["choices"]]
    assert "".join(pieces) == full
    assert not any("\ufffd" in p for p in pieces)


PROMPTS = [f"Write one fact about the number {i}." for i in range(24)] + [
    "The capital of France is", "def fibonacci(n):", "Once upon a time", "The best way to learn Python is",
    "Water boils at", "My favourite colour is", "In 1969, humans", "The three primary colors are",
]


def test_32_concurrent_streams_equal_offline_greedy(server: Server, offline):
    import openai

    expected = greedy_offline(offline, PROMPTS, 16)

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None]:
        text, reason = "", None
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                 stream=True)
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def main() -> list:
        async with openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    got = asyncio.run(main())
    assert len(got) == 32
    for prompt, (text, reason), exp in zip(PROMPTS, got, expected):
        assert (text, reason) == (exp.text, exp.finish_reason), prompt


def test_disconnect_aborts_and_frees_kv(server: Server, http):
    before = http.get("/metrics").text
    aborted0 = metric(before, "conveyor:request_success_total", finished_reason="abort")
    generated0 = metric(before, "conveyor:generation_tokens_total")
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 2000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    received = 0
    with httpx.stream("POST", f"{server.v1}/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                received += 1
                if received == 5:
                    break  # leaving the block closes the connection mid-answer
    with pytest.raises(httpx.TimeoutException):  # a non-streaming client that gives up waiting
        httpx.post(f"{server.v1}/completions", json={**body, "stream": False}, timeout=1.0)
    deadline = time.monotonic() + 15
    while True:
        page = http.get("/metrics").text
        idle = (metric(page, "conveyor:num_requests_running") == 0
                and metric(page, "conveyor:kv_cache_usage_perc") == 0.0)
        if idle and metric(page, "conveyor:request_success_total", finished_reason="abort") == aborted0 + 2:
            break
        assert time.monotonic() < deadline, page
        time.sleep(0.1)
    # Aborted promptly: far fewer tokens were generated than the 2 x 2000 asked for.
    assert metric(page, "conveyor:generation_tokens_total") - generated0 < 300
