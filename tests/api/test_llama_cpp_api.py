"""llama.cpp's own API (/completion, /infill) on the real Qwen2.5-Coder-0.5B-Instruct, in-process
over the real engine: the same text as the completion a request amounts to, streamed events that add
up to the whole answer, llama.cpp's order of samplers and its infill sampler, its fields (n_predict
0 warming the cache, n_probs, logit_bias's forms, response_fields, n_indent, t_max_predict_ms), the
payload llama.vscode sends, the fill-in-the-middle prompt's layout, and refusals naming the field."""
from __future__ import annotations

import json
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from conveyor.api.llama_cpp import (INFILL_BATCH, PREFIX_GRID, IndentLimit, InfillFrame, LlamaInfillRequest,
                                   infill_prompt)
from tests.api import coder_app
from tests.api.coder_app import MODEL

app, http = coder_app.app, coder_app.http  # the real model's app, one for this module

PROMPT = "def fibonacci(n):"


def complete(http: TestClient, path: str = "/completion", **fields: Any) -> Any:
    reply = http.post(path, json=fields)
    assert reply.status_code == 200, reply.text
    return reply.json()


def events(http: TestClient, path: str = "/completion", **fields: Any) -> list[dict[str, Any]]:
    reply = http.post(path, json={**fields, "stream": True})
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    frames = [f for f in reply.text.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames) and "[DONE]" not in reply.text  # llama-server sends none
    return [json.loads(f.removeprefix("data: ")) for f in frames]


def test_a_completion_is_the_completion_it_amounts_to(http):
    answer = complete(http, prompt=PROMPT, n_predict=24, temperature=0, return_tokens=True)
    same = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                             "return_token_ids": True}).json()
    choice = same["choices"][0]
    assert answer["content"] == choice["text"] and answer["tokens"] == choice["token_ids"]
    assert answer["stop"] is True and answer["stop_type"] == "limit" and answer["tokens_predicted"] == 24
    assert answer["tokens_evaluated"] == same["usage"]["prompt_tokens"] and answer["prompt"] == PROMPT
    assert answer["model"] == MODEL and answer["id_slot"] == 0 and answer["truncated"] is False
    assert answer["has_new_line"] == ("\n" in answer["content"])
    timings = answer["timings"]
    assert timings["predicted_n"] == 24 and timings["prompt_n"] + timings["cache_n"] == answer["tokens_evaluated"]
    assert timings["prompt_ms"] > 0 and timings["predicted_per_second"] > 0
    settings = answer["generation_settings"]
    assert settings["n_predict"] == 24 and settings["n_ctx"] == 512
    # llama-server's default order, less the samplers that are idle at their defaults
    assert settings["samplers"] == ["top_k", "top_p", "min_p", "temperature"]
    assert (settings["top_k"], settings["top_p"], settings["min_p"]) == (40, 0.95, 0.05)


def test_streamed_events_add_up_to_the_whole_answer(http):
    whole = complete(http, prompt=PROMPT, n_predict=16, temperature=0, return_tokens=True)
    frames = events(http, prompt=PROMPT, n_predict=16, temperature=0, timings_per_token=True)
    parts, last = frames[:-1], frames[-1]
    assert all(f["stop"] is False and "timings" in f for f in parts)
    assert "".join(f["content"] for f in parts) == whole["content"]
    assert [t for f in parts for t in f["tokens"]] == whole["tokens"]  # a stream always carries the ids
    assert last["stop"] is True and last["content"] == "" and last["stop_type"] == "limit"
    assert last["tokens_predicted"] == 16


def test_seeded_sampling_repeats_and_top_k_one_is_greedy(http):
    first = complete(http, prompt=PROMPT, n_predict=16, seed=42)  # llama.cpp's defaults: temperature 0.8 last
    again = complete(http, prompt=PROMPT, n_predict=16, seed=42)
    assert first["content"] == again["content"]
    greedy = complete(http, prompt=PROMPT, n_predict=16, temperature=0)
    assert complete(http, prompt=PROMPT, n_predict=16, top_k=1, temperature=1.5, seed=1)["content"] == greedy["content"]
    # letters: top-k then temperature only
    by_letters = complete(http, prompt=PROMPT, n_predict=4, samplers="kt", temperature=0)
    assert by_letters["generation_settings"]["samplers"] == ["top_k", "temperature"]
    assert by_letters["content"] == complete(http, prompt=PROMPT, n_predict=4, temperature=0)["content"]


