"""The server's sampling controls, tokenizer endpoints and exact streams, on the real model:
one chunk per generated token (empty text included), the chat role with the first token,
echo and prompt logprobs equal to the offline engine's, stop strings that free the KV at once."""
from __future__ import annotations

import json
import time

import pytest

from tests.api.conftest import MODEL, metric

PROMPT = "The capital of France is"


def sse(http, path: str, body: dict) -> list[dict]:
    events = []
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_tokenize_detokenize_and_version(http, offline_tokenizer):
    ids = offline_tokenizer.encode(PROMPT)
    reply = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert reply["tokens"] == ids and reply["count"] == len(ids) and reply["max_model_len"] > 1000
    strs = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()["token_strs"]
    assert strs == [offline_tokenizer.token_to_str(t) for t in ids]
    messages = [{"role": "user", "content": "Hi"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == offline_tokenizer.encode(offline_tokenizer.apply_chat_template(messages))
    assert http.post("/detokenize", json={"model": MODEL, "tokens": ids}).json() == {"prompt": PROMPT, "content": PROMPT}
    round_trip = http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert round_trip == offline_tokenizer.apply_chat_template(messages)  # special tokens kept
    bad = http.post("/detokenize", json={"tokens": [1, 10**8]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert http.post("/tokenize", json={"prompt": "x", "nonsense": 1}).status_code == 400
    assert http.get("/version").json()["version"]


@pytest.fixture(scope="module")
def offline_tokenizer():
    from conveyor.model.loader import load_checkpoint, resolve_model_path

    return load_checkpoint(str(resolve_model_path(None))).tokenizer


def test_one_chunk_per_token_even_when_its_text_is_empty(http, offline_tokenizer):
    # Bias the model onto the lone byte 0xE2 (the first of a 3-byte character): no token completes it.
    byte = offline_tokenizer.encode("☕")[0]
    assert offline_tokenizer.decode([byte]) == "\ufffd"
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logit_bias": {str(byte): 100}}
    events = sse(http, "/v1/completions", body)
    chunks = [e for e in events if e["choices"]]
    assert len(chunks) == 3 == events[-1]["usage"]["completion_tokens"]
    assert [c["choices"][0]["text"] for c in chunks[:2]] == ["", ""]  # held back, but sent
    full = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full


def test_multibyte_streams_count_every_token_and_chat_sends_the_role_with_the_first(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Écris « café crème » et ☕ trois fois."}],
            "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    events = sse(http, "/v1/chat/completions", body)
    chunks = [e for e in events if e["choices"]]
    assert len(chunks) == 24 == events[-1]["usage"]["completion_tokens"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    full = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == full


def test_penalties_bias_min_tokens_and_stop_token_ids_reach_the_sampler(http, offline_tokenizer):
    def complete(**kw) -> dict:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **kw}
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]

    forced = offline_tokenizer.encode(" banana")[0]
    assert complete(logit_bias={str(forced): 100}, max_tokens=3)["text"] == " banana" * 3
    plain = complete(max_tokens=24, ignore_eos=True)["text"]
    repeated = complete(max_tokens=24, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0,
                        repetition_penalty=1.5)["text"]
    assert repeated != plain  # the exact effect is checked against its definition in tests/sampling
    first_word = offline_tokenizer.encode(plain)[1]
    stopped = complete(stop_token_ids=[first_word], max_tokens=24, ignore_eos=True)
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == first_word
    held = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                              "ignore_eos": True, "stop_token_ids": [first_word], "min_tokens": 6})
    assert held.json()["usage"]["completion_tokens"] >= 6
    # min_p 1 keeps only the likeliest token: sampling at any temperature is greedy.
    assert complete(min_p=1.0, temperature=1.5, seed=1, max_tokens=6)["text"] == complete(max_tokens=6)["text"]


def test_echo_and_prompt_logprobs_equal_the_engines(http, offline_tokenizer):
    from conveyor import SamplingParams
    from conveyor.engine.llm import LLM

    ids = offline_tokenizer.encode(PROMPT)
    full = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                              "echo": True, "logprobs": 1}).json()["choices"][0]
    assert full["text"].startswith(PROMPT)
    lp = full["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 2 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"]) == full["text"] and lp["text_offset"][len(ids)] == len(PROMPT)
    vllm_style = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1,
                                                    "temperature": 0, "prompt_logprobs": 0}).json()["choices"][0]
    scored = vllm_style["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    engine = LLM(max_num_seqs=2).engine  # an engine of our own: its prompt logprobs are tested against HF's
    rid = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    reference = next(o for o in engine.step() if o.request_id == rid).prompt_logprobs
    for position in range(1, len(ids)):
        want = reference[position][ids[position]]
        assert scored[position][str(ids[position])]["logprob"] == pytest.approx(want, abs=1e-4)
        assert lp["token_logprobs"][position] == pytest.approx(want, abs=1e-4)
    # max_tokens 0 with echo (OpenAI's scoring): the prompt and its logprobs alone, streamed or not.
    for stream in (False, True):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1, "stream": stream,
                "return_token_ids": True, **({"stream_options": {"include_usage": True}} if stream else {})}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        if stream:
            chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
            choices = [c["choices"][0] for c in chunks if c.get("choices")]
            text, usage = "".join(c["text"] for c in choices), chunks[-1]["usage"]
            tokens = [t for c in choices if c.get("logprobs") for t in c["logprobs"]["tokens"]]
            ids_back = [t for c in choices for t in c.get("token_ids") or []]
            finish = choices[-1]["finish_reason"]
        else:
            answer = response.json()
            choice, usage = answer["choices"][0], answer["usage"]
            text, tokens, ids_back = choice["text"], choice["logprobs"]["tokens"], choice["token_ids"]
            finish = choice["finish_reason"]
            assert choice["logprobs"]["token_logprobs"][1:] == lp["token_logprobs"][1 : len(ids)]
        assert (text, tokens, ids_back) == (PROMPT, lp["tokens"][: len(ids)], [])
        assert (usage["prompt_tokens"], usage["completion_tokens"], finish) == (len(ids), 0, "length")
    refused = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 0}).json()["error"]
    assert refused["param"] == "max_tokens" and "only with echo" in refused["message"]


