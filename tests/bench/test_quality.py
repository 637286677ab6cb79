"""`conveyor bench quality`'s bounds, held on the three real models: the fast default (int8
activations, a float16 KV cache) scored against the exact path (fp32 activations and cache),
teacher-forced on the fixed texts. The claim (docs/BENCHMARKS.md, claim 25) is perplexity within
0.5% (also with the vocabulary projection in int8, as requests that sample take it) and top-1
agreement of 98% or more over 4,096 positions of each text; here, to keep the suite short, the
first 1,024 positions, where a top-1 share's standard error is about half a point, so the bound is
a point lower, 97% (on Qwen2.5-Coder, which agrees 99.5%, the first 512: the largest model, its
exact path the slowest, and a standard error of a third of a point there). On a CPU with AMX-BF16
the same bounds hold with every position on the bf16 tiles a prompt's tokens take there. Without
the carried lone large features SmolLM2's code (96.2%) and Gemma's prose (96.4%) fail it; a kernel
that lost a term fails both bounds."""
from __future__ import annotations

import numpy as np
import pytest

from conveyor.bench.quality import run_quality, target_nll
from conveyor.config import EngineConfig
from conveyor.errors import ModelLoadError
from conveyor.model import kernels
from conveyor.model.linear import bf16_tiles_available
from conveyor.runner.model_runner import load_model


TOKENS = 1024  # of each text (512 would not tell the old kernel's Gemma from the new)
# Gemma's prose ratio over 1,024 positions moves by half a point with the rounding of a few cos/sin
# values alone (0.9996 to 1.0055 between ulp-level variants of rotary embedding): 2,048 hold it to
# what the claim's 4,096 measure.
TOKENS_OF = {"qwen2.5-coder-0.5b": 512, "gemma3-270m": 2048}
TOP1_BOUND = 0.97


# The tiles on the largest model only: each case scores two texts twice, and the suite is kept short.
@pytest.mark.skipif(kernels.quant_int8() is None, reason="no integer kernel on this CPU")
@pytest.mark.parametrize("model, tiles", [("smollm2-135m", False), ("gemma3-270m", False),
                                          ("qwen2.5-coder-0.5b", False), ("qwen2.5-coder-0.5b", True)])
def test_the_fast_default_stays_within_the_bounds(model: str, tiles: bool) -> None:
    if tiles and not bf16_tiles_available():
        pytest.skip("no AMX-BF16 tiles on this CPU")
    try:
        loaded = load_model(EngineConfig(model=model))
    except ModelLoadError as e:
        pytest.skip(str(e))
    # tiles: every position scored as a prompt token on the bf16 tiles, as a served prompt computes
    # on a CPU with AMX-BF16 (generated tokens take the int8 kernel, scored without them).
    tokens = TOKENS_OF.get(model, TOKENS)
    results = run_quality(loaded.model, loaded.tokenizer, "int8", tokens, 512, np.dtype(np.float16), prompt_tiles=tiles)
    for r in results:
        assert r.tokens == tokens - 1
        assert abs(r.ppl_ratio - 1.0) <= 0.005, (model, r)
        assert r.top1_agreement >= TOP1_BOUND, (model, r)
        # requests that sample take the vocabulary projection in int8 too
        assert abs(r.sampled_ppl_ratio - 1.0) <= 0.005, (model, r)
        assert r.sampled_ppl != r.ppl, (model, r)  # the sampled rows' projection is a different product


@pytest.mark.parametrize("in_bf16", [False, True])  # fp32 logits, and fp32 logits holding bf16 values
def test_target_nll_is_minus_the_float64_log_softmax_at_the_target(in_bf16: bool) -> None:
    from conveyor.model.quantized import bf16_bits, bf16_to_float32

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((64, 262_144), dtype=np.float32) * 8  # Gemma's vocabulary, a model's spread
    if in_bf16:
        logits = bf16_to_float32(bf16_bits(logits))
    logits[0, 5] = 60.0  # one row nearly certain, its target elsewhere
    target = rng.integers(0, 262_144, 64)
    wide = logits.astype(np.float64)
    top = wide.max(axis=-1, keepdims=True)
    log_softmax = wide - top - np.log(np.exp(wide - top).sum(axis=-1, keepdims=True))
    want = -log_softmax[np.arange(64), target]
    got = target_nll(logits, target)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
