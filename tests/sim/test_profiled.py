"""The profiled model's fit: recovers known coefficients from synthetic steps; file round trip;
the measuring driver records one shape per executed step."""
from __future__ import annotations

import numpy as np
import pytest

from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.errors import ConfigError
from conveyor.sim.profile_steps import Episode, ProfileGrid, Wave, measure
from conveyor.sim.profiled import FEATURES, Profile, ProfiledCostModel, features, fit_profile, nonnegative_lstsq
from conveyor.sim.shape import StepShape
from tests.fakes import FakeRunner

TRUE = {"const": 0.05, "prefill_tokens": 0.004, "decode_tokens": 0.001, "sampled": 0.002, "prefill_chunks": 0.01,
        "prefill_attention": 2e-6, "cached_chunk_pairs": 4e-6, "decode_context": 1e-5, "decode_padded_context": 3e-5}


def synthetic_shapes(n: int, seed: int = 0) -> list[StepShape]:
    rng = np.random.default_rng(seed)
    shapes = []
    for _ in range(n):
        contexts = rng.integers(8, 600, rng.integers(0, 24)).tolist()
        chunks = [(int(rng.integers(1, 300)), int(rng.integers(0, 400))) for _ in range(rng.integers(0, 3))]
        s = StepShape(decode_tokens=len(contexts), decode_context=sum(contexts), max_decode_context=max(contexts, default=0))
        for n_tok, cached in chunks:
            s.prefill_tokens += n_tok
            s.prefill_chunks += 1
            s.prefill_cached += cached
            s.prefill_attention += n_tok * (cached + (n_tok + 1) / 2)
            s.cached_chunk_pairs += n_tok * (cached + n_tok) if cached else 0
        s.sampled = len(contexts) + int(rng.integers(0, len(chunks) + 1))
        if s.num_tokens:
            shapes.append(s)
    return shapes


def truth(s: StepShape) -> float:
    return float(np.dot(features(s), [TRUE[f] for f in FEATURES]))


def test_fit_recovers_known_coefficients() -> None:
    shapes = synthetic_shapes(300)
    profile = fit_profile(shapes, [truth(s) for s in shapes])
    for name in FEATURES:
        assert profile.coefficients[name] == pytest.approx(TRUE[name], rel=1e-6, abs=1e-12)
    assert profile.r2 == pytest.approx(1.0)


def test_fit_tolerates_noise_and_drops_stalls() -> None:
    shapes = synthetic_shapes(400, seed=1)
    rng = np.random.default_rng(2)
    times = [truth(s) * rng.normal(1.0, 0.03) for s in shapes]
    for i in range(0, 400, 25):  # a step that waited behind another process: 3x slower
        times[i] *= 3
    profile = fit_profile(shapes, times)
    model = ProfiledCostModel(profile)
    errors = [abs(model.step_time(s) - truth(s)) / truth(s) for s in shapes]
    assert np.median(errors) < 0.02
    assert profile.meta["outliers_dropped"] >= 16


def test_nonnegative_least_squares_drops_negative_terms() -> None:
    x = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]])
    y = np.array([3.0, 2.0, 1.0])  # slope -1: the feature cannot make steps cheaper
    coef = nonnegative_lstsq(x, y)
    assert coef[1] == 0.0 and coef[0] == pytest.approx(2.0)


def test_profile_file_round_trip(tmp_path) -> None:  # noqa: ANN001
    shapes = synthetic_shapes(50)
    path = fit_profile(shapes, [truth(s) for s in shapes], {"model": "x"}).save(tmp_path / "p.json")
    model = ProfiledCostModel.load(path)
    assert model.step_time(shapes[0]) == pytest.approx(truth(shapes[0]))
    with pytest.raises(ConfigError):
        Profile.load(tmp_path / "missing.json")


def test_measure_records_every_step_shape() -> None:
    engine = LLMEngine(EngineConfig.from_kwargs(max_num_seqs=16), FakeRunner(1000), num_kv_blocks=512,
                       max_model_len=4096, vocab_size=1000)
    grid = ProfileGrid(batch_sizes=[1, 3], contexts=[40], decode_steps=2, prompt_lens=[50])
    samples = measure(engine, grid, echo=None)
    decode_steps = [s for s, _ in samples if s.decode_tokens == 3 and not s.prefill_tokens]
    assert len(decode_steps) >= 2  # the batch of 3 decodes together after its prefill
    assert all(seconds > 0 for _, seconds in samples)
    whole = [s for s, _ in samples if s.prefill_tokens == 50]
    assert len(whole) == 1 and whole[0].prefill_chunks == 1  # the unchunked prompt is one step
    assert not engine.has_unfinished_requests


def test_chunk_episode_puts_chunks_beside_decodes() -> None:
    engine = LLMEngine(EngineConfig.from_kwargs(max_num_seqs=16), FakeRunner(1000), num_kv_blocks=512,
                       max_model_len=4096, vocab_size=1000)
    grid = ProfileGrid(batch_sizes=[], contexts=[], prompt_lens=[])
    grid_eps = [Episode([Wave([20] * 4, 10), Wave([200], 2)], budget=64)]
    grid.episodes = lambda: grid_eps  # type: ignore[method-assign]
    samples = measure(engine, grid, echo=None)
    mixed = [s for s, _ in samples if s.decode_tokens == 4 and s.prefill_tokens == 60]
    assert mixed and any(s.prefill_cached > 0 for s in mixed)


def test_fit_command_on_the_real_model(tmp_path, capsys) -> None:  # noqa: ANN001
    """The one real-model test: a tiny grid through `conveyor simulate fit`, then a simulation on it."""
    from conveyor.cli import main

    path = tmp_path / "profile.json"
    assert main(["simulate", "fit", "--num-threads", "1", "--batch-sizes", "1", "3", "--contexts", "16",
                 "--prompt-lens", "24", "--no-chunk-episodes", "--output", str(path)]) == 0
    profile = Profile.load(path)
    assert profile.num_samples >= 5 and profile.meta["num_threads"] == 1
    assert all(v >= 0 for v in profile.coefficients.values())
    # Where the per-step cost lands (the intercept, or per-token terms) is up to a 10-sample fit of
    # noisy timings; a step of one sequence must cost something whichever it is.
    one_row = StepShape(decode_tokens=1, sampled=1, decode_context=16, max_decode_context=16)
    assert ProfiledCostModel(profile).step_time(one_row) > 0
    assert main(["simulate", "--hardware", "this-machine", "--cost-model", "profiled", "--profile", str(path),
                 "--model", "smollm2-135m", "--dataset", "uniform", "--input-len", "16", "--output-len", "4",
                 "--num-prompts", "3"]) == 0
    assert "Successful requests:                     3" in capsys.readouterr().out
