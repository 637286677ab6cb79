"""The decoder's layers in runs of rows: the same bits as one run of all rows, on the real models."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.errors import ModelLoadError
from conveyor.model import llama, memory
from conveyor.model.attention import AttentionMetadata, PrefillChunk
from conveyor.model.linear import PromptRows, matmul_path
from conveyor.runner.model_runner import LoadedModel, load_model
from conveyor.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def smollm() -> LoadedModel:
    return load_model(EngineConfig())


def _step(window_group: AttentionMetadata | None = None, base: int = 0) -> AttentionMetadata:
    """Three decode rows, a chunk of 150 tokens after 40 cached, one of 47 fresh: 200 rows. `base`:
    added to every slot and block id (a window pool's own)."""
    tables = base + np.arange(12, dtype=np.int64).reshape(3, 4)
    return AttentionMetadata(base + np.arange(1000, 1200, dtype=np.int64), 3, tables, np.array([5, 9, 30]),
                             [PrefillChunk(3, 150, 40, base + np.arange(20, dtype=np.int64)),
                              PrefillChunk(153, 47, 0, base + np.arange(7, dtype=np.int64))],
                             prompt_rows=((3, 153), (153, 200)), window_group=window_group)


def test_a_step_s_rows_cut_into_metadata_of_their_own() -> None:
    step = _step(window_group=_step(base=5000))
    assert step.rows(0, 200) is step
    first = step.rows(0, 64)
    assert first.num_decode_tokens == 3 and first.decode_context_lens is not None
    assert first.decode_context_lens.tolist() == [5, 9, 30]
    assert [(c.token_start, c.num_tokens, c.num_cached) for c in first.prefills] == [(3, 61, 40)]
    assert first.prompt_rows == ((3, 64),) and first.slot_mapping.tolist() == list(range(1000, 1064))
    # a chunk cut mid-way goes on from the keys its earlier rows wrote
    middle = step.rows(64, 128)
    assert middle.num_decode_tokens == 0 and middle.decode_block_tables is None
    assert [(c.token_start, c.num_tokens, c.num_cached) for c in middle.prefills] == [(0, 64, 101)]
    last = step.rows(128, 200)
    assert [(c.token_start, c.num_tokens, c.num_cached) for c in last.prefills] == [(0, 25, 165), (25, 47, 0)]
    assert last.prompt_rows == ((0, 25), (25, 72))
    # the window pool's metadata cut alike, from its own slots and tables
    window = step.rows(1, 130).window_group
    assert window is not None and window.prompt_rows == ((2, 129),) and window.num_decode_tokens == 2
    assert window.slot_mapping.tolist() == list(range(6001, 6130))
    assert window.decode_block_tables is not None and window.decode_block_tables.tolist() == [[5004, 5005, 5006, 5007],
                                                                                             [5008, 5009, 5010, 5011]]
    assert [(c.token_start, c.num_tokens, c.num_cached, int(c.block_table[0])) for c in window.prefills] == [(2, 127, 40, 5000)]
    # decode rows split between runs, each with its own tables
    two = step.rows(1, 2)
    assert two.num_decode_tokens == 1 and two.decode_block_tables is not None
    assert two.decode_block_tables.tolist() == [[4, 5, 6, 7]] and two.prefills == []


def test_each_run_s_product_takes_its_own_prompt_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    # Where prompt rows take the bf16 tiles (AMX), a run's product must know which of its rows are
    # prompt rows, numbered from the run's start; the whole step's would send them all to int8.
    asked: list[PromptRows | None] = []

    def recording_path(activation_dtype: str = "float32", prompt_rows: PromptRows | None = None) -> object:
        asked.append(prompt_rows)
        return matmul_path(activation_dtype, prompt_rows)

    monkeypatch.setattr(llama, "matmul_path", recording_path)
    assert [(r.start, r.end) for r in llama.row_runs(200, _step(), "int8", True)] == [(0, 200)]
    assert asked == [PromptRows(200, ((3, 153), (153, 200)), ((0, 3),))]
    asked.clear()
    monkeypatch.setattr(memory, "LAYER_ROWS", 64)
    runs = llama.row_runs(200, _step(), "int8", True)
    assert [(r.start, r.end) for r in runs] == [(0, 64), (64, 128), (128, 192), (192, 200)]
    assert asked == [PromptRows(64, ((3, 64),), ((0, 3),)), PromptRows(64, ((0, 64),), ()),
                     PromptRows(64, ((0, 25), (25, 64)), ()), PromptRows(8, ((0, 8),), ())]
    asked.clear()
    llama.row_runs(200, _step(), "int8", False)  # no tiles: every run on the int8 kernel
    assert asked == [None] * 4


def test_decode_rows_stay_in_one_run(monkeypatch: pytest.MonkeyPatch) -> None:
    # The decode kernel slices a request's context when few rows share its call: cutting the decode
    # rows apart would change their sums. They fill the first run, however many; prompt rows follow.
    monkeypatch.setattr(memory, "LAYER_ROWS", 2)
    runs = llama.row_runs(200, _step(), "int8", False)
    assert [(r.start, r.end) for r in runs[:3]] == [(0, 3), (3, 5), (5, 7)] and runs[-1].end == 200
    assert runs[0].meta.num_decode_tokens == 3 and all(r.meta.num_decode_tokens == 0 for r in runs[1:])
    monkeypatch.setattr(memory, "LAYER_ROWS", 64)
    decodes = AttentionMetadata(np.arange(100, dtype=np.int64), 100, np.zeros((100, 2), dtype=np.int64),
                                np.ones(100, dtype=np.int64), [])
    assert [(r.start, r.end) for r in llama.row_runs(100, decodes, "int8", False)] == [(0, 100)]
    mixed = llama.row_runs(300, AttentionMetadata(np.arange(300, dtype=np.int64), 100, np.zeros((100, 2), dtype=np.int64),
                                                  np.ones(100, dtype=np.int64),
                                                  [PrefillChunk(100, 200, 0, np.arange(13, dtype=np.int64))]),
                           "int8", False)
    assert [(r.start, r.end) for r in mixed] == [(0, 100), (100, 164), (164, 228), (228, 292), (292, 300)]


def _mixed_steps(engine: LLMEngine, prompts: list[list[int]]) -> list[tuple[Any, list[int], list[Any]]]:
    """Each prompt joins while the ones before it decode: steps of decode rows beside prefill
    chunks, the last prompt a prefix-cache hit on the one before it (which asks for no prompt
    logprobs, so its cached blocks are read)."""
    scored = SamplingParams(max_tokens=6, temperature=0, logprobs=5, prompt_logprobs=5)
    results: dict[str, tuple[Any, list[int], list[Any]]] = {}

    def step() -> None:
        for out in engine.step():
            cached[out.request_id] = out.num_cached_tokens
            prompt_logprobs, tokens, logprobs = results.setdefault(out.request_id, (None, [], []))
            results[out.request_id] = (prompt_logprobs or out.prompt_logprobs, tokens + out.new_token_ids,
                                       logprobs + (out.logprobs or []))
    ids: list[str] = []
    cached: dict[str, int] = {}
    for prompt in prompts:
        last = len(ids) == len(prompts) - 1
        ids.append(engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=0, logprobs=5) if last
                                      else scored))
        step()
        step()
    while engine.has_unfinished_requests:
        step()
    assert cached[ids[-1]] > memory.LAYER_ROWS or memory.LAYER_ROWS > 1 << 20  # a hit past a run's rows
    return [results[i] for i in ids]