def test_a_stop_string_ends_the_request_and_frees_its_kv_at_once(http, server):
    base = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 16,
                                              "temperature": 0}).json()["choices"][0]["text"]
    stop = base.split()[2]
    before = metric(http.get("/metrics").text, "conveyor:generation_tokens_total")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            "stop": [stop]}
    reply = http.post("/v1/completions", json=body).json()
    assert reply["choices"][0]["text"] == base[: base.index(stop)]
    assert reply["choices"][0]["finish_reason"] == "stop" and reply["choices"][0]["stop_reason"] == stop
    deadline = time.monotonic() + 10
    while True:
        page = http.get("/metrics").text
        if metric(page, "conveyor:num_requests_running") == 0 and metric(page, "conveyor:kv_cache_usage_perc") == 0:
            break
        assert time.monotonic() < deadline, page
        time.sleep(0.05)
    generated = metric(page, "conveyor:generation_tokens_total") - before
    assert generated <= reply["usage"]["completion_tokens"] + 3  # not 1500: it ended at the stop string


def test_cache_salt_shares_cached_blocks_only_between_requests_with_the_same_salt(http):
    # A prompt no other test sends, long enough for several full 16-token blocks.
    prompt = "Salted prefix caching test. " + " ".join(f"item {i} is {i * i}," for i in range(40))

    def cached(**extra) -> tuple[int, str]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        data = reply.json()
        return data["usage"]["prompt_tokens_details"]["cached_tokens"], data["choices"][0]["text"]

    first, text = cached(cache_salt="tenant-a")
    assert first == 0
    assert cached(cache_salt="tenant-b") == (0, text), "another salt never hits tenant a's blocks"
    assert cached() == (0, text), "nor does a request with no salt"
    hit, again = cached(cache_salt="tenant-a")
    assert hit >= 16 * 8 and again == text
    assert cached()[0] >= 16 * 8, "unsalted requests share among themselves"
    for bad in ("", 7, ["a"]):
        reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "cache_salt": bad})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "cache_salt", reply.text


def test_allowed_token_ids_and_bad_words_constrain_the_real_models_output(http, offline_tokenizer):
    def complete(**extra) -> dict:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True,
                **extra}
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]

    base = complete()
    word = base["text"].split()[0].strip(".,")  # the model's first word: " Paris"
    assert word
    allowed = sorted(set(offline_tokenizer.encode(" London is a city, and so is Rome.", add_special_tokens=False)))
    assert base["token_ids"][0] not in allowed
    for extra in ({}, {"temperature": 1.0, "seed": 11}):
        got = complete(allowed_token_ids=allowed, **extra)["token_ids"]
        assert len(got) == 8 and set(got) <= set(allowed), (extra, got)
    banned = complete(bad_words=[word])
    sequences = [offline_tokenizer.encode(text, add_special_tokens=False) for text in (word, " " + word)]
    ids = banned["token_ids"]
    assert not any(ids[i:i + len(s)] == s for s in sequences for i in range(len(ids))), banned
    assert banned["token_ids"][0] != base["token_ids"][0]
    for field, value in (("allowed_token_ids", [10**8]), ("allowed_token_ids", []), ("bad_words", [" "]),
                         ("bad_words", "Paris")):
        reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", field: value})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field, reply.text


