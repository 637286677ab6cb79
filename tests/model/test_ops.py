"""The fused C++ layer ops against their torch reference, alone and inside whole models."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

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


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 rows: split across threads
def test_rms_norm_and_residual_add(fused: FusedOps, rows: int) -> None:
    wide, weight = _rand(rows, 700) * 3, _rand(576, seed=1)
    x = wide[:, :576]  # rows with a stride, as a slice of a wider tensor
    torch.testing.assert_close(fused.rms_norm(x, weight, 1e-5), ReferenceOps.rms_norm(x, weight, 1e-5),
                               rtol=1e-5, atol=1e-5)
    delta = _rand(rows, 576, seed=2)
    res_fused, res_ref = x.clone(), x.clone()
    h_fused = fused.add_rms_norm_(res_fused, delta, weight, 1e-5)
    h_ref = ReferenceOps.add_rms_norm_(res_ref, delta, weight, 1e-5)
    assert torch.equal(res_fused, res_ref)  # the residual stream is updated in place, exactly
    torch.testing.assert_close(h_fused, h_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (16, 4, 2), (128, 8, 8), (6, 2, 1)])
def test_rope_and_cache_matches_torch_bit_for_bit(fused: FusedOps, head_dim: int, heads: int, kv_heads: int,
                                                  cache_dtype: torch.dtype) -> None:
    """A float16 cache holds what tensor.to(torch.float16) makes (nearest even), head dims on and off
    the kernel's 8-wide conversion steps."""
    rows, block_size, blocks = 11, 4, 8
    qkv = _rand(rows, (heads + 2 * kv_heads) * head_dim)
    positions = torch.tensor([0, 5, 63, 1, 2, 3, 4, 30, 31, 32, 7])
    cos, sin = rope_at(inverse_frequencies(head_dim, 10000.0, None), positions)
    slots = torch.randperm(blocks * block_size, generator=torch.Generator().manual_seed(3))[:rows]
    results = []
    for ops in (fused, ReferenceOps()):
        caches = [torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=cache_dtype) for _ in range(2)]
        rows_in = qkv.clone()
        q, k, v = ops.rope_and_cache(rows_in, cos, sin, *caches, slots, heads, kv_heads)
        results.append((q, k, v, *caches))
    for got, want in zip(*results):
        assert got.shape == want.shape and torch.equal(got, want)
    assert results[0][0].is_contiguous()  # what the decode kernel reads


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(256, 4, 1), (128, 8, 4)])  # Gemma 3 270M, Qwen3-like
def test_rope_and_cache_with_qk_norms_matches_torch(fused: FusedOps, head_dim: int, heads: int, kv_heads: int) -> None:
    """Per-head RMSNorm of q and k (Gemma 3, Qwen3) before the rotation, in the same C++ pass: equal
    to torch's within fp32 rounding (the norm's sum runs in another order), the cache rows alike."""
    rows, block_size, blocks = 7, 4, 4
    qkv = _rand(rows, (heads + 2 * kv_heads) * head_dim) * 3
    positions = torch.tensor([0, 9, 63, 1, 2, 40, 5])
    cos, sin = rope_at(inverse_frequencies(head_dim, 1_000_000.0, None), positions)
    slots = torch.randperm(blocks * block_size, generator=torch.Generator().manual_seed(4))[:rows]
    qk_norm = (_rand(head_dim, seed=5) + 1.0, _rand(head_dim, seed=6) + 1.0, 1e-6)
    results = []
    for ops in (fused, ReferenceOps()):
        caches = [torch.zeros(blocks, block_size, kv_heads, head_dim) for _ in range(2)]
        q, k, v = ops.rope_and_cache(qkv.clone(), cos, sin, *caches, slots, heads, kv_heads, qk_norm)
        results.append((q, k, v, *caches))
    for got, want in zip(*results):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(results[0][2], results[1][2])  # values are not normed: copied exactly


