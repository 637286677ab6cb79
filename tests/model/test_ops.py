"""The fused C++ layer ops against their numpy reference, alone and inside whole models (those against
transformers, which runs on torch in the test process only)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from conveyor import LLM, SamplingParams
from conveyor.model.kernels import fused_ops
from conveyor.model.ops import FusedOps, ReferenceOps, layer_ops
from conveyor.model.rope import inverse_frequencies, rope_at
from tests.helpers import make_tiny_hf_checkpoint


@pytest.fixture(scope="module")
def fused() -> FusedOps:
    module = fused_ops()
    if module is None:
        pytest.skip("C++ kernels could not be built here (no compiler/ninja)")
    return FusedOps(module)


def _rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def assert_close(got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 rows: split across threads
def test_rms_norm_and_residual_add(fused: FusedOps, rows: int) -> None:
    wide, weight = _rand(rows, 700) * 3, _rand(576, seed=1)
    x = wide[:, :576]  # rows with a stride, as a slice of a wider array
    assert_close(fused.rms_norm(x, weight, 1e-5), ReferenceOps.rms_norm(x, weight, 1e-5), rtol=1e-5, atol=1e-5)
    delta = _rand(rows, 576, seed=2)
    res_fused, res_ref = x.copy(), x.copy()
    h_fused = fused.add_rms_norm_(res_fused, delta, weight, 1e-5)
    h_ref = ReferenceOps.add_rms_norm_(res_ref, delta, weight, 1e-5)
    assert np.array_equal(res_fused, res_ref)  # the residual stream is updated in place, exactly
    assert_close(h_fused, h_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (16, 4, 2), (128, 8, 8), (6, 2, 1)])
def test_rope_and_cache_matches_the_reference_bit_for_bit(fused: FusedOps, head_dim: int, heads: int, kv_heads: int,
                                                          cache_dtype: type) -> None:
    """A float16 cache holds what astype(np.float16) makes (nearest even), head dims on and off
    the kernel's 8-wide conversion steps."""
    rows, block_size, blocks = 11, 4, 8
    qkv = _rand(rows, (heads + 2 * kv_heads) * head_dim)
    positions = np.array([0, 5, 63, 1, 2, 3, 4, 30, 31, 32, 7])
    cos, sin = rope_at(inverse_frequencies(head_dim, 10000.0, None), positions)
    slots = np.random.default_rng(3).permutation(blocks * block_size)[:rows].astype(np.int64)
    results = []
    for ops in (fused, ReferenceOps()):
        caches = [np.zeros((blocks, block_size, kv_heads, head_dim), dtype=cache_dtype) for _ in range(2)]
        rows_in = qkv.copy()
        q, k, v = ops.rope_and_cache(rows_in, cos, sin, *caches, slots, heads, kv_heads)
        results.append((q, k, v, *caches))
    for got, want in zip(*results):
        assert got.shape == want.shape and np.array_equal(got, want)
    assert results[0][0].flags.c_contiguous  # what the decode kernel reads


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(256, 4, 1), (128, 8, 4)])  # Gemma 3 270M, Qwen3-like
def test_rope_and_cache_with_qk_norms_matches_the_reference(fused: FusedOps, head_dim: int, heads: int,
                                                            kv_heads: int) -> None:
    """Per-head RMSNorm of q and k (Gemma 3, Qwen3) before the rotation, in the same C++ pass: equal
    to numpy's within fp32 rounding (the norm's sum runs in another order), the cache rows alike."""
    rows, block_size, blocks = 7, 4, 4
    qkv = _rand(rows, (heads + 2 * kv_heads) * head_dim) * 3
    positions = np.array([0, 9, 63, 1, 2, 40, 5])
    cos, sin = rope_at(inverse_frequencies(head_dim, 1_000_000.0, None), positions)
    slots = np.random.default_rng(4).permutation(blocks * block_size)[:rows].astype(np.int64)
    qk_norm = (_rand(head_dim, seed=5) + 1.0, _rand(head_dim, seed=6) + 1.0, 1e-6)
    results = []
    for ops in (fused, ReferenceOps()):
        caches = [np.zeros((blocks, block_size, kv_heads, head_dim), dtype=np.float32) for _ in range(2)]
        q, k, v = ops.rope_and_cache(qkv.copy(), cos, sin, *caches, slots, heads, kv_heads, qk_norm)
        results.append((q, k, v, *caches))
    for got, want in zip(*results):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.array_equal(results[0][2], results[1][2])  # values are not normed: copied exactly


def test_silu_and_mul(fused: FusedOps) -> None:
    gate_up = _rand(33, 2 * 1536) * 8  # wide enough to reach exp's clamped range
    gate_up[0, :4] = [-100.0, 100.0, 0.0, -0.0]
    assert_close(fused.silu_and_mul(gate_up), ReferenceOps.silu_and_mul(gate_up), rtol=2e-6, atol=1e-6)


