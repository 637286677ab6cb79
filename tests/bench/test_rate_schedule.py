"""Piecewise request rates (`--rate-schedule`): parsing, and arrivals that follow the schedule."""
from __future__ import annotations

import numpy as np
import pytest

from conveyor.bench.workloads import arrival_times, expected_arrivals, parse_rate_schedule


def test_parse():
    assert parse_rate_schedule("0:1,120:4,240:1") == [(0, 1), (120, 4), (240, 1)]
    assert parse_rate_schedule("0:2.5") == [(0, 2.5)]
    for bad in ("", "1:1", "0:1,0:2", "0:1,10:-1", "0:1,10:0", "0:1,x:2", "0:1:2", "0:inf"):
        with pytest.raises(ValueError):
            parse_rate_schedule(bad)


def test_expected_arrivals_integrates_the_rate():
    schedule = parse_rate_schedule("0:1,10:4,20:0,30:2")
    assert expected_arrivals(schedule, 10) == 10
    assert expected_arrivals(schedule, 15) == 30
    assert expected_arrivals(schedule, 30) == 50
    assert expected_arrivals(schedule, 40) == 70


def test_arrivals_follow_the_rate_of_each_segment():
    schedule = parse_rate_schedule("0:2,200:10,300:0,400:2")
    times = np.array(arrival_times(3000, 1.0, seed=3, schedule=schedule))
    assert np.all(np.diff(times) >= 0)
    counts = [((times >= a) & (times < b)).sum() for a, b in ((0, 200), (200, 300), (300, 400), (400, 600))]
    assert counts[0] == pytest.approx(400, rel=0.15)
    assert counts[1] == pytest.approx(1000, rel=0.1)
    assert counts[2] == 0  # a pause
    assert counts[3] == pytest.approx(400, rel=0.15)


def test_same_seed_same_arrivals_and_regular_gaps_at_infinite_burstiness():
    schedule = parse_rate_schedule("0:1,5:2")
    assert arrival_times(20, 1.0, 1.0, 7, schedule) == arrival_times(20, 1.0, 1.0, 7, schedule)
    regular = arrival_times(8, 1.0, float("inf"), 0, schedule)
    assert regular == pytest.approx([1, 2, 3, 4, 5, 5.5, 6, 6.5])
