"""Gemma 3 on a tiny random checkpoint against transformers: sliding-window layers (window 8, so
short prompts cross it), a global layer, per-kind RoPE bases, the 1 + weight norms, the sandwich
norms, GELU(tanh), the scaled embedding, query_pre_attn_scalar and the final logit softcap."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.model.loader import load_checkpoint
from tests.helpers import make_tiny_hf_checkpoint

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3", num_layers=3, tie_word_embeddings=True,
                                   layer_types=LAYER_TYPES)


def test_tiny_gemma3_config(tiny_gemma3: Path) -> None:
    c = load_checkpoint(str(tiny_gemma3)).config
    assert c.architecture == "Gemma3ForCausalLM" and c.layer_types == tuple(LAYER_TYPES)
    assert [c.window(i) for i in range(3)] == [8, None, 8]
    assert (c.rope_theta, c.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert c.attention_scale == 24**-0.5 and c.final_logit_softcapping == 30.0
    assert c.qk_norm and c.sandwich_norms and c.scale_embeddings and c.norm_weight_offset == 1.0


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_tiny_gemma3_generates_what_transformers_generates(
    tiny_gemma3: Path, kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts shorter and longer than the window, decoding well past it, batched, in prefill
    chunks of 5 tokens (so chunks straddle the window's edge) over blocks of 4."""
    from transformers import AutoModelForCausalLM

    prompts = [[1, *range(100 + 37 * i, 100 + 37 * i + n)] for i, n in enumerate([2, 6, 7, 8, 12, 19])]
    hf = AutoModelForCausalLM.from_pretrained(tiny_gemma3, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=20, do_sample=False, eos_token_id=None)[0, len(p):].tolist()
                for p in prompts]
    monkeypatch.setenv("CONVEYOR_KERNELS", kernels)
    llm = LLM(str(tiny_gemma3), max_num_seqs=6, max_num_batched_tokens=5, block_size=4, kv_cache_dtype="float32")
    got = [list(out.token_ids) for out in llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0,
                                                                                ignore_eos=True))]
    assert got == want