def test_a_stop_word_ends_the_answer_and_is_named(http):
    answer = complete(http, prompt=PROMPT, n_predict=48, temperature=0, stop=["return"])
    assert answer["stop_type"] == "word" and answer["stopping_word"] == "return"
    assert "return" not in answer["content"]


def test_n_probs_gives_each_tokens_probabilities_as_llama_cpp(http):
    answer = complete(http, prompt=PROMPT, n_predict=3, temperature=0, n_probs=2, return_tokens=True)
    probs = answer["completion_probabilities"]
    assert [p["id"] for p in probs] == answer["tokens"]
    same = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                             "logprobs": 2}).json()["choices"][0]["logprobs"]
    for p, token, logprob, top in zip(probs, same["tokens"], same["token_logprobs"], same["top_logprobs"]):
        assert p["token"] == token and p["logprob"] == pytest.approx(logprob) and bytes(p["bytes"]) == token.encode()
        assert [t["token"] for t in p["top_logprobs"]] == list(top)
        assert [t["logprob"] for t in p["top_logprobs"]] == pytest.approx(list(top.values()))
        assert all(isinstance(t["id"], int) for t in p["top_logprobs"])


def test_n_predict_zero_computes_the_prompt_into_the_cache(http):
    prompt = "# A module of small numeric helpers.\n" * 6 + "def mean(values):"
    warm = complete(http, prompt=prompt, n_predict=0)
    assert warm["content"] == "" and warm["tokens_predicted"] == 0 and warm["stop_type"] == "limit"
    after = complete(http, prompt=prompt, n_predict=4, temperature=0)
    assert after["tokens_cached"] >= 16 and after["timings"]["cache_n"] == after["tokens_cached"]


