"""The default, int8 activations (products on GGUF blocks quantize their input per 32 features and
multiply in integers), on the real default model: the integer kernel is what runs, at one row as at
many; a greedy request's tokens do not depend on whether its batch also samples; the results stay
close to the exact fp32 path, which the float32 switch still takes.

Not asserted: equal tokens however a request is chunked or batched. Neither path is bitwise
invariant to that (attention over a chunked prompt sums in another order, about 1e-5 relative);
fp32 keeps those differences below every argmax margin the reference tests meet, but int8 rounding
can carry one across a near tie (docs/ENGINE.md, "Activation dtype")."""
from __future__ import annotations

import numpy as np
import pytest

from conveyor.model import kernels
from conveyor.sampling import SamplingParams

from .test_real_model import PROMPTS, run

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.skipif(kernels.quant_int8() is None, reason="no integer kernel on this CPU")


@pytest.fixture(scope="module")
def prompt_ids(default_model) -> list[list[int]]:  # noqa: ANN001
    return [default_model.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def int8_alone(make_engine, prompt_ids) -> list[list[int]]:  # noqa: ANN001
    engine = make_engine(activation_dtype="int8")
    return [run(engine, [p])[0] for p in prompt_ids]


def test_the_integer_kernel_runs_only_when_asked(make_engine, prompt_ids, monkeypatch) -> None:  # noqa: ANN001
    module = kernels.quant_int8()
    rows: list[int] = []

    class Recording:
        def bf16_tiles(self) -> bool:  # prompts on the int8 kernel too (tests/engine/test_prompt_tiles.py)
            return False

        def int8_matmul(self, x: np.ndarray, *args: object, **kwargs: object) -> np.ndarray:
            rows.append(x.shape[0])
            return module.int8_matmul(x, *args, **kwargs)  # type: ignore[union-attr]

    monkeypatch.setattr(kernels, "quant_int8", lambda: Recording())
    run(make_engine(activation_dtype="int8", max_num_seqs=4), prompt_ids[:1])
    assert rows and min(rows) == 1 and max(rows) > 4  # one-row decode steps and the prefill alike
    rows.clear()
    run(make_engine(activation_dtype="float32", max_num_seqs=4), prompt_ids[:4])
    assert rows == []


def test_a_greedy_request_beside_a_sampled_one_keeps_its_tokens(make_engine, prompt_ids,  # noqa: ANN001
                                                                 int8_alone) -> None:
    """A batch that samples computes the full logits; one that is all greedy takes the screened
    argmax: both see fp32 activations at the vocabulary projection, so the greedy tokens agree."""
    engine = make_engine(activation_dtype="int8")
    greedy = engine.add_request(prompt_ids[0], GREEDY)
    engine.add_request(prompt_ids[1], SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True))
    results = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                results[out.request_id] = list(out.token_ids)
    assert results[greedy] == int8_alone[0][:24]


def test_int8_stays_close_to_the_fp32_reference(make_engine, prompt_ids, int8_alone) -> None:  # noqa: ANN001
    """Not equal (that is the float32 switch's job), but the same text for the first tokens of
    most prompts: a broken kernel would diverge at once."""
    exact = make_engine(activation_dtype="float32")
    reference = [run(exact, [p])[0] for p in prompt_ids]
    same_start = sum(ours[:4] == ref[:4] for ours, ref in zip(int8_alone, reference))
    assert same_start >= len(prompt_ids) - 2


def test_sampled_rows_take_the_head_in_int8_and_greedy_rows_stay_exact(default_model) -> None:  # noqa: ANN001
    """LlamaModel.logits: rows that sample at a temperature take the vocabulary projection in the
    activation dtype, the others fp32 activations; a row's logits do not depend on its neighbours."""
    from conveyor.model.attention import AttentionMetadata, PrefillChunk
    from conveyor.runner.model_runner import allocate_kv_cache

    model = default_model.model
    ids = default_model.tokenizer.encode(PROMPTS[0])
    n = len(ids)
    blocks = -(-n // 16)
    positions = np.arange(n)
    meta = AttentionMetadata(positions, 0, None, None, [PrefillChunk(0, n, 0, np.arange(blocks))])
    saved = model.activation_dtype
    try:
        model.activation_dtype = "int8"
        hidden = model.sampling_hidden(np.array(ids), positions, meta,
                                       allocate_kv_cache(model.cfg, blocks, 16, np.float32), positions)
        exact = model.logits(hidden)
        int8 = model.logits(hidden, np.ones(n, dtype=np.bool_))
        mask = positions % 2 == 0
        mixed = model.logits(hidden, mask)
        assert np.array_equal(mixed[~mask], exact[~mask]) and np.array_equal(mixed[mask], int8[mask])
        assert np.array_equal(model.logits(hidden[2:3], np.ones(1, dtype=np.bool_)), int8[2:3])
        assert not np.array_equal(int8, exact)  # a different product ...

        def log_softmax(logits: np.ndarray) -> np.ndarray:
            wide = logits.astype(np.float64)
            wide -= wide.max(axis=-1, keepdims=True)
            return wide - np.log(np.exp(wide).sum(axis=-1, keepdims=True))
        p, q = log_softmax(exact), log_softmax(int8)
        kl = (np.exp(p) * (p - q)).sum(axis=-1)  # KL(exact || int8), as torch's kl_div(q, p, log_target) summed
        assert float(kl.max()) < 1e-2, kl  # ... of nearly the same distribution
        model.activation_dtype = "float32"  # the exact switch: every row exact
        assert np.array_equal(model.logits(hidden, np.ones(n, dtype=np.bool_)), exact)
    finally:
        model.activation_dtype = saved


def test_the_runner_marks_the_rows_that_sample(make_engine, prompt_ids, monkeypatch) -> None:  # noqa: ANN001
    engine = make_engine(activation_dtype="int8")
    model = engine.runner.model
    marks: list[list[bool]] = []
    plain = model.logits

    def recording(h: np.ndarray, sampled: np.ndarray | None = None) -> np.ndarray:
        marks.append([] if sampled is None else sampled.tolist())
        return plain(h, sampled)

    monkeypatch.setattr(model, "logits", recording)
    engine.add_request(prompt_ids[0], GREEDY)
    engine.add_request(prompt_ids[1], SamplingParams(max_tokens=4, temperature=0.8, seed=1, ignore_eos=True))
    while engine.has_unfinished_requests:
        engine.step()
    # the greedy request's steps alone take the screened argmax, without logits
    assert marks and all(sorted(m) == [False, True] for m in marks), marks
