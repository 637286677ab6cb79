"""The TPOT feedback loop: it moves the gain toward the target, with anti-windup."""
from __future__ import annotations

import numpy as np
import pytest

from conveyor.control.feedback import FeedbackConfig, TpotFeedback, quantile


def test_quantile_matches_numpy():
    values = [0.3, 0.1, 0.5, 0.2, 0.9, 0.4]
    for q in (0.0, 0.5, 0.95, 1.0):
        assert quantile(values, q) == pytest.approx(np.quantile(values, q))


def test_gain_rises_when_saturated_requests_beat_the_target():
    fb = TpotFeedback(0.2)
    for _ in range(64):
        fb.observe(0.12, saturated_fraction=1.0)
    assert fb.gain > fb.config.initial_gain


def test_gain_falls_when_requests_miss_the_target_even_unsaturated():
    fb = TpotFeedback(0.2)
    for _ in range(64):
        fb.observe(0.3, saturated_fraction=0.0)
    assert fb.gain < fb.config.initial_gain


def test_light_load_does_not_wind_the_gain_up():
    fb = TpotFeedback(0.2)
    for _ in range(500):
        fb.observe(0.05, saturated_fraction=0.1)  # fast only because few requests were running
    assert fb.gain == fb.config.initial_gain


def test_gain_stays_in_its_bounds():
    cfg = FeedbackConfig(min_gain=0.6, max_gain=1.2)
    low, high = TpotFeedback(0.2, cfg), TpotFeedback(0.2, cfg)
    for _ in range(2000):
        low.observe(5.0, 1.0)
        high.observe(0.001, 1.0)
    assert low.gain == pytest.approx(0.6) and high.gain == pytest.approx(1.2)


def test_settles_where_the_quantile_meets_the_setpoint():
    # TPOT proportional to the gain (the step target): the loop must find gain = 0.95 * 0.2 / 0.25.
    fb = TpotFeedback(0.2)
    for _ in range(3000):
        fb.observe(0.25 * fb.gain, 1.0)
    assert fb.gain == pytest.approx(0.95 * 0.2 / 0.25, rel=0.02)