def test_logit_bias_in_each_of_llama_cpps_forms(http):
    greedy = complete(http, prompt=PROMPT, n_predict=1, temperature=0, return_tokens=True)
    first = greedy["tokens"][0]
    for bias in ([[first, False]], {str(first): -100}, [[greedy["content"], -100]]):
        other = complete(http, prompt=PROMPT, n_predict=1, temperature=0, return_tokens=True, logit_bias=bias)
        assert other["tokens"][0] != first, bias
    # false bans the token outright, as llama.cpp's -inf: no bias beside it brings it back
    banned = complete(http, prompt=PROMPT, n_predict=1, temperature=0, return_tokens=True,
                      logit_bias=[[first, False], [first, 100]])
    assert banned["tokens"][0] != first
    outside = http.post("/completion", json={"prompt": PROMPT, "logit_bias": [[10**9, False]]})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "logit_bias"
    many = http.post("/completion", json={"prompt": PROMPT, "logit_bias": [[t, False] for t in range(1000, 3000)]})
    assert many.status_code == 400 and many.json()["error"]["param"] == "logit_bias", many.text  # the engine's bound
    for bad in (f'[[{first}, {10**400}]]', "[[1000000000, 5.0]]", f"[[{first}, 500]]"):
        refused = http.post("/completion", content=f'{{"prompt": "x", "n_predict": 1, "logit_bias": {bad}}}',
                            headers={"content-type": "application/json"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "logit_bias", (bad, refused.text)


def test_a_temperature_past_openais_range_is_llama_cpps_to_take(http):
    # llama.cpp does not stop at 2: a temperature of 5 flattens the row (up to the sampler's 100).
    hot = complete(http, prompt=PROMPT, n_predict=8, temperature=5.0, seed=3, return_tokens=True)
    assert hot["generation_settings"]["temperature"] == 5.0 and hot["tokens_predicted"] == 8
    cold = complete(http, prompt=PROMPT, n_predict=8, temperature=0.8, seed=3, return_tokens=True)
    assert hot["tokens"] != cold["tokens"]
    refused = http.post("/completion", json={"prompt": PROMPT, "temperature": 101})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "temperature"


def test_response_fields_keep_only_those_asked(http):
    answer = complete(http, prompt=PROMPT, n_predict=2, temperature=0,
                      response_fields=["content", "generation_settings/n_predict", "no/such"])
    assert set(answer) == {"content", "generation_settings/n_predict"} and answer["generation_settings/n_predict"] == 2


def test_several_prompts_answer_as_a_list(http):
    answers = complete(http, prompt=["def a():", [755, 293, 3932]], n_predict=2, temperature=0)
    assert [a["index"] for a in answers] == [0, 1] and all(a["stop"] for a in answers)


# What llama.vscode sends (its llama-server.ts), with a file of context.
VSCODE = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n",
          "input_extra": [{"text": "def sub(a, b):\n    return a - b\n", "time": 1733580000.0, "filename": "util.py"}],
          "prompt": "", "n_predict": 64, "top_k": 40, "top_p": 0.99, "stream": False, "seed": 3,
          "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "n_indent": 4,
          "t_max_prompt_ms": 500, "t_max_predict_ms": 1000}


def test_llama_vscodes_fill_in_the_middle_request(http):
    answer = complete(http, "/infill", **VSCODE)
    assert answer["stop"] is True and answer["content"].startswith("return a + b")
    assert answer["generation_settings"]["samplers"] == ["top_k", "top_p", "infill"]
    assert answer["prompt"].startswith("<|fim_prefix|>def add") and answer["prompt"].endswith("<|fim_middle|>")
    for key in ("prompt_n", "predicted_n", "predicted_ms"):
        assert key in answer["timings"]
    # its warm-up request: the context computed, nothing written
    warm = complete(http, "/infill", **{**VSCODE, "n_predict": 0, "samplers": [], "t_max_predict_ms": 1})
    assert warm["content"] == "" and warm["tokens_predicted"] == 0


def test_n_indent_ends_at_a_line_indented_less(http):
    code = {"input_prefix": "class Stack:\n    def push(self, item):\n        ", "input_suffix": "",
            "n_predict": 96, "temperature": 0}
    free = complete(http, "/infill", **code)["content"]
    cut = complete(http, "/infill", **code, n_indent=8)
    # the method's line, then a blank one (indented 0, as llama-server counts it): cut there
    assert free.startswith("    self.items.append(item)\n\n    def ")
    assert cut["content"] == "    self.items.append(item)\n" and cut["stop_type"] == "limit"


def test_t_max_predict_ms_ends_on_a_new_line_once_past_its_time(http):
    free = complete(http, prompt=PROMPT, n_predict=200, temperature=0, ignore_eos=True)["content"]
    answer = complete(http, prompt=PROMPT, n_predict=200, temperature=0, ignore_eos=True, t_max_predict_ms=1)
    # the first token past 1 ms that writes a new line ends it: whole lines, none cut
    assert answer["stop_type"] == "limit" and answer["tokens_predicted"] < 200
    assert answer["content"].endswith("\n") and free.startswith(answer["content"])


class _Plain:
    """A toy tokenizer for the prompt layout: one token per character."""

    @staticmethod
    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]


FRAME = InfillFrame(prefix=-1, suffix=-2, middle=-3, repo=-4, file_separator=-5, bos=None)