def _same_in_runs(loaded: LoadedModel, text: str, monkeypatch: pytest.MonkeyPatch, **config: Any) -> None:
    def run() -> list[tuple[Any, list[int], list[Any]]]:
        engine = LLMEngine.from_config(EngineConfig.from_kwargs(enable_prefix_caching=True, **config), loaded)
        long = engine.tokenizer.encode(text)
        prompts = [engine.tokenizer.encode("The capital of France is"), long, long[: len(long) * 2 // 3] + long[:40]]
        return _mixed_steps(engine, prompts)
    monkeypatch.setattr(memory, "LAYER_ROWS", 1 << 30)
    whole = run()
    monkeypatch.setattr(memory, "LAYER_ROWS", 64)  # runs that cut prompts apart, the last short
    runs = run()
    assert all(w[0] is not None for w in whole[:-1])
    assert runs == whole
    monkeypatch.setattr(memory, "LAYER_ROWS", 2)  # runs of 2 prompt rows after the decode rows' own
    assert run() == whole


@pytest.mark.parametrize("activation_dtype", ["int8", "float32"])
def test_a_mixed_step_in_runs_of_rows_gives_the_same_bits(smollm: LoadedModel, activation_dtype: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    text = "def quicksort(items):\n    if len(items) <= 1:\n        return items\n" * 30
    _same_in_runs(smollm, text, monkeypatch, activation_dtype=activation_dtype)


def test_gemma_s_sliding_window_layers_in_runs_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    # A prompt past the 512-token window, so the windowed layers' runs start from a later key than 0.
    try:
        loaded = load_model(EngineConfig(model="gemma3-270m"))
    except ModelLoadError as e:
        pytest.skip(str(e))
    text = "The quick brown fox jumps over the lazy dog, and then it runs into the forest. " * 45
    _same_in_runs(loaded, text, monkeypatch, model="gemma3-270m")
