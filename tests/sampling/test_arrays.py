"""conveyor/sampling/arrays.py: a row's best tokens without sorting it, in a stable sort's order."""
from __future__ import annotations

import numpy as np
import pytest

from conveyor.sampling.arrays import log_softmax, log_totals, top_window, whole_row_draw


def stable_best(x: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-x.astype(np.float64), axis=-1, kind="stable")[:, :k]


def bf16(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


@pytest.mark.parametrize("vocab", [1, 5, 300, 4096, 151_936])
@pytest.mark.parametrize("k", [1, 3, 40, 256, 2048, 16_384, 200_000])
def test_the_window_is_a_stable_descending_sorts_first_k(vocab: int, k: int) -> None:
    rng = np.random.default_rng(vocab + k)
    rows = [rng.standard_normal(vocab) * 3,
            bf16(rng.standard_normal(vocab) * 4),  # ties, as bf16 weights give them
            np.where(rng.random(vocab) < 0.99, -np.inf, rng.standard_normal(vocab)),  # mostly banned
            np.full(vocab, -np.inf),  # all banned
            np.round(rng.standard_normal(vocab))]  # few values, -0.0 among them
    x = np.stack(rows).astype(np.float32)
    x[4, ::7] = -0.0
    values, ids = top_window(x, k)
    want = stable_best(x, min(k, vocab))
    assert ids.dtype == np.int64 and np.array_equal(ids, want)
    assert np.array_equal(values, np.take_along_axis(x, want, -1))


def test_nan_comes_first_and_a_row_with_it_is_still_whole() -> None:
    x = np.random.default_rng(0).standard_normal((2, 5000)).astype(np.float32)
    x[0, [40, 9]] = np.nan
    values, ids = top_window(x, 4)
    assert ids[0, :2].tolist() == [9, 40] and np.isnan(values[0, :2]).all()
    assert ids[0, 2:].tolist() == stable_best(np.nan_to_num(x[:1], nan=-np.inf), 2)[0].tolist()
    assert ids[1].tolist() == stable_best(x[1:], 4)[0].tolist()


def test_float64_rows_take_a_stable_sort() -> None:
    x = np.array([[1.0, 3.0, 3.0, 2.0]])
    assert top_window(x, 3)[1].tolist() == [[1, 2, 3]] and top_window(x, 0)[1].shape == (1, 0)


def test_totals_sum_in_float64() -> None:
    # A flat row of a hundred thousand terms: float32's running sum drifts, float64's does not.
    x = np.random.default_rng(1).standard_normal((2, 151_936)).astype(np.float32) * 0.1
    exact = np.log(np.exp(x.astype(np.float64)).sum(axis=-1))
    assert np.allclose(log_totals(x), exact, rtol=0, atol=1e-8)
    assert np.allclose(log_softmax(x), x - exact[:, None].astype(np.float32), atol=2e-6)
    assert np.isnan(log_totals(np.full((1, 4), -np.inf, dtype=np.float32))).all()


def test_a_whole_row_draw_inverts_the_float64_cdf_and_skips_tokens_without_mass() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 5000)).astype(np.float32)
    x[:, 1000:2100] = -np.inf  # a whole block and parts of two others without mass
    x[:, 0] = -np.inf
    uniform = np.concatenate([[0.0, 1 - 2**-53], rng.random(62)])
    drawn = whole_row_draw(x, uniform)
    for row in range(64):
        exps = np.exp(x[row] - x[row].max()).astype(np.float64)  # float32 exponentials, summed in float64
        cdf = np.cumsum(exps)
        assert drawn[row] == np.searchsorted(cdf, uniform[row] * cdf[-1], side="right"), row
        assert np.isfinite(x[row, drawn[row]])
