"""The online step-time model: exact on clean linear data, non-negative, and it follows a change."""
from __future__ import annotations

import random

import pytest

from conveyor.control.step_model import FEATURES, StepFeatures, StepTimeModel, fit_once, step_features
from tests.control.synthetic import LinearCost, decode_step


def random_features(rng: random.Random) -> StepFeatures:
    return StepFeatures(rng.randint(0, 64), rng.choice([0, rng.randint(1, 512)]), rng.randint(1, 1024))


def test_recovers_the_coefficients_of_a_linear_cost():
    rng, cost = random.Random(0), LinearCost()
    model = fit_once([(f, cost(f)) for f in (random_features(rng) for _ in range(200))])
    got = model.coefficients()
    for name, true in zip(FEATURES, (cost.a, cost.b, cost.c, cost.d)):
        assert got[name] == pytest.approx(true, rel=0.02), name
    f = StepFeatures(48, 100, 700)
    assert model.predict(f) == pytest.approx(cost(f), rel=0.01)


def test_coefficients_stay_non_negative_even_when_the_data_says_otherwise():
    rng = random.Random(1)
    # Prefill tokens that seem to make steps faster: noise the model must not believe.
    samples = [(f, max(0.001, 0.05 + 0.002 * f.decode_rows - 0.0001 * f.prefill_tokens))
               for f in (random_features(rng) for _ in range(100))]
    model = fit_once(samples)
    assert all(c >= 0 for c in model.coef)
    assert model.coefficients()["prefill_tokens"] == 0.0


def test_forgets_old_samples_and_follows_a_slower_machine():
    rng, cost = random.Random(2), LinearCost()
    model = StepTimeModel(forgetting=0.95)
    for _ in range(100):
        f = random_features(rng)
        model.observe(f, cost(f))
    cost.scale = 2.0
    for _ in range(150):
        f = random_features(rng)
        model.observe(f, cost(f))
    f = StepFeatures(32, 64, 256)
    assert model.predict(f) == pytest.approx(cost(f), rel=0.05)


def test_a_single_stray_step_is_clipped():
    rng, cost = random.Random(3), LinearCost()
    model = StepTimeModel()
    for _ in range(50):
        f = random_features(rng)
        model.observe(f, cost(f))
    f = StepFeatures(16, 0, 128)
    before = model.predict(f)
    model.observe(f, 100 * cost(f))  # a 100x stall (another process, a GC pause)
    assert model.predict(f) < 1.2 * before


def test_rescale_scales_every_prediction():
    rng, cost = random.Random(4), LinearCost()
    model = fit_once([(f, cost(f)) for f in (random_features(rng) for _ in range(50))])
    f = StepFeatures(10, 20, 300)
    before = model.predict(f)
    model.rescale(1.5)
    assert model.predict(f) == pytest.approx(1.5 * before)


def test_features_of_a_step_count_each_decode_row_at_its_own_context():
    out = decode_step(rows=3, context=100, prefill=40)
    out.scheduled[0][0].num_computed_tokens = 299  # one row at context 300, two at 100
    f = step_features(out)
    assert (f.decode_rows, f.prefill_tokens, f.decode_context) == (3, 40, 500 / 3)
    assert f.vector == pytest.approx((1.0, 3, 40, 500))


def test_negative_durations_are_refused():
    with pytest.raises(ValueError):
        StepTimeModel().observe(StepFeatures(1, 0, 1), -1.0)