def test_the_infill_prompt_is_llama_servers():
    body = LlamaInfillRequest(input_prefix="ab", input_suffix="cd", input_extra=[{"filename": "f", "text": "x"}])
    ids = infill_prompt(body, FRAME, _Plain.encode, [ord("p")], n_ctx=INFILL_BATCH + 100)
    extra = [-4, *map(ord, "myproject\n"), -5, *map(ord, "f\n"), ord("x"), -5, *map(ord, "filename\n")]
    assert ids == [*extra, -1, ord("a"), ord("b"), ord("p"), -2, ord("c"), ord("d"), -3]
    # the prefix keeps its last 3/4 of a batch, the suffix its first quarter less the prompt and 2;
    # the extra files what the context leaves after a batch, plus 2, and never more than leaves room
    long = LlamaInfillRequest(input_prefix="q" * 5000, input_suffix="w" * 5000, input_extra=[{"text": "x" * 50}])
    ids = infill_prompt(long, FRAME, _Plain.encode, [], n_ctx=INFILL_BATCH + 40)
    assert ids.count(ord("q")) == 3 * INFILL_BATCH // 4 and ids.count(ord("w")) == INFILL_BATCH // 4 - 2
    # 42 (the context less a batch, plus 2) would not leave a token to write: the 38 that do
    assert ids[:ids.index(-1)] == [*map(ord, "x" * 28), -5, *map(ord, "filename\n")] and len(ids) == INFILL_BATCH + 39
    assert infill_prompt(long, FRAME, _Plain.encode, [], n_ctx=INFILL_BATCH)[0] == -1  # no room: no extra
    no_repo = InfillFrame(prefix=-1, suffix=-2, middle=-3, repo=None, file_separator=None, bos=7)
    ids = infill_prompt(body, no_repo, _Plain.encode, [], n_ctx=INFILL_BATCH + 100)
    assert ids[:ids.index(7)] == [*map(ord, "\n\n--- snippet ---\n\n"), ord("x")] and ids[ids.index(7) + 1] == -1


def test_a_cut_prefix_starts_on_a_grid_so_typing_keeps_the_prompts_start():
    # With room for a batch and the grid, a prefix past 3/4 of a batch is cut on a PREFIX_GRID grid:
    # keystroke after keystroke the prompt up to the cursor is the one before it plus the typed text,
    # which the prefix cache then holds; the extra files' share leaves the grid its room.
    extra_text = [{"filename": "f", "text": "x" * 9000}]
    prompts = [infill_prompt(LlamaInfillRequest(input_prefix="q" * n, input_suffix="w" * 900, input_extra=extra_text),
                             FRAME, _Plain.encode, [], n_ctx=8192) for n in range(5000, 5000 + PREFIX_GRID)]
    kept = [p.count(ord("q")) for p in prompts]
    assert all(3 * INFILL_BATCH // 4 <= k < 3 * INFILL_BATCH // 4 + PREFIX_GRID for k in kept)
    cursor = [p.index(-2) for p in prompts]  # the suffix token follows the cursor
    changed = [i for i in range(1, len(prompts)) if prompts[i][:cursor[i - 1]] != prompts[i - 1][:cursor[i - 1]]]
    assert len(changed) == 1  # the cut moved once in PREFIX_GRID keystrokes
    assert all(len(p) <= 8192 - 1 for p in prompts)


def test_the_indent_limit_holds_a_lines_indentation_until_it_is_known():
    limit = IndentLimit(4)
    assert limit.feed("x = 1\n") == "x = 1\n"
    assert limit.feed("  ") == ""  # two spaces so far: maybe more to come
    assert limit.feed("  y") == "    y" and not limit.hit
    assert limit.feed("\n  z = 2") == "\n  " and limit.hit  # a line indented 2 < 4: cut after its spaces
    assert limit.text == "x = 1\n    y\n  " and limit.rest() == ""


@pytest.mark.parametrize(("fields", "param"), [
    ({"typical_p": 0.5}, "typical_p"),
    ({"mirostat": 2}, "mirostat"),
    ({"dry_multiplier": 0.8}, "dry_multiplier"),
    ({"repeat_penalty": 1.1}, "repeat_penalty"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"samplers": ["top_k", "bogus"]}, "samplers"),
    ({"samplers": "kq"}, "samplers"),
    ({"repeat_penalty": 1.1, "repeat_last_n": -1, "samplers": ["top_k", "penalties"]}, "samplers"),
    ({"repeat_penalty": 1.1, "repeat_last_n": -1, "samplers": ["top_k"]}, "samplers"),
    ({"id_slot": 2}, "id_slot"),
    ({"grammar": "root ::= \"x\""}, "grammar"),
    ({"n_keep": 5}, "n_keep"),
    ({"lora": [{"id": 0, "scale": 0.5}]}, "lora"),
    ({"prompt": [1.5]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"bogus_field": 1}, "bogus_field"),
    ({"logit_bias": [[1, "x"]]}, "logit_bias"),
])
def test_what_is_not_served_is_refused_by_name(http, fields, param):
    reply = http.post("/completion", json={"prompt": PROMPT, "n_predict": 4, **fields})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()


