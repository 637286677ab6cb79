"""Greedy tokens from a head screened by the int8 kernel's product and the head's column norms
(conveyor.model.linear.screened_argmax with screen_norms: every block type the int8 kernel reads but
Q8_0, AVX2 and AVX-512 builds alike; BF16 / F16 weights by the bf16 product on CPUs with AVX512-BF16) are
the full fp32 product's argmax, index for index: on random blocks of each type, rows past a tile,
outlier features, a partial last panel, exact ties, the fallbacks, and on SmolLM2-135M's real
hidden states with its head re-quantized."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import quants
from gguf.constants import GGMLQuantizationType

from conveyor.model import linear as linear_module
from conveyor.model.linear import (PackedWeight, int8_matmul_kernel, linear, pack_blocks, pack_weight, screen_candidates,
                                   screen_norms, screened_argmax)
from conveyor.model.quantized import INT8_TYPES, QuantizedWeight
from tests.model.test_quant_gemm import random_blocks, reference_fp32

pytestmark = pytest.mark.skipif(int8_matmul_kernel() is None, reason="the int8 screen needs the int8 kernel")

_kernel = int8_matmul_kernel()
BF16_DOT = _kernel is not None and bool(_kernel.bf16_dot())  # type: ignore[attr-defined]
SCREENED_TYPES = sorted(t for t in INT8_TYPES if t != "Q8_0") + (["BF16", "F16"] if BF16_DOT else [])
K = 512  # two K-quant super-blocks, 16 groups of 32
N = 1000  # 62 full panels and one of 8 columns


@pytest.fixture(autouse=True)
def screen_every_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The screen's answers at any number of rows (a 16-bit head is screened only from a few)."""
    monkeypatch.setattr(linear_module, "HALF_SCREEN_FROM_ROWS", 1)


