"""The controller on synthetic step-time traces: it converges, backs off, and respects its bounds."""
from __future__ import annotations

import math
import random

import pytest

from conveyor.control import ControllerConfig, SloController
from conveyor.control.step_model import StepFeatures
from tests.control.synthetic import LinearCost, StubScheduler, decode_step, drive


def controller(target_s: float = 0.2, **kwargs: object) -> SloController:
    return SloController(ControllerConfig(**{"tpot_target_s": target_s, "max_num_seqs": 64,
                                             "max_num_batched_tokens": 2048, **kwargs}))


def best_cap(cost: LinearCost, ctrl: SloController, context: int = 256, prefill_per_row: float = 0.5) -> int:
    """The largest batch whose steady step (rows + their share of prefill) fits the step target: the
    empty-batch step plus `gain` of the headroom between it and the TPOT target."""
    floor = cost.scale * cost.a
    step_target = floor + ctrl.feedback.gain * (ctrl.config.tpot_target_s - floor)
    per_row = cost.scale * (cost.b + cost.c * prefill_per_row + cost.d * context)
    return math.floor((step_target - floor) / per_row)


def test_converges_to_the_largest_cap_whose_step_fits_the_target():
    cost, ctrl = LinearCost(), controller(0.2)
    caps = drive(ctrl, cost, steps=150)
    expected = best_cap(cost, ctrl)  # 35 with these numbers
    assert 20 < expected < 64
    assert all(abs(c - expected) <= 1 for c in caps[-50:])
    state = ctrl.state
    assert state.planned_step_s == pytest.approx(state.step_target_s, rel=0.05)
    assert state.step_target_s == pytest.approx(cost.a + ctrl.feedback.gain * (0.2 - cost.a), rel=0.02)
    assert state.predicted_step_s == pytest.approx(state.measured_step_s, rel=0.02)


def test_rises_gradually_from_a_small_start():
    caps = drive(controller(0.2, initial_cap=4), LinearCost(), steps=40)
    assert caps[0] == 4
    assert all(b <= math.floor(a * 1.25) + 1 for a, b in zip(caps, caps[1:]))


def test_backs_off_within_a_few_steps_when_step_time_jumps():
    cost, ctrl = LinearCost(), controller(0.2)
    before = drive(ctrl, cost, steps=150)[-1]
    cost.scale = 1.6  # the machine slows down: the old cap now breaks the target
    after = drive(ctrl, cost, steps=15)
    target = best_cap(cost, ctrl)
    assert target < before * 0.6
    # Backed off within 15 steps (the batch itself only shrinks as requests finish, over many more).
    assert after[-1] <= target + 2
    settled = drive(ctrl, cost, steps=100)
    assert all(abs(c - target) <= 2 for c in settled[-30:])
    cost.scale = 1.0  # and it comes back up when the machine recovers
    assert abs(drive(ctrl, cost, steps=150)[-1] - before) <= 2


def test_cap_stays_at_one_when_even_an_empty_step_breaks_the_target():
    caps = drive(controller(0.05), LinearCost(), steps=60)  # the intercept alone is 70 ms
    assert min(caps) >= 1 and caps[-1] == 1


def test_cap_never_exceeds_the_configured_max_when_the_target_is_loose():
    caps = drive(controller(5.0, max_num_seqs=48), LinearCost(), steps=60)
    assert max(caps) == 48 and caps[-1] == 48


def test_cap_never_exceeds_what_the_kv_cache_holds():
    # Requests of 64 prompt + 4096 max tokens; 20 of them fit 83,200 KV tokens.
    ctrl = controller(5.0, kv_capacity_tokens=20 * (64 + 4096))
    caps = drive(ctrl, LinearCost(), steps=60, prefill_per_row=1.0)
    assert ctrl.kv_seq_limit == 20
    assert max(caps) <= 20 and caps[-1] == 20


@pytest.mark.parametrize("seed", range(5))
def test_bounds_hold_on_random_traces(seed: int):
    rng = random.Random(seed)
    ctrl = controller(rng.uniform(0.01, 1.0), max_num_seqs=rng.randint(1, 128),
                      max_num_batched_tokens=rng.randint(1, 4096), kv_capacity_tokens=rng.randint(100, 10**6))
    scheduler = StubScheduler()
    for _ in range(300):
        ctrl.before_schedule(scheduler, 0.0)
        out = decode_step(rng.randint(1, 80), rng.randint(2, 2000), rng.choice([0, 0, rng.randint(2, 500)]))
        scheduler.num_running = rng.randint(0, 100)
        ctrl.on_scheduled(out, scheduler)
        ctrl.after_step(rng.expovariate(10.0) * rng.choice([1, 1, 1, 5]), [], [], scheduler)
        c = ctrl.config
        assert 1 <= ctrl.cap <= min(c.max_num_seqs, ctrl.kv_seq_limit)
        assert 1 <= ctrl.budget <= c.max_num_batched_tokens
        assert scheduler.limits[0] is None or 1 <= scheduler.limits[0] <= c.max_num_seqs


def test_budget_leaves_room_for_the_decodes_plus_a_chunk_and_bounds_the_spike():
    cost, ctrl = LinearCost(), controller(0.2)
    drive(ctrl, cost, steps=150)
    cap, budget = ctrl.cap, ctrl.budget
    assert cap + ctrl.config.min_prefill_chunk <= budget <= 2048
    worst = cost(StepFeatures(cap, budget - cap, 256))  # the cap's decodes plus a full prefill chunk
    assert worst <= ctrl.config.spike_tolerance * ctrl.state.step_target_s * 1.05


def test_without_chunked_prefill_the_budget_is_left_alone():
    ctrl = controller(0.2, chunked_prefill=False)
    scheduler = StubScheduler()
    drive(ctrl, LinearCost(), steps=30)
    ctrl.before_schedule(scheduler, 0.0)
    assert scheduler.limits == (ctrl.cap, None)
    assert ctrl.state.token_budget == 2048


def test_a_ttft_only_controller_sets_no_limits():
    ctrl = SloController(ControllerConfig(tpot_target_s=None, ttft_target_s=1.0, max_num_seqs=64,
                                          max_num_batched_tokens=2048))
    scheduler = StubScheduler()
    drive(ctrl, LinearCost(), steps=20)
    ctrl.before_schedule(scheduler, 0.0)
    assert scheduler.limits == (None, None)
    assert ctrl.state.batch_cap == 64


def test_a_model_fitted_on_one_batch_size_does_not_pin_the_cap_low():
    # Light load first: every step holds one request, so a fixed cost and a per-row cost look alike.
    cost, ctrl = LinearCost(), controller(0.2)
    scheduler = StubScheduler()
    for _ in range(60):
        ctrl.before_schedule(scheduler, 0.0)
        out = decode_step(1, 256)
        scheduler.num_running = 1
        ctrl.on_scheduled(out, scheduler)
        ctrl.after_step(cost(StepFeatures(1, 0, 256)), [], [], scheduler)
    assert ctrl.cap > 4  # it did not conclude that one row costs a whole step
    caps = drive(ctrl, cost, steps=100)  # then the load arrives
    assert abs(caps[-1] - best_cap(cost, ctrl)) <= 2