def test_gelu_tanh_and_mul_is_torchs_formula() -> None:
    """The reference's GELU-tanh against the formula in float64 (torch's F.gelu(approximate="tanh"))."""
    gate_up = _rand(5, 2 * 640) * 4
    gate, up = gate_up[:, :640].astype(np.float64), gate_up[:, 640:].astype(np.float64)
    want = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3))) * up
    got = ReferenceOps.gelu_tanh_and_mul(gate_up)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,threads", [(1, 2), (63, 2), (64, 2), (301, 2), (301, 3), (500, 1)])
def test_gelu_tanh_by_rows_is_the_reference_bit_for_bit(rows: int, threads: int) -> None:
    """Gemma's GELU split into runs of rows computed side by side gives every element the
    reference's bits (and runs whole below GELU_ROWS_APART)."""
    from conveyor.model.ops import gelu_tanh_and_mul_by_rows

    gate_up = _rand(rows, 2 * 640, seed=rows) * 4
    want = ReferenceOps.gelu_tanh_and_mul(gate_up)
    got = gelu_tanh_and_mul_by_rows(gate_up, threads)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_the_reference_attention_by_query_blocks_is_the_whole_product() -> None:
    """masked_attention takes a long chunk's queries QUERY_BLOCK at a time (its scores would be
    heads x n x L fp32 at once): each row's result is the one a single block gives."""
    from conveyor.model import attention

    rng = np.random.default_rng(3)
    heads, kv_heads, n, keys, d = 4, 2, 3 * attention.QUERY_BLOCK + 17, 3 * attention.QUERY_BLOCK + 40, 32
    q = rng.standard_normal((heads, n, d), dtype=np.float32)
    k = rng.standard_normal((kv_heads, keys, d), dtype=np.float32)
    v = rng.standard_normal((kv_heads, keys, d), dtype=np.float32)
    visible = np.arange(keys)[None, :] <= np.arange(keys - n, keys)[:, None]  # causal, offset by a cache
    blocked = attention.masked_attention(q, k, v, visible, 0.125)
    rows = [attention.masked_attention(q[:, i:i + 1], k, v, visible[i:i + 1], 0.125) for i in range(0, n, 97)]
    np.testing.assert_allclose(blocked[:, ::97], np.concatenate(rows, axis=1), rtol=1e-5, atol=1e-6)
    wide = q.astype(np.float64) @ np.repeat(k, 2, axis=0).astype(np.float64).swapaxes(-1, -2) * 0.125
    wide = np.where(visible, wide, -np.inf)
    weights = np.exp(wide - wide.max(axis=-1, keepdims=True))
    want = (weights / weights.sum(axis=-1, keepdims=True)) @ np.repeat(v, 2, axis=0).astype(np.float64)
    np.testing.assert_allclose(blocked, want, rtol=1e-4, atol=1e-5)


def test_threads_default_to_physical_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from conveyor.model import threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert 1 <= threads.default_num_threads() == threads.physical_cores() <= (os.cpu_count() or 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.default_num_threads() == 3


@pytest.mark.parametrize("rows,vocab", [(1, 262144), (7, 49152), (3, 37), (2, 1), (4, 33)])
def test_argmax_is_numpys_on_random_rows(fused: FusedOps, rows: int, vocab: int) -> None:
    # 37, 33: lengths that end between vector steps; a wider array's column slice: strided rows
    logits = _rand(rows, vocab + 5)[:, :vocab]
    assert np.array_equal(fused.argmax_rows(logits), logits.argmax(axis=-1))
    assert fused.argmax_rows(logits).dtype == np.int64


def test_argmax_ties_infinities_and_nans_as_numpy_and_torch() -> None:
    """numpy's argmax, as torch's: the first index of the maximum; a NaN beats every number, the first
    NaN wins."""
    module = fused_ops()
    if module is None:
        pytest.skip("fused ops unavailable")
    nan, inf = float("nan"), float("inf")
    all_minus_inf = np.full((2, 100), -inf, dtype=np.float32)
    assert np.array_equal(module.argmax_rows(all_minus_inf), np.zeros(2, dtype=np.int64))
    for row, where in (([1.0, 3.0, 3.0, 2.0], 1), ([0.0, nan, 5.0, nan], 1),
                       ([-0.0, 0.0, -1.0, -0.0], 0), ([inf, 1.0, inf, nan], 3), ([1.0, 2.0, inf, 3.0], 2)):
        for at in (0, 40, 123):  # the same pattern in the scalar tail and inside the vector steps
            logits = np.full((1, 160), -1e30, dtype=np.float32)
            logits[0, at : at + 4] = row
            expected = logits.argmax(axis=-1)
            assert int(expected[0]) == at + where  # what numpy (and torch) do, pinned
            assert np.array_equal(module.argmax_rows(logits), expected), (row, at)
            assert np.array_equal(ReferenceOps.argmax_rows(logits), expected)


def test_greedy_sampling_takes_the_kernels_argmax(fused: FusedOps, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    rows_seen: list[int] = []
    kernel = FusedOps.argmax_rows

    def recording(self: FusedOps, logits: np.ndarray) -> np.ndarray:
        rows_seen.append(logits.shape[0])
        return kernel(self, logits)

    monkeypatch.setattr(FusedOps, "argmax_rows", recording)
    llm = LLM(str(make_tiny_hf_checkpoint(tmp_path)), num_kv_blocks=16)
    out = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3))
    assert [len(o.token_ids) for o in out] == [3, 3]
    assert rows_seen == [2, 2, 2]  # one call a step, for both rows