def test_silu_and_mul(fused: FusedOps) -> None:
    gate_up = _rand(33, 2 * 1536) * 8  # wide enough to reach exp's clamped range
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    torch.testing.assert_close(fused.silu_and_mul(gate_up), ReferenceOps.silu_and_mul(gate_up), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows,vocab", [(1, 262144), (7, 49152), (3, 37), (2, 1), (4, 33)])
def test_argmax_is_torchs_on_random_rows(fused: FusedOps, rows: int, vocab: int) -> None:
    # 37, 33: lengths that end between vector steps; a wider tensor's column slice: strided rows
    logits = torch.randn(rows, vocab + 5)[:, :vocab]
    assert torch.equal(fused.argmax_rows(logits), logits.argmax(dim=-1))
    assert fused.argmax_rows(logits).dtype == torch.long


def test_argmax_ties_infinities_and_nans_as_torch() -> None:
    """torch.argmax: the first index of the maximum; a NaN beats every number, the first NaN wins."""
    module = fused_ops()
    if module is None:
        pytest.skip("fused ops unavailable")
    nan, inf = float("nan"), float("inf")
    all_minus_inf = torch.full((2, 100), -inf)
    assert torch.equal(module.argmax_rows(all_minus_inf), torch.zeros(2, dtype=torch.long))
    for row, where in (([1.0, 3.0, 3.0, 2.0], 1), ([0.0, nan, 5.0, nan], 1),
                       ([-0.0, 0.0, -1.0, -0.0], 0), ([inf, 1.0, inf, nan], 3), ([1.0, 2.0, inf, 3.0], 2)):
        for at in (0, 40, 123):  # the same pattern in the scalar tail and inside the vector steps
            logits = torch.full((1, 160), -1e30)
            logits[0, at : at + 4] = torch.tensor(row)
            expected = logits.argmax(dim=-1)
            assert int(expected) == at + where  # what torch does, pinned
            assert torch.equal(module.argmax_rows(logits), expected), (row, at)


def test_greedy_sampling_takes_the_kernels_argmax(fused: FusedOps, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    rows_seen: list[int] = []
    kernel = FusedOps.argmax_rows

    def recording(self: FusedOps, logits: torch.Tensor) -> torch.Tensor:
        rows_seen.append(logits.shape[0])
        return kernel(self, logits)

    monkeypatch.setattr(FusedOps, "argmax_rows", recording)
    llm = LLM(str(make_tiny_hf_checkpoint(tmp_path)), num_kv_blocks=16)
    out = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3))
    assert [len(o.token_ids) for o in out] == [3, 3]
    assert rows_seen == [2, 2, 2]  # one call a step, for both rows


def test_bad_inputs_raise_instead_of_writing_out_of_bounds(fused: FusedOps) -> None:
    caches = [torch.zeros(2, 4, 1, 8) for _ in range(2)]
    cos, sin = torch.ones(1, 8), torch.zeros(1, 8)
    with pytest.raises(RuntimeError, match="slot out of range"):
        fused.rope_and_cache(_rand(1, 24), cos, sin, *caches, torch.tensor([8]), 1, 1)
    with pytest.raises(RuntimeError, match="row size"):
        fused.rope_and_cache(_rand(1, 32), cos, sin, *caches, torch.tensor([0]), 1, 1)
    with pytest.raises(RuntimeError, match="float32"):
        fused.rms_norm(_rand(2, 8).double(), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="norm weight"):
        fused.rms_norm(_rand(2, 8), torch.ones(9), 1e-6)
    assert not any(c.any() for c in caches)


def test_reference_ops_for_other_dtypes_or_when_turned_off(fused: FusedOps, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(layer_ops(torch.float32), FusedOps)
    assert isinstance(layer_ops(torch.bfloat16), ReferenceOps)
    monkeypatch.setenv("CONVEYOR_KERNELS", "0")
    assert isinstance(layer_ops(torch.float32), ReferenceOps)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # plain; q/k/v bias; per-head q/k norms
def test_whole_models_generate_what_transformers_generates(
    fused: FusedOps, tmp_path: Path, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
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
    """cos and sin at a step's positions, bit for bit as HF's rotary embedding computes them."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=512, num_attention_heads=8, rope_theta=500_000.0, rope_scaling=scaling,
                         max_position_embeddings=131072)
    positions = torch.tensor([0, 1, 17, 4095, 8191, 100_000])
    want_cos, want_sin = LlamaRotaryEmbedding(config)(torch.zeros(1, 1, dtype=torch.float32), positions[None])
    cos, sin = rope_at(inverse_frequencies(64, 500_000.0, scaling), positions)
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