def test_continue_final_message_goes_on_with_the_callers_opening(http, offline_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0}
    rendered = http.post("/tokenize", json={"messages": messages, "continue_final_message": True}).json()["tokens"]
    text = offline_tokenizer.decode(rendered, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\nThe capital of France is")
    reply = http.post("/v1/chat/completions", json={**body, "continue_final_message": True})
    assert reply.status_code == 200, reply.text
    # The same tokens as a plain completion of the rendered text: the reply goes on with the opening.
    plain = http.post("/v1/completions", json={"model": MODEL, "prompt": rendered, "max_tokens": 6, "temperature": 0})
    assert reply.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["text"]
    assert reply.json()["usage"]["prompt_tokens"] == len(rendered)
    both = http.post("/v1/chat/completions", json={**body, "continue_final_message": True,
                                                   "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message", both.text
    empty = http.post("/v1/chat/completions", json={**body, "messages": [*messages[:1], {"role": "assistant"}],
                                                    "continue_final_message": True})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "continue_final_message", empty.text


def test_logprob_tokens_named_by_id_on_request(http):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True,
            "return_token_ids": True}
    named = http.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True}).json()["choices"][0]
    plain = http.post("/v1/completions", json=body).json()["choices"][0]
    tokens = named["logprobs"]["tokens"]
    assert tokens[-3:] == [f"token_id:{t}" for t in named["token_ids"]]
    assert len(tokens) == len(plain["logprobs"]["tokens"]) and all(t.startswith("token_id:") for t in tokens)
    assert named["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    assert all(k.startswith("token_id:") for top in named["logprobs"]["top_logprobs"][1:] for k in top)
    chat = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0,
        "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}).json()["choices"][0]["logprobs"]
    assert all(c["token"].startswith("token_id:") and all(t["token"].startswith("token_id:")
                                                          for t in c["top_logprobs"]) for c in chat["content"])


THINKING_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def custom_server(tmp_path_factory):
    """A second server on the default model: a chat template that reads a variable, priority
    scheduling, and one request running at a time (so the queue's order shows)."""
    from tests.api.conftest import start_server

    template = tmp_path_factory.mktemp("template") / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    srv = start_server("--chat-template", str(template), "--scheduling-policy", "priority", "--max-num-seqs", "1",
                       "--num-threads", "1")
    yield srv
    srv.stop()


def test_chat_template_kwargs_reach_the_template_and_unknown_ones_are_refused(http, custom_server):
    import httpx

    messages = [{"role": "user", "content": "Hi"}]
    with httpx.Client(base_url=custom_server.base_url, timeout=60.0) as own:
        plain = own.post("/tokenize", json={"messages": messages, "return_token_strs": True}).json()
        off = own.post("/tokenize", json={"messages": messages, "return_token_strs": True,
                                          "chat_template_kwargs": {"enable_thinking": False}}).json()
        assert off["count"] > plain["count"] and "".join(off["token_strs"]).endswith("</think>ĊĊ")
        body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0,
                "chat_template_kwargs": {"enable_thinking": False}}
        reply = own.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == off["count"], reply.text
        for kwargs in ({"enable_thinking": False, "think_harder": True}, {"messages": []}):
            bad = own.post("/v1/chat/completions", json={**body, "chat_template_kwargs": kwargs})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs", bad.text
    # SmolLM2's own template reads no variable of the caller's.
    refused = http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"


def test_priority_scheduling_serves_the_urgent_request_before_those_queued_earlier(http, custom_server):
    import concurrent.futures

    import httpx

    finished: list[str] = []

    def complete(name: str, max_tokens: int, priority: int) -> None:
        body = {"model": MODEL, "prompt": f"{name}: once upon a time", "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "priority": priority}
        with httpx.Client(base_url=custom_server.base_url, timeout=120.0) as own:
            reply = own.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        finished.append(name)

    def wait_for(running: int, waiting: int) -> None:
        deadline = time.monotonic() + 60
        with httpx.Client(base_url=custom_server.base_url, timeout=10.0) as own:
            while time.monotonic() < deadline:
                page = own.get("/metrics").text
                if (metric(page, "conveyor:num_requests_running"), metric(page, "conveyor:num_requests_waiting")) \
                        == (running, waiting):
                    return
                time.sleep(0.02)
        raise AssertionError(f"the server never had {running} running and {waiting} waiting")

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(complete, "first", 256, 0)]  # it holds the one running seat a while
        wait_for(1, 0)
        # The two queued earlier run long enough after "urgent" that the order in which the client
        # threads see their replies is the order the server finished them ("first" and "urgent"
        # may reach their threads in either order: one ends the step before the other starts).
        jobs += [pool.submit(complete, name, 32, priority) for name, priority in (("low", 5), ("later", 5))]
        wait_for(1, 2)
        jobs.append(pool.submit(complete, "urgent", 4, -10))
        for job in jobs:
            job.result()
    assert sorted(finished[:2]) == ["first", "urgent"] and sorted(finished[2:]) == ["later", "low"], finished
    refused = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "priority": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority", refused.text


