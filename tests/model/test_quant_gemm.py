"""The matmul on GGUF Q4_1 / Q8_0 blocks: against gguf's own dequantiser, and bit for bit against
the fp32 panel kernel, on random blocks and on the shipped model's."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import quants
from gguf.constants import GGMLQuantizationType

from conveyor.model.kernels import panel_gemm, quant_gemm
from conveyor.model.linear import Linear, linear, pack_weight
from conveyor.model.quantized import BLOCK_BYTES, KERNEL_QTYPE, QuantizedWeight

pytestmark = pytest.mark.skipif(quant_gemm() is None or panel_gemm() is None, reason="kernels not built here")

# Rows through the in-register tiles (1-5), two of them (6-10) and the L2 buffer (11+).
ROWS = [1, 2, 3, 4, 5, 7, 10, 11, 13, 33]


def random_blocks(qtype: str, rows: int, k: int, seed: int = 0) -> QuantizedWeight:
    rng = np.random.default_rng(seed)
    n_blocks = rows * k // 32
    raw = rng.integers(0, 256, (n_blocks, BLOCK_BYTES[qtype]), dtype=np.uint8)
    scales = rng.uniform(-0.05, 0.05, (n_blocks, 2 if qtype == "Q4_1" else 1)).astype(np.float16)
    raw[:, : 2 * scales.shape[1]] = scales.view(np.uint8)
    return QuantizedWeight(qtype, torch.from_numpy(raw.reshape(rows, -1)))


def reference_fp32(q: QuantizedWeight) -> torch.Tensor:
    """gguf-py's dequantiser, independent of conveyor's loader."""
    flat = quants.dequantize(q.blocks.numpy(), GGMLQuantizationType[q.qtype])
    return torch.from_numpy(np.ascontiguousarray(flat, dtype=np.float32)).reshape(q.blocks.shape[0], -1)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("out_features", [48, 40])  # 40: the last panel holds 8 real columns
def test_blocks_give_the_fp32_products_bit_for_bit(qtype: str, out_features: int) -> None:
    q = random_blocks(qtype, out_features, 96)
    weight = reference_fp32(q)
    packed, dense = pack_weight(weight, q), pack_weight(weight)
    assert packed is not None and packed.layout == qtype and dense is not None and dense.layout == "panels"
    bias = torch.randn(out_features)
    for rows in ROWS:
        x = torch.randn(rows, 96)
        for b in (None, bias):
            got = linear(x, weight, packed, b)
            assert torch.equal(got, linear(x, weight, dense, b)), rows
            torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)


def test_shipped_blocks_match_the_loaded_weights(default_checkpoint) -> None:
    """Q4_1 projections (q/k rows un-permuted like the fp32 weights) and the Q8_0 embedding."""
    quantized = default_checkpoint.quantized
    assert {q.qtype for q in quantized.values()} == {"Q4_1", "Q8_0"}
    assert quantized["model.embed_tokens.weight"].qtype == "Q8_0"
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
             "model.layers.29.mlp.down_proj.weight", "model.embed_tokens.weight"]
    for name in names:
        weight, q = default_checkpoint.weights[name], quantized[name]
        assert torch.equal(reference_fp32(q), weight), name
        packed, dense = pack_weight(weight, q), pack_weight(weight)
        for rows in (1, 4, 9, 17):
            x = torch.randn(rows, weight.shape[1])
            assert torch.equal(linear(x, weight, packed), linear(x, weight, dense)), (name, rows)


def test_fused_projection_blocks_concatenate_rows() -> None:
    parts = [random_blocks("Q4_1", n, 64, seed) for seed, n in enumerate((32, 16, 16))]
    fused = QuantizedWeight.cat(parts)
    assert fused is not None and fused.blocks.shape == (64, 2 * 20)
    layer = Linear(64, 64, bias=False)
    layer.weight.data = torch.cat([reference_fp32(p) for p in parts])
    layer.quantized = fused
    layer.pack()
    x = torch.randn(3, 64)
    assert layer.packed is not None and layer.packed.layout == "Q4_1"
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-4)
    assert QuantizedWeight.cat([parts[0], None]) is None
    assert QuantizedWeight.cat([parts[0], random_blocks("Q8_0", 16, 64)]) is None


def test_bad_blocks_are_rejected() -> None:
    with pytest.raises(ValueError, match="unsupported"):
        QuantizedWeight("Q5_K", torch.zeros(4, 20, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        QuantizedWeight("Q4_1", torch.zeros(4, 21, dtype=torch.uint8))
    q = random_blocks("Q4_1", 32, 64)
    with pytest.raises(ValueError, match="do not match"):
        pack_weight(torch.zeros(32, 96), q)
    kernel = quant_gemm()
    packed = kernel.pack_quantized(q.blocks, KERNEL_QTYPE["Q4_1"])
    with pytest.raises(RuntimeError, match="features"):
        kernel.quantized_matmul(torch.randn(2, 96), packed, 32, None, 0)
    with pytest.raises(RuntimeError, match="bad packed weight"):
        kernel.quantized_matmul(torch.randn(2, 64), packed, 32, None, 1)
    with pytest.raises(RuntimeError, match="out_features"):
        kernel.quantized_matmul(torch.randn(2, 64), packed, 50, None, 0)
    with pytest.raises(RuntimeError, match="qtype"):
        kernel.pack_quantized(q.blocks, 7)
    assert kernel.quantized_matmul(torch.randn(0, 64), packed, 32, None, 0).shape == (0, 32)


def test_kernels_off_after_packing_fall_back_to_the_plain_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    q = random_blocks("Q8_0", 16, 32)
    weight, x = reference_fp32(q), torch.randn(2, 32)
    packed = pack_weight(weight, q)
    monkeypatch.setenv("CONVEYOR_KERNELS", "0")
    torch.testing.assert_close(linear(x, weight, packed), F.linear(x, weight))
