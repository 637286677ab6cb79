"""Prompt tokens on AMX bf16 tiles (EngineConfig.prompt_bf16_tiles), on the real default model: where
the CPU has AMX-BF16, a step's prompt rows take the tile kernel and its generated rows the int8
kernel, in the same step when a prefill runs beside decodes; the switch turns it off; and the prefix
cache, which then keys an answer's blocks apart from the same tokens met as a prompt, still changes
no output in the next turn of a conversation. Elsewhere the switch changes nothing."""
from __future__ import annotations

import numpy as np
import pytest

from conveyor.model import kernels
from conveyor.model.linear import bf16_tiles_available
from conveyor.sampling import SamplingParams

from .test_prefix_caching_real import prompts, run

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

needs_tiles = pytest.mark.skipif(not bf16_tiles_available(), reason="no AMX-BF16 tiles on this CPU")


@pytest.fixture
def recorded(monkeypatch):  # noqa: ANN001, ANN201
    """Row counts of each call of the tile and the int8 kernels."""
    module = kernels.quant_int8()
    calls: dict[str, list[int]] = {"tiles": [], "int8": []}

    class Recording:
        def bf16_tiles(self) -> bool:
            return bool(module.bf16_tiles())  # type: ignore[union-attr]

        def bf16_tile_matmul(self, x: np.ndarray, *args: object, **kwargs: object) -> np.ndarray:
            calls["tiles"].append(x.shape[0])
            return module.bf16_tile_matmul(x, *args, **kwargs)  # type: ignore[union-attr,no-any-return]

        def int8_matmul(self, x: np.ndarray, *args: object, **kwargs: object) -> np.ndarray:
            calls["int8"].append(x.shape[0])
            return module.int8_matmul(x, *args, **kwargs)  # type: ignore[union-attr,no-any-return]

        def __getattr__(self, name: str) -> object:
            return getattr(module, name)

    monkeypatch.setattr(kernels, "quant_int8", lambda: Recording())
    return calls


@needs_tiles
def test_prompt_rows_take_the_tiles_and_generated_rows_the_int8_kernel(make_engine, recorded) -> None:  # noqa: ANN001
    engine = make_engine(activation_dtype="int8", max_num_seqs=4, enable_prefix_caching=False)  # every token computed
    assert engine.runner.prompt_rows_apart and engine.scheduler.kv._generated_apart
    first, second = prompts(engine)[:2]
    a = engine.add_request(first, GREEDY)
    engine.step()  # the first prompt alone
    assert set(recorded["tiles"]) == {len(first)} and recorded["int8"] == []
    recorded["tiles"].clear()
    b = engine.add_request(second, GREEDY)
    engine.step()  # the second prompt beside the first request's decode: one step, both kernels
    assert set(recorded["tiles"]) == {len(second)} and set(recorded["int8"]) == {1}
    while engine.has_unfinished_requests:
        engine.step()
    assert set(recorded["tiles"]) == {len(second)}, "decodes never take the tiles"
    del a, b


@needs_tiles
def test_the_switch_keeps_prompts_on_the_int8_kernel(make_engine, recorded) -> None:  # noqa: ANN001
    engine = make_engine(activation_dtype="int8", prompt_bf16_tiles=False)
    assert not engine.runner.prompt_rows_apart and not engine.scheduler.kv._generated_apart
    run(engine, [(prompts(engine)[0], GREEDY)])
    assert recorded["tiles"] == [] and max(recorded["int8"]) > 1


def test_fp32_activations_never_take_the_tiles(make_engine, recorded) -> None:  # noqa: ANN001
    engine = make_engine(activation_dtype="float32")
    assert not engine.runner.prompt_rows_apart
    run(engine, [(prompts(engine)[0], GREEDY)])
    assert recorded["tiles"] == [] and recorded["int8"] == []


def test_the_next_turn_changes_no_output_and_hits_what_was_computed_alike(make_engine) -> None:  # noqa: ANN001
    """With the tiles, the answer was computed as generated tokens and the next turn reads it as a
    prompt: only the first prompt's blocks are a hit, and the tokens equal a run without the cache.
    Without them the answer's blocks are a hit too; its keys were computed a row at a time there and
    as one prompt without the cache, which int8 rounding need not make equal (test_int8_activations),
    so the tokens are compared where every key read was computed alike: with the tiles."""
    on = make_engine(activation_dtype="int8", max_num_seqs=4)
    off = make_engine(activation_dtype="int8", max_num_seqs=4, enable_prefix_caching=False)
    first = prompts(on)[0]
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    answer = run(on, [(first, greedy)])[(0, 0)]
    follow = on.tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd of Spain?<|im_end|>\n<|im_start|>assistant\n")
    turn2 = first + answer + follow
    rid = on.add_request(turn2, greedy)
    outs = []
    while on.has_unfinished_requests:
        outs += [o for o in on.step() if o.finished and o.request_id == rid]
    bs = on.scheduler.kv.block_size
    computed = len(first) + len(answer) - 1  # the answer's last token never had its KV written
    expected = len(first) if on.runner.prompt_rows_apart else computed
    assert outs[0].num_cached_tokens == (expected // bs) * bs
    if on.runner.prompt_rows_apart:
        assert outs[0].token_ids == run(off, [(turn2, greedy)])[(0, 0)]