def test_an_unserved_model_is_not_found(http):
    reply = http.post("/completion", json={"prompt": PROMPT, "model": "other"})
    assert reply.status_code == 404 and reply.json()["error"]["param"] == "model"


def test_nothing_is_left_behind(app):
    http, state = app
    complete(http, prompt=PROMPT, n_predict=200, temperature=0, ignore_eos=True, t_max_predict_ms=1)
    events(http, "/infill", **{**VSCODE, "stream": True})
    engine = state.engine.engine  # type: ignore[attr-defined]
    kv = engine.scheduler.kv
    deadline = time.monotonic() + 5  # a request ended by a limit is aborted on the engine's next step
    while (engine.has_unfinished_requests or kv.block_tables) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.has_unfinished_requests and not kv.block_tables
    assert kv.num_free_blocks == kv.num_blocks


def test_an_infill_prompt_that_leaves_no_room_is_refused_naming_the_prefix(http):
    reply = http.post("/infill", json={"input_prefix": "x = 1\n" * 800, "input_suffix": "", "n_predict": 4})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input_prefix"


def test_the_models_recommended_sampling_does_not_override_llama_cpps_defaults(app):
    http, state = app
    plain = complete(http, prompt=PROMPT, n_predict=16, temperature=0)
    saved = state.sampling_defaults
    state.sampling_defaults = {"repetition_penalty": 1.5, "max_tokens": 4, "temperature": 0.9}
    try:
        same = complete(http, prompt=PROMPT, n_predict=16, temperature=0)
        until_full = complete(http, prompt=PROMPT, n_predict=-1, temperature=0, stop=["\n\n"])
    finally:
        state.sampling_defaults = saved
    assert same["content"] == plain["content"] and until_full["tokens_predicted"] > 4


def test_tokenize_and_detokenize_in_llama_cpps_forms(app):
    http, state = app
    tokenizer = state.tokenizer
    ids = http.post("/tokenize", json={"content": "def f(): ‘x’"}).json()["tokens"]
    assert ids == tokenizer.encode("def f(): ‘x’", add_special_tokens=False)
    # a piece is its text where that is valid UTF-8, else its bytes (🧬 spans two tokens)
    pieces = http.post("/tokenize", json={"content": "<|im_start|>é\U0001F9EC", "with_pieces": True}).json()["tokens"]
    assert pieces[0] == {"id": tokenizer.token_to_id("<|im_start|>"), "piece": "<|im_start|>"}
    assert pieces[1]["piece"] == "é" and all(isinstance(p["piece"], list) for p in pieces[2:])
    assert bytes(pieces[2]["piece"] + pieces[3]["piece"]) == "\U0001F9EC".encode()
    plain = http.post("/tokenize", json={"content": "<|im_start|>", "parse_special": False}).json()["tokens"]
    assert tokenizer.token_to_id("<|im_start|>") not in plain
    back = http.post("/detokenize", json={"tokens": ids}).json()
    assert back["content"] == back["prompt"] == "def f(): ‘x’"
    # vLLM's form is unchanged
    vllm = http.post("/tokenize", json={"prompt": "def f():"}).json()
    assert set(vllm) >= {"count", "max_model_len", "tokens"}


def test_apply_template_renders_the_chat_as_the_model_would_read_it(app):
    http, state = app
    messages = [{"role": "user", "content": "Hi"}]
    prompt = http.post("/apply-template", json={"messages": messages}).json()["prompt"]
    assert prompt == state.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    reply = http.post("/apply-template", json={"messages": [{"role": "user"}]})
    assert reply.status_code == 400 and reply.json()["error"]["param"].startswith("messages")


def test_props_give_the_context_a_request_holds(http):
    props = http.get("/props").json()
    assert props["default_generation_settings"]["n_ctx"] == 512 and props["model_alias"] == MODEL
    assert props["default_generation_settings"]["params"]["samplers"] == ["top_k", "top_p", "min_p", "temperature"]
    assert props["total_slots"] == 4 and "<|im_start|>" in props["chat_template"]
    assert props["eos_token"] and props["model_path"].endswith(".gguf")