def test_bad_inputs_raise_instead_of_writing_out_of_bounds(fused: FusedOps) -> None:
    caches = [np.zeros((2, 4, 1, 8), dtype=np.float32) for _ in range(2)]
    cos, sin = np.ones((1, 8), dtype=np.float32), np.zeros((1, 8), dtype=np.float32)
    with pytest.raises((RuntimeError, ValueError), match="slot out of range"):
        fused.rope_and_cache(_rand(1, 24), cos, sin, *caches, np.array([8]), 1, 1)
    with pytest.raises((RuntimeError, ValueError), match="row size"):
        fused.rope_and_cache(_rand(1, 32), cos, sin, *caches, np.array([0]), 1, 1)
    with pytest.raises((RuntimeError, ValueError, TypeError), match="float32"):
        fused.rms_norm(_rand(2, 8).astype(np.float64), np.ones(8, dtype=np.float32), 1e-6)
    with pytest.raises((RuntimeError, ValueError), match="norm weight"):
        fused.rms_norm(_rand(2, 8), np.ones(9, dtype=np.float32), 1e-6)
    assert not any(c.any() for c in caches)


def test_reference_ops_when_turned_off(fused: FusedOps, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(layer_ops(), FusedOps)
    monkeypatch.setenv("CONVEYOR_KERNELS", "0")
    assert isinstance(layer_ops(), ReferenceOps)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # plain; q/k/v bias; per-head q/k norms
def test_whole_models_generate_what_transformers_generates(
    fused: FusedOps, tmp_path: Path, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch  # the reference only
    from transformers import AutoModelForCausalLM

    folder = make_tiny_hf_checkpoint(tmp_path, arch, num_layers=3)
    prompts = [[1, 500 + 7 * i, 900, 33 + i, 4000, 12][: 3 + i] for i in range(4)]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=12, do_sample=False, eos_token_id=None)[0, len(p):].tolist()
                for p in prompts]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for kernels in ("1", "0"):
        monkeypatch.setenv("CONVEYOR_KERNELS", kernels)
        llm = LLM(str(folder), max_num_seqs=4, kv_cache_dtype="float32")
        got = [list(out.token_ids) for out in llm.generate(prompts, params)]
        assert got == want, f"CONVEYOR_KERNELS={kernels}"


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}])
def test_rope_at_equals_transformers_rotary_embedding(scaling: dict | None) -> None:
    """cos and sin at a step's positions as HF's rotary embedding computes them: the same fp32
    frequencies and angles; cos and sin within one unit in the last place (torch's fp32 cos and sin,
    MKL's, are not always correctly rounded; these are, from float64)."""
    import torch  # the reference only
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=512, num_attention_heads=8, rope_theta=500_000.0, rope_scaling=scaling,
                         max_position_embeddings=131072)
    positions = np.arange(0, 100_001, 37)
    rotary = LlamaRotaryEmbedding(config)
    want_cos, want_sin = rotary(torch.zeros(1, 1, dtype=torch.float32), torch.from_numpy(positions)[None])
    inv_freq = inverse_frequencies(64, 500_000.0, scaling)
    assert np.array_equal(inv_freq, rotary.inv_freq.numpy())
    cos, sin = rope_at(inv_freq, positions)
    for ours, theirs in ((cos, want_cos[0].numpy()), (sin, want_sin[0].numpy())):
        assert ours.dtype == np.float32 and ours.shape == theirs.shape and ours.flags.c_contiguous
        ulps = np.abs(ours.view(np.int32).astype(np.int64) - theirs.view(np.int32).astype(np.int64))
        assert ulps.max() <= 1 and (ulps == 0).mean() > 0.9