def randn(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def packed_head(q: QuantizedWeight) -> tuple[np.ndarray, PackedWeight, np.ndarray]:
    packed = pack_blocks(q)
    assert packed is not None and packed.layout == q.qtype
    norms = screen_norms(packed)
    assert norms is not None
    return reference_fp32(q), packed, norms


def full_argmax(x: np.ndarray, packed: PackedWeight) -> np.ndarray:
    return linear(x, None, packed).argmax(axis=-1)


@pytest.mark.parametrize("qtype", SCREENED_TYPES)
def test_column_norms_bound_the_dequantized_weights(qtype: str) -> None:
    weight, packed, norms = packed_head(random_blocks(qtype, N, K, seed=1))
    exact = np.linalg.norm(weight.astype(np.float64), axis=1)
    assert norms.dtype == np.float32 and norms.shape == (N,)
    assert bool((norms.astype(np.float64) >= exact).all())  # rounded up: the bound stays a bound
    np.testing.assert_allclose(norms.astype(np.float64), exact, rtol=1e-5, atol=0)


@pytest.mark.parametrize("qtype", SCREENED_TYPES)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_random_blocks_and_rows(qtype: str, rows: int) -> None:
    _, packed, norms = packed_head(random_blocks(qtype, N, K, seed=rows))
    x = randn(rows, K, seed=rows)
    x[:, 7] *= 50.0  # a lone large feature: the int8 kernel carries it exactly
    x[:, 300] *= 8.0
    got = screened_argmax(x, packed, norms)
    assert got is not None and got.dtype == np.int64
    assert np.array_equal(got, full_argmax(x, packed))


@pytest.mark.parametrize("qtype", ["Q6_K"] + (["BF16", "F16"] if BF16_DOT else []))
@pytest.mark.parametrize("n", [993, 1007])  # a last panel of 1 and 15 columns
def test_last_panel_partly_filled(n: int, qtype: str) -> None:
    weight, packed, norms = packed_head(random_blocks(qtype, n, K, seed=n))
    x = np.concatenate([weight[[n - 1, n - 2, 0]], randn(3, K, seed=n)])  # the first rows' maxima in the last panel
    expected = full_argmax(x, packed)
    assert expected[0] == n - 1 and expected[1] == n - 2
    assert np.array_equal(screened_argmax(x, packed, norms), expected)


@pytest.mark.parametrize("qtype", ["Q6_K"] + (["BF16", "F16"] if BF16_DOT else []))
def test_exact_ties_go_to_the_first_column(qtype: str) -> None:
    blocks = random_blocks(qtype, N, K, seed=2).blocks.copy()
    blocks[3] = blocks[950] = blocks[900]  # three identical columns, one in the last, partial panel
    weight, packed, norms = packed_head(QuantizedWeight(qtype, blocks))
    x = weight[900:901].copy()  # column 900's logit is its squared norm: the maximum
    expected = full_argmax(x, packed)
    assert int(expected[0]) == 3  # what argmax does with a three-way tie, pinned
    assert np.array_equal(screened_argmax(x, packed, norms), expected)


def test_near_ties_are_settled_exactly() -> None:
    """Column 20 is column 500 plus a tiny difference far inside the int8 bound: both are
    candidates, and the exact products decide, either sign."""
    weight, packed, norms = packed_head(random_blocks("Q5_0", N, K, seed=3))
    x = weight[500:501].copy()
    blocks = random_blocks("Q5_0", N, K, seed=3).blocks.copy()
    blocks[20] = blocks[500]
    blocks[20, 0] ^= 1  # the first block's fp16 scale, one unit in its last place
    weight, packed, norms = packed_head(QuantizedWeight("Q5_0", blocks))
    logits = linear(x, None, packed)[0]
    assert 0 < abs(float(logits[20] - logits[500])) < 1e-3 * float(abs(logits[500]))
    for sign in (1.0, -1.0):
        candidates, _ = screen_candidates(sign * x, packed, norms)
        if sign > 0:
            assert bool(candidates[0, 20]) and bool(candidates[0, 500])
        assert np.array_equal(screened_argmax(sign * x, packed, norms), full_argmax(sign * x, packed))


def test_too_many_candidates_fall_back_to_the_full_product(monkeypatch: pytest.MonkeyPatch) -> None:
    _, packed, norms = packed_head(random_blocks("Q4_0", N, K, seed=4))
    zeros = np.zeros((2, K), dtype=np.float32)  # every logit 0: every column a candidate
    assert screened_argmax(zeros, packed, norms).tolist() == [0, 0]  # the full product: all tie, the first wins
    mixed = np.concatenate([randn(1, K), zeros])
    assert np.array_equal(screened_argmax(mixed, packed, norms), full_argmax(mixed, packed))
    monkeypatch.setattr(linear_module, "MAX_SCREENED_CANDIDATES", 0)  # every row gives up
    x = randn(3, K, seed=1)
    assert np.array_equal(screened_argmax(x, packed, norms), full_argmax(x, packed))


def test_what_is_not_screened(monkeypatch: pytest.MonkeyPatch) -> None:
    _, packed, norms = packed_head(random_blocks("Q4_1", N, K, seed=5))
    x = randn(2, K)
    x[1, 3] = float("nan")
    assert screened_argmax(x, packed, norms) is None
    assert screened_argmax(randn(1, K), packed, None) is None  # no norms: the full product
    assert screen_norms(pack_blocks(random_blocks("Q8_0", N, K, seed=5))) is None  # Q8_0: q8_0_argmax or the full product
    assert screen_norms(pack_blocks(random_blocks("Q3_K", N, K, seed=5))) is None  # the int8 kernel does not read it
    if not BF16_DOT:  # no bf16 product to screen 16-bit floats with
        assert screen_norms(pack_blocks(random_blocks("BF16", N, K, seed=5))) is None
        assert screen_norms(pack_blocks(random_blocks("F16", N, K, seed=5))) is None
    monkeypatch.setenv("CONVEYOR_SCREENED_ARGMAX", "0")
    assert screened_argmax(randn(1, K), packed, norms) is None
    monkeypatch.delenv("CONVEYOR_SCREENED_ARGMAX")
    panels = pack_weight(randn(N, K, seed=2))  # norms beside fp32 panels swapped in (an A/B run): not screened
    assert panels is not None and screened_argmax(randn(1, K), panels, norms) is None
    if BF16_DOT:  # below HALF_SCREEN_FROM_ROWS rows a 16-bit head takes the exact product
        _, bf16_packed, bf16_norms = packed_head(random_blocks("BF16", N, K, seed=5))
        monkeypatch.setattr(linear_module, "HALF_SCREEN_FROM_ROWS", 4)
        assert screened_argmax(randn(3, K), bf16_packed, bf16_norms) is None
        assert screened_argmax(randn(4, K), bf16_packed, bf16_norms) is not None


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_0"] + (["BF16", "F16"] if BF16_DOT else []))
def test_real_hidden_states_of_smollm2_with_its_head_requantized(qtype: str) -> None:
    """SmolLM2's Q8_0 head dequantized and quantized again to `qtype` (gguf-py's quantizer), against
    final hidden states of greedy runs: every row's screened token is the full product's."""
    from benchmarks.kernels.screened_argmax import final_hidden_states
    from conveyor import LLM

    llm = LLM(None, num_kv_blocks=64, activation_dtype="float32")
    model = llm.engine.runner.model
    head = model.head.packed
    assert head is not None
    weight = head.rows(np.arange(head.out_features))
    blocks = quants.quantize(weight, GGMLQuantizationType[qtype])  # BF16 / F16: the weights rounded to it
    blocks = np.ascontiguousarray(blocks).view(np.uint8).reshape(weight.shape[0], -1)  # F16 comes as float16
    packed = pack_blocks(QuantizedWeight(qtype, np.ascontiguousarray(blocks)))
    assert packed is not None
    norms = screen_norms(packed)
    hidden = final_hidden_states(llm, 8)  # the hidden states the head takes, over a few greedy prompts
    assert hidden.shape[0] >= 32
    got = screened_argmax(hidden, packed, norms)
    assert got is not None
    assert np.array_equal(got, full_argmax(hidden, packed))
    candidates, _ = screen_candidates(hidden, packed, norms)  # real states: a few columns each, not the vocabulary
    assert int(np.median(candidates.sum(axis=-1))) < 200


def test_a_batch_past_the_screens_row_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_module, "SCREEN_ROWS", 4)  # 11 rows: chunks of 4, 4 and 3
    _, packed, norms = packed_head(random_blocks("Q4_K", N, K, seed=6))
    x = randn(11, K, seed=6)
    x[5] = 0.0  # every column a candidate, inside a chunk
    got = screened_argmax(x, packed, norms)
    assert got is not None and got.shape == (11,)
    assert np.array_equal(got, full_argmax(x, packed))