def test_embedding_in_llama_cpps_shape_pools_as_v1_embeddings_and_normalises_by_embd_normalize(http):
    texts = ["def add(a, b):", "The capital of France is"]
    openai = http.post("/v1/embeddings", json={"model": MODEL, "input": texts, "normalize": False}).json()["data"]
    for path in ("/embedding", "/embeddings"):
        raw = http.post(path, json={"content": texts, "embd_normalize": -1})
        assert raw.status_code == 200, raw.text
        entries = raw.json()
        assert [e["index"] for e in entries] == [0, 1] and all(len(e["embedding"]) == 1 for e in entries)
        for entry, same in zip(entries, openai):
            assert entry["embedding"][0] == pytest.approx(same["embedding"], rel=1e-6)
    one = http.post("/embedding", json={"content": texts[0]}).json()  # llama.cpp's default: Euclidean
    vector = one[0]["embedding"][0]
    assert len(one) == 1 and len(vector) == 896 and sum(v * v for v in vector) == pytest.approx(1.0)
    taxicab = http.post("/embedding", json={"input": texts[0], "embd_normalize": 1}).json()[0]["embedding"][0]
    assert sum(abs(v) for v in taxicab) == pytest.approx(1.0)
    int16 = http.post("/embedding", json={"content": texts[0], "embd_normalize": 0}).json()[0]["embedding"][0]
    assert max(abs(v) for v in int16) == pytest.approx(32760.0)
    ids = http.post("/tokenize", json={"content": texts[0]}).json()["tokens"]
    by_ids = http.post("/embedding", json={"content": ids}).json()[0]["embedding"][0]
    assert by_ids == pytest.approx(vector, rel=1e-6)  # a text prompt takes no BOS on this model


@pytest.mark.parametrize("body, field", [
    ({}, "content"),
    ({"content": "a", "input": "b"}, "content"),
    ({"content": ""}, "content"),
    ({"input": []}, "input"),
    ({"content": ["a", 1.5]}, "content"),
    ({"content": [10**9]}, "content"),
    ({"content": "x", "embd_normalize": -2}, "embd_normalize"),
    ({"content": "x", "encoding_format": "base64"}, "encoding_format"),
    ({"content": "x", "pooling": "none"}, "pooling"),
    ({"content": "x", "embd_normalize": 10**400}, "embd_normalize"),
    ({"content": "x", "dimensions": 10}, "dimensions"),
])
def test_an_embedding_request_that_cannot_be_served_is_refused_naming_the_field(app, body, field):
    http, state = app
    reply = http.post("/embedding", json=body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == field, reply.text
    assert not state.engine.engine.has_unfinished_requests  # type: ignore[attr-defined]


def test_an_embedding_input_past_the_context_is_refused(http):
    reply = http.post("/embedding", json={"content": [1] * 600})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "content", reply.text


def test_ignore_eos_bans_the_end_of_generation_tokens_as_llama_cpp_does(app):
    http, state = app
    ends = set(state.tokenizer.end_of_generation_ids)
    chat = http.post("/apply-template", json={"messages": [{"role": "user", "content": "Say hi."}]}).json()["prompt"]
    ended = complete(http, prompt=chat, n_predict=48, temperature=0, return_tokens=True)
    assert ended["stop_type"] == "eos" and ended["tokens_predicted"] < 48  # the model ends its turn
    onward = complete(http, prompt=chat, n_predict=48, temperature=0, ignore_eos=True, return_tokens=True)
    assert onward["tokens_predicted"] == 48 and onward["stop_type"] == "limit"
    assert not ends & set(onward["tokens"])  # never sampled, where vLLM's ignore_eos samples past them


def test_an_embedding_request_takes_v1s_model_dimensions_and_user(http):
    fine = http.post("/embedding", json={"content": "x", "model": MODEL, "dimensions": 896, "user": "me"})
    assert fine.status_code == 200 and len(fine.json()[0]["embedding"][0]) == 896
    other = http.post("/embedding", json={"content": "x", "model": "nope"})
    assert other.status_code == 404 and other.json()["error"]["param"] == "model"
