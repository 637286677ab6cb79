"""Greedy tokens from the int8-screened Q8_0 head (quant_gemm.cpp's q8_0_argmax, through
conveyor.model.linear.screened_argmax) are the full product's argmax, index for index: on random
blocks and rows past one tile, with exact ties (the first column wins, as torch.argmax), near-ties one
code apart, outlier activations, and the fallbacks (too many candidates, non-finite input)."""
from __future__ import annotations

import numpy as np
import pytest

from conveyor.model.kernels import quant_gemm
from conveyor.model.linear import PackedWeight, linear, pack_weight, screened_argmax
from conveyor.model.quantized import QuantizedWeight
from tests.model.test_quant_gemm import random_blocks, reference_fp32

SCREEN = getattr(quant_gemm(), "q8_0_argmax", None)
pytestmark = pytest.mark.skipif(SCREEN is None, reason="the screened argmax needs an AVX-512 VNNI/VBMI build")

K = 320  # 10 blocks of 32
N = 1000  # 62 full panels and one of 8 columns


def randn(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def packed_head(q: QuantizedWeight) -> tuple[np.ndarray, PackedWeight]:
    weight = reference_fp32(q)
    packed = pack_weight(weight, q)
    assert packed is not None and packed.layout == "Q8_0"
    return weight, packed


def full_argmax(x: np.ndarray, weight: np.ndarray, packed: PackedWeight) -> np.ndarray:
    return linear(x, weight, packed).argmax(axis=-1)


@pytest.mark.parametrize("rows", [1, 5, 8, 9, 17, 33])  # 9, 17, 33: tiles of 8 rows and a remainder
def test_random_blocks_and_rows(rows: int) -> None:
    weight, packed = packed_head(random_blocks("Q8_0", N, K, seed=rows))
    x = randn(rows, K, seed=rows)
    x[:, 7] *= 50.0  # an outlier feature, as hidden states have: one block's scale set by it
    got = screened_argmax(x, packed)
    assert got is not None and got.dtype == np.int64
    assert np.array_equal(got, full_argmax(x, weight, packed))


@pytest.mark.parametrize("n", [993, 1005, 1007])  # a last panel of 1, 13 and 15 columns
def test_last_panel_partly_filled(n: int) -> None:
    weight, packed = packed_head(random_blocks("Q8_0", n, K, seed=n))
    x = np.concatenate([weight[[n - 1, n - 2, 0]], randn(3, K, seed=n)])  # the first rows' maxima in the last panel
    expected = full_argmax(x, weight, packed)
    assert expected[0] == n - 1 and expected[1] == n - 2
    assert np.array_equal(screened_argmax(x, packed), expected)


def test_exact_ties_go_to_the_first_column() -> None:
    q = random_blocks("Q8_0", N, K, seed=1)
    blocks = q.blocks.copy()
    blocks[3] = blocks[950] = blocks[900]  # three identical columns, one in the last, partial panel
    q = QuantizedWeight("Q8_0", blocks)
    weight, packed = packed_head(q)
    x = weight[900:901].copy()  # column 900's logit is its squared norm: the maximum
    expected = full_argmax(x, weight, packed)
    assert int(expected[0]) == 3  # what argmax does with a three-way tie, pinned
    assert np.array_equal(screened_argmax(x, packed), expected)


def test_near_ties_one_code_apart() -> None:
    q = random_blocks("Q8_0", N, K, seed=2)
    blocks = q.blocks.copy()
    x = reference_fp32(QuantizedWeight("Q8_0", blocks))[500:501].copy()
    # Column 20 = column 500 with one code one step away where x is largest, so the two logits differ
    # by d * x_k: well inside the int8 pass's bound on either.
    k = int(x[0].argmax())
    block, j = divmod(k, 32)
    blocks[20] = blocks[500]
    code = int(blocks[20, block * 34 + 2 + j].view(np.int8))
    step = 1 if code < 127 else -1
    blocks[20, block * 34 + 2 + j] = np.array([code + step], dtype=np.int8).view(np.uint8)[0]
    weight, packed = packed_head(QuantizedWeight("Q8_0", blocks))
    logits = linear(x, weight, packed)[0]
    assert 0 < abs(float(logits[20] - logits[500])) < 1e-2 * float(abs(logits[500]))
    assert np.array_equal(screened_argmax(x, packed), full_argmax(x, weight, packed))
    assert np.array_equal(screened_argmax(-x, packed), full_argmax(-x, weight, packed))


def test_too_many_candidates_fall_back_to_the_full_product() -> None:
    weight, packed = packed_head(random_blocks("Q8_0", N, K, seed=3))
    zeros = np.zeros((2, K), dtype=np.float32)  # every logit 0: every column a candidate
    assert SCREEN(zeros, packed.data, packed.out_features, 16).tolist() == [-1, -1]
    assert screened_argmax(zeros, packed).tolist() == [0, 0]  # the full product: all tie, the first wins
    mixed = np.concatenate([randn(1, K), zeros])
    assert np.array_equal(screened_argmax(mixed, packed), full_argmax(mixed, weight, packed))


def test_non_finite_input_another_layout_or_switched_off_is_not_screened(monkeypatch: pytest.MonkeyPatch) -> None:
    weight, packed = packed_head(random_blocks("Q8_0", N, K, seed=4))
    x = randn(2, K)
    x[1, 3] = float("nan")
    assert screened_argmax(x, packed) is None
    x[1, 3] = float("inf")
    assert screened_argmax(x, packed) is None
    q4 = random_blocks("Q4_1", N, K, seed=4)
    assert screened_argmax(randn(1, K), pack_weight(reference_fp32(q4), q4)) is None
    blocks = random_blocks("Q8_0", N, K, seed=5).blocks.copy()
    blocks[17, :2] = [0x00, 0x7C]  # one block's fp16 scale is inf
    with np.errstate(invalid="ignore", over="ignore"):  # gguf-py's reference of an inf scale
        weight = reference_fp32(QuantizedWeight("Q8_0", blocks))
    assert screened_argmax(randn(1, K), pack_weight(weight, QuantizedWeight("Q8_0", blocks))) is None
    monkeypatch.setenv("CONVEYOR_SCREENED_ARGMAX", "0")
    assert screened_argmax(randn(1, K), packed) is None


def test_extreme_codes_at_full_scale() -> None:
    """Codes of -128 and 127 against activations at their largest code (the integer pass's widest
    products; AVX2 multiplies |w| by x carrying w's sign, where -128 must read as 128): the winner
    is a column of -128 codes with a negative scale, a hair above one of 127 codes."""
    blocks = random_blocks("Q8_0", 64, K, seed=5).blocks.copy().reshape(64, K // 32, 34)
    blocks[10, :, 2:] = np.array(-128, dtype=np.int8).view(np.uint8)
    blocks[10, :, :2] = np.array([-0.01], dtype=np.float16).view(np.uint8)
    blocks[20, :, 2:] = 127
    blocks[20, :, :2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    weight, packed = packed_head(QuantizedWeight("Q8_0", blocks.reshape(64, -1)))
    x = np.ones((2, K), dtype=np.float32)
    x[1] = -1.0  # then column 10 is the minimum, and another column the maximum
    expected = full_argmax(x, weight, packed)
    assert int(expected[0]) == 10
    assert np.array_equal(screened_argmax(x, packed), expected)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("n", [8, 40, N])  # one panel (fewer panels than threads), three, 63
def test_any_thread_count_gives_the_same_tokens(threads: int, n: int) -> None:
    # Each share of the panels keeps its own candidates, whatever the thread count asked for. (It
    # checks the shares at thread counts above, below and at the panels' count; a count changed by
    # another thread between sizing and the parallel region, the race this indexing removes, is not
    # reproducible from a test.)
    module = quant_gemm()
    assert module is not None
    weight, packed = packed_head(random_blocks("Q8_0", n, K, seed=n))
    x = randn(9, K, seed=threads)
    before = module.get_num_threads()
    try:
        module.set_num_threads(threads)
        got = screened_argmax(x, packed)
    finally:
        module.set_num_threads(before)
    assert got is not None and np.array_equal(got, full_argmax(x, weight, packed))
