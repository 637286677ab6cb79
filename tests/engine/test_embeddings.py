"""Embeddings on the real default model (SmolLM2-135M): LLM.embed against HF transformers' final
hidden states of the same prompts, pooled the same way, and the same vectors however the engine
batches, chunks or caches the prompts."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from conveyor.engine.llm import LLM
from conveyor.engine.llm_engine import LLMEngine
from conveyor.errors import InvalidRequestError
from conveyor.config import EngineConfig
from conveyor.sampling import PoolingParams, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Hi",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The quick brown fox jumps over the lazy dog. " * 12 + "What animal jumped?",
]


@pytest.fixture(scope="module")
def loaded() -> Any:
    from conveyor.runner.model_runner import load_model

    return load_model(EngineConfig(activation_dtype="float32"))


def make_llm(loaded: Any, **config: Any) -> LLM:
    settings = {"activation_dtype": "float32", "kv_cache_dtype": "float32", "num_kv_blocks": 128, **config}
    return LLM.from_engine(LLMEngine.from_config(EngineConfig.from_kwargs(**settings), loaded))


def reference(hf_model: Any, ids: list[int], pooling: PoolingParams) -> torch.Tensor:
    with torch.inference_mode():
        hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0].double()
    rows = hidden[list(pooling.positions(len(ids)))].mean(0)
    return torch.nn.functional.normalize(rows, dim=0) if pooling.normalize else rows


@pytest.mark.parametrize("pooling_type", ["last", "mean", "cls"])
def test_embeddings_equal_transformers_final_hidden_states_pooled(loaded, hf_reference_model, pooling_type) -> None:
    llm = make_llm(loaded)
    pooling = PoolingParams(pooling_type)
    for out in llm.embed(PROMPTS, pooling):
        ours = torch.tensor(out.outputs.embedding, dtype=torch.float64)
        ref = reference(hf_reference_model, out.prompt_token_ids, pooling)
        assert ours.shape == ref.shape == (loaded.model.cfg.hidden_size,)
        assert abs(float(ours.norm()) - 1.0) < 1e-9
        assert float(ours @ ref) > 1 - 1e-6, out.prompt
        torch.testing.assert_close(ours, ref, rtol=0, atol=2e-4)


def test_unnormalized_mean_and_the_int8_default(loaded, hf_reference_model) -> None:
    """normalize=False gives the pooled hidden state itself; the default int8 products (which change
    results slightly, as for generation) stay within cosine 0.999 of the exact reference."""
    raw = PoolingParams("mean", normalize=False)
    out = make_llm(loaded).embed(PROMPTS[3], raw)[0]
    ref = reference(hf_reference_model, out.prompt_token_ids, raw)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding, dtype=torch.float64), ref, rtol=1e-4, atol=1e-3)
    int8 = make_llm(loaded, activation_dtype="int8", kv_cache_dtype="auto")
    for out in int8.embed(PROMPTS, PoolingParams("last")):
        ref = reference(hf_reference_model, out.prompt_token_ids, PoolingParams("last"))
        assert float(torch.tensor(out.outputs.embedding, dtype=torch.float64) @ ref) > 0.999, out.prompt


def test_the_same_vectors_chunked_cached_and_beside_generation(loaded) -> None:
    """Alone and whole; chunked 16 tokens a step beside requests that generate; and again once the
    prefix cache holds the prompts' blocks (the last token's pooling starts from them; the mean's
    computes every row it pools). Generated tokens are those of a run without embeddings."""
    alone = {kind: [o.outputs.embedding for o in make_llm(loaded).embed(PROMPTS, PoolingParams(kind))]
             for kind in ("last", "mean")}
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = make_llm(loaded, max_num_batched_tokens=16)
    expected_tokens = [o.outputs[0].token_ids for o in make_llm(loaded).generate(PROMPTS[:2], greedy)]
    engine = llm.engine
    for round_ in range(2):  # the second finds the first's blocks in the prefix cache
        ids = {engine.add_request(p, greedy): ("gen", i) for i, p in enumerate(PROMPTS[:2])}
        for kind in ("last", "mean"):
            ids.update({engine.add_request(p, SamplingParams.for_pooling(PoolingParams(kind))): (kind, i)
                        for i, p in enumerate(PROMPTS)})
        cached: dict[tuple[str, int], int] = {}
        while engine.has_unfinished_requests:
            for out in engine.step():
                if not out.finished:
                    continue
                kind, i = ids[out.request_id]
                cached[(kind, i)] = out.num_cached_tokens
                if kind == "gen":
                    assert out.token_ids == expected_tokens[i]
                else:
                    torch.testing.assert_close(torch.tensor(out.embedding), torch.tensor(alone[kind][i]),
                                               rtol=0, atol=1e-5)
        if round_ == 1:
            assert cached[("last", 3)] > 0  # the long prompt's blocks came from the cache
            assert cached[("mean", 3)] == 0  # a mean pools every row: nothing skipped


def test_pooling_fields_refused_with_generation_ones() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(max_tokens=1, n=2, pooling=PoolingParams())
    assert info.value.param == "n"
    with pytest.raises(InvalidRequestError) as info:
        PoolingParams("max")
    assert info.value.param == "pooling_type"


def test_default_pooling_comes_from_the_config_then_the_file(loaded) -> None:
    assert make_llm(loaded).engine.default_pooling == PoolingParams("last")  # SmolLM2's file says none
    assert make_llm(loaded, pooling_type="mean").engine.default_pooling == PoolingParams("mean")
    assert make_llm(loaded).engine.embedding_size == 576


@pytest.mark.parametrize("gguf_pooling,pooling_type", [(3, "last"), (1, "mean"), (2, "cls"), (0, "last")])
def test_a_gguf_that_names_its_pooling_is_pooled_so(tmp_path, smollm_gguf_path, gguf_pooling, pooling_type) -> None:
    """An embedding model's GGUF says how it pools (`qwen3.pooling_type`, as llama.cpp's converter
    writes Qwen3-Embedding's: 3, the last token, with add_eos_token so that the last token is EOS);
    0 (none, a generative model's) leaves vLLM's default. The vector is transformers' final hidden
    states of a Qwen3 model pooled that way."""
    from transformers import AutoModelForCausalLM

    from tests.helpers import make_tiny_hf_checkpoint, write_gguf_from_hf

    folder = make_tiny_hf_checkpoint(tmp_path, "qwen3")
    path = tmp_path / "tiny-embedding.gguf"
    write_gguf_from_hf(path, "qwen3", folder, smollm_gguf_path, more_keys={"pooling_type": gguf_pooling},
                       add_eos_token=gguf_pooling == 3)
    llm = LLM(str(path), activation_dtype="float32", kv_cache_dtype="float32", num_kv_blocks=16)
    assert llm.engine.default_pooling == PoolingParams(pooling_type)
    out = llm.embed(["an embedding model's input"])[0]
    assert (out.prompt_token_ids[-1] == 2) == (gguf_pooling == 3)  # EOS ends the text where the file asks
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref = reference(hf, out.prompt_token_ids, PoolingParams(pooling_type))
    torch.testing.assert_close(torch.tensor(out.outputs.embedding, dtype=torch.float64), ref, rtol=0, atol=1e-5)


def test_pooled_rows_share_a_step_with_prompt_logprobs_and_speculative_rows(loaded) -> None:
    """One runner step holds sampled rows with speculative tokens to verify, prompt-logprob rows and
    pooled rows, in that order: each request gets what it gets alone."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    scored = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    repeating = "one two three four five six seven, one two three four five six seven, one two three"
    pooled = SamplingParams.for_pooling(PoolingParams("mean"))
    alone = {
        "gen": make_llm(loaded).generate(repeating, greedy)[0].outputs[0].token_ids,
        "scored": make_llm(loaded).generate(PROMPTS[0], scored)[0].prompt_logprobs,
        "embedding": make_llm(loaded).embed(PROMPTS[3], PoolingParams("mean"))[0].outputs.embedding,
    }
    engine = make_llm(loaded, speculative_config=spec).engine
    gen = engine.add_request(repeating, greedy)
    while not engine.scheduler.requests[gen].spec_token_ids:  # the others arrive when it has drafts to verify
        engine.step()
    kinds = {gen: "gen", engine.add_request(PROMPTS[0], scored): "scored", engine.add_request(PROMPTS[3], pooled): "embedding"}
    mixed_steps, drafted = 0, 0
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                kind = kinds[out.request_id]
                if kind == "gen":
                    assert out.token_ids == alone["gen"]
                elif kind == "embedding":
                    torch.testing.assert_close(torch.tensor(out.embedding), torch.tensor(alone["embedding"]),
                                               rtol=0, atol=1e-5)
            if out.prompt_logprobs is not None and kinds[out.request_id] == "scored":
                assert [None if s is None else dict(s) for s in out.prompt_logprobs] == \
                    [None if s is None else dict(s) for s in alone["scored"]]
        stats = engine.last_step
        drafted += stats.num_draft_tokens
        mixed_steps += stats.num_draft_tokens > 0 and stats.num_requests == 3
    assert drafted and mixed_steps  # some step verified drafts beside both other kinds of rows


def test_stop_sample_on_an_embedding_aborts_it(loaded) -> None:
    engine = make_llm(loaded).engine
    request_id = engine.add_request(PROMPTS[3], SamplingParams.for_pooling(PoolingParams()))
    out = engine.stop_sample(request_id, 0)
    assert out is not None and out.finish_reason == "abort" and out.embedding is None
    assert not engine.has_unfinished_requests and engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def test_a_prompt_s_last_token_alone_computes_as_in_its_whole_prompt(loaded) -> None:
    """A prefix hit can leave a prompt's last token alone (33 tokens, 32 of them cached): it is
    computed as a prompt row, so the vector (int8 products, where a rounding step would magnify a
    different summation order) is the one the whole prompt gave, bit for bit."""
    llm = make_llm(loaded, activation_dtype="int8", kv_cache_dtype="auto")
    prompt = llm.tokenizer.encode(PROMPTS[3])[:33]
    vectors, cached = [], []
    for _ in range(2):
        request_id = llm.engine.add_request(prompt, SamplingParams.for_pooling(PoolingParams("last")))
        while llm.engine.has_unfinished_requests:
            for out in llm.engine.step():
                if out.request_id == request_id and out.finished:
                    vectors.append(out.embedding)
                    cached.append(out.num_cached_tokens)
    assert cached == [0, 32]
    assert vectors[0] == vectors[1]


def test_embed_takes_vllm_s_truncation_and_checks_its_lists(loaded) -> None:
    llm = make_llm(loaded)
    ids = llm.tokenizer.encode(PROMPTS[3])
    cut = llm.embed(PROMPTS[3], truncate_prompt_tokens=5)[0]
    assert cut.prompt_token_ids == ids[-5:]
    assert cut.outputs.embedding == llm.embed([ids[-5:]])[0].outputs.embedding
    assert llm.embed(PROMPTS[3], truncate_prompt_tokens=-1)[0].prompt_token_ids == ids
    with pytest.raises(ValueError, match="one PoolingParams, or one per prompt"):
        llm.embed(PROMPTS[:3], [PoolingParams()] * 2)
    with pytest.raises(InvalidRequestError):
        llm.embed("x", truncate_prompt_tokens=0)