def test_request_id_names_the_response_and_cannot_be_in_flight_twice(http):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    assert http.post("/v1/completions", json={**body, "request_id": "job-7"}).json()["id"] == "cmpl-job-7"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "request_id": "job-7"}
    assert http.post("/v1/chat/completions", json=chat).json()["id"] == "chatcmpl-job-7"
    long = {**body, "max_tokens": 200, "ignore_eos": True, "stream": True, "request_id": "job-8"}
    with http.stream("POST", "/v1/completions", json=long) as stream:
        lines = stream.iter_lines()  # kept: a dropped iterator closes the stream, which aborts the request
        assert next(lines).startswith("data: ")  # it is running
        twin = http.post("/v1/completions", json={**body, "request_id": "job-8"})
        assert twin.status_code == 400 and twin.json()["error"]["param"] == "request_id", twin.text
    for bad in ("", "has space", 7):
        reply = http.post("/v1/completions", json={**body, "request_id": bad})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "request_id", reply.text


@pytest.mark.parametrize("stream", [False, True])
def test_return_token_ids_gives_the_prompts_ids_too(http, offline_tokenizer, stream):
    """vLLM's places: each completion choice holds prompt_token_ids, a chat answer holds them once
    beside its choices; streamed, with the first chunk."""
    def answer(path: str, body: dict) -> list[dict]:
        reply = http.post(path, json={"model": MODEL, "max_tokens": 3, "temperature": 0, "return_token_ids": True,
                                      "stream": stream, **body})
        assert reply.status_code == 200, reply.text
        if not stream:
            return [reply.json()]
        return [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]

    prompts = ["The capital of France is", "Once upon a time"]
    completions = answer("/v1/completions", {"prompt": prompts})
    for index, prompt in enumerate(prompts):
        mine = [c for body in completions for c in body["choices"] if c["index"] == index]
        given = [c["prompt_token_ids"] for c in mine if "prompt_token_ids" in c]
        assert given == [offline_tokenizer.encode(prompt)]
    messages = [{"role": "user", "content": "Hi"}]
    rendered = offline_tokenizer.encode_chat(offline_tokenizer.apply_chat_template(messages))
    chat = answer("/v1/chat/completions", {"messages": messages, "n": 2, "seed": 1, "temperature": 1.0})
    assert [b["prompt_token_ids"] for b in chat if "prompt_token_ids" in b] == [rendered]
    assert not any("prompt_token_ids" in c for b in chat for c in b["choices"])


def test_fields_a_request_leaves_out_take_the_model_recommendation(tmp_path):
    from tests.api.conftest import httpx, start_server

    # vLLM's --generation-config FOLDER (a model's own generation_config.json is read the same way)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "repetition_penalty": 1.3, "max_new_tokens": 4}))
    srv = start_server("--generation-config", str(tmp_path))
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60.0) as http:
            def completion(**fields) -> dict:
                reply = http.post("/v1/completions", json={"prompt": PROMPT, **fields})
                assert reply.status_code == 200, reply.text
                return reply.json()

            recommended = completion()
            assert recommended["usage"]["completion_tokens"] == 4  # min(OpenAI's 16, the recommended 4)
            assert recommended["choices"][0]["text"] == completion(
                temperature=0, repetition_penalty=1.3, max_tokens=4)["choices"][0]["text"]
            # what a request sends wins: here no penalty, and more tokens
            unpenalized = completion(repetition_penalty=1.0, max_tokens=8)
            assert unpenalized["usage"]["completion_tokens"] == 8
            assert not unpenalized["choices"][0]["text"].startswith(recommended["choices"][0]["text"])
            chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
            assert chat["usage"]["completion_tokens"] <= 4  # the room left in the context, at most the recommended
    finally:
        srv.stop()
