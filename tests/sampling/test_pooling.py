"""conveyor/sampling/pooling.py's normalisations: llama.cpp's `embd_normalize` codes, the Euclidean
one being the unit length vLLM's and OpenAI's embeddings have."""
from __future__ import annotations

import math

import pytest

from conveyor.errors import InvalidRequestError
from conveyor.sampling.pooling import EUCLIDEAN, MAX_ABSOLUTE, NO_NORM, TAXICAB, PoolingParams, normalized

VECTOR = [3.0, -4.0, 0.5, 12.0]


def test_each_norm_scales_the_vector_to_one_in_that_norm() -> None:
    assert normalized(VECTOR, NO_NORM) == VECTOR
    assert max(abs(v) for v in normalized(VECTOR, MAX_ABSOLUTE)) == pytest.approx(32760.0)
    assert math.fsum(abs(v) for v in normalized(VECTOR, TAXICAB)) == pytest.approx(1.0)
    assert math.fsum(v * v for v in normalized(VECTOR, EUCLIDEAN)) == pytest.approx(1.0)
    assert math.fsum(abs(v) ** 3 for v in normalized(VECTOR, 3)) == pytest.approx(1.0)
    scaled = normalized(VECTOR, 3)
    assert all(a / b == pytest.approx(VECTOR[0] / scaled[0]) for a, b in zip(VECTOR, scaled))  # one factor


def test_the_euclidean_norm_is_the_poolings_own() -> None:
    assert PoolingParams(normalize=True).embedding(VECTOR, 1) == normalized(VECTOR, EUCLIDEAN)
    assert PoolingParams(normalize=False).embedding(VECTOR, 2) == [v / 2 for v in VECTOR]


def test_a_high_p_does_not_overflow_and_a_zero_vector_stays() -> None:
    big = [1e200, -2e200, 3e199]
    assert normalized(big, 50) == pytest.approx([v / (2e200 * (1 + 0.5**50 + 0.15**50) ** (1 / 50)) for v in big])
    assert normalized([0.0, 0.0], 3) == [0.0, 0.0] and normalized([0.0], MAX_ABSOLUTE) == [0.0]


def test_a_code_below_minus_one_is_refused_by_name() -> None:
    with pytest.raises(InvalidRequestError) as refused:
        normalized(VECTOR, -2)
    assert refused.value.param == "norm"
