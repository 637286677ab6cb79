import numpy as np
import pytest

from conveyor.model import linear as linear_module
from conveyor.model.kernels import panel_gemm
from conveyor.model.linear import Embedding, Linear, PackedWeight, linear, pack_weight, reference_product
from conveyor.model.quantized import bf16_bits, bf16_to_float32

pytestmark = pytest.mark.skipif(pack_weight(np.ones((4, 4), dtype=np.float32)) is None,
                                reason="the panel kernel is not built here")


def _randn(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def plain(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x @ W^T (+ b) in float64, rounded to fp32: the reference the products are held to."""
    y = x.astype(np.float64) @ weight.astype(np.float64).T
    return (y if bias is None else y + bias).astype(np.float32)


def assert_close(got: np.ndarray, want: np.ndarray, rtol: float = 1e-5, atol: float = 2e-4) -> None:
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 33, 200, 600])
@pytest.mark.parametrize("out_features", [960, 1000])  # 1000: the last panel holds 8 real columns
def test_packed_product_matches_plain(rows: int, out_features: int) -> None:
    weight, bias, x = _randn(out_features, 576, seed=0), _randn(out_features, seed=1), _randn(rows, 576, seed=2)
    packed = pack_weight(weight)
    assert packed is not None
    assert_close(linear(x, weight, packed, bias), plain(x, weight, bias))
    assert_close(linear(x, weight, packed), plain(x, weight))


@pytest.mark.skipif(panel_gemm() is None, reason="panel kernel not built here")
def test_a_rows_product_does_not_depend_on_the_rows_beside_it() -> None:
    # A token's projections must come out the same in a decode step, a prefill chunk or the suffix
    # after a prefix-cache hit: each column is one FMA chain over k whatever the tile or row block.
    weight, bias = _randn(200, 576, seed=2), _randn(200, seed=3)
    x = _randn(301, 576, seed=4)  # row blocks of 120 / 96, tiles of 12 / 6 and their remainders
    packed = pack_weight(weight)
    assert packed is not None
    whole = linear(x, weight, packed, bias)
    for start, rows in ((0, 1), (7, 1), (0, 13), (250, 51), (3, 130), (0, 241)):
        assert np.array_equal(linear(x[start : start + rows], weight, packed, bias), whole[start : start + rows]), rows


def test_rows_of_a_wider_array_need_no_copy() -> None:
    weight, wide = _randn(48, 64, seed=1), _randn(9, 200, seed=2)
    x = wide[:, 10:74]  # row stride 200, columns contiguous
    packed = pack_weight(weight)
    assert_close(linear(x, weight, packed), plain(x, weight), atol=1e-4)
    assert_close(linear(np.asfortranarray(x), weight, packed), plain(x, weight), atol=1e-4)


@pytest.mark.skipif(panel_gemm() is None, reason="panel kernel not built here")
def test_panel_kernel_rejects_mismatched_shapes() -> None:
    kernel = panel_gemm()
    packed = kernel.pack_panels(_randn(40, 32))  # type: ignore[union-attr]
    with pytest.raises((RuntimeError, ValueError), match="features"):
        kernel.panel_matmul(_randn(3, 31), packed, 40, None)  # type: ignore[union-attr]
    with pytest.raises((RuntimeError, ValueError), match="out_features"):
        kernel.panel_matmul(_randn(3, 32), packed, 60, None)  # type: ignore[union-attr]
    with pytest.raises((RuntimeError, ValueError), match="bias"):
        kernel.panel_matmul(_randn(3, 32), packed, 40, _randn(39))  # type: ignore[union-attr]
    assert kernel.panel_matmul(np.zeros((0, 32), dtype=np.float32), packed, 40, None).shape == (0, 40)  # type: ignore[union-attr]


def test_packed_path_is_taken_for_fp32_batches_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = linear_module.packed_product
    monkeypatch.setattr(linear_module, "packed_product", lambda *args: calls.append(1) or real(*args))
    weight = _randn(64, 32)
    packed = pack_weight(weight)
    linear(_randn(1, 32), weight, packed)
    assert len(calls) == 1
    linear(_randn(3, 32).astype(np.float64), weight, packed)  # not fp32 activations: the plain path
    assert len(calls) == 1
    linear(_randn(4096, 32), None, packed)  # held only packed: the kernel at any number of rows
    assert len(calls) == 2
    monkeypatch.setenv("CONVEYOR_PACKED_LINEAR", "0")
    linear(_randn(1, 32), weight, packed)
    assert len(calls) == 2


def test_kernels_turned_off_after_packing_fall_back_to_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    weight, x = _randn(40, 24), _randn(4, 24, seed=1)
    packed = pack_weight(weight)
    monkeypatch.setenv("CONVEYOR_KERNELS", "0")
    assert np.array_equal(linear(x, weight, packed), reference_product(x, weight))
    # A weight held only packed still runs: the switch decides at load whether to pack.
    assert_close(linear(x, None, packed), plain(x, weight), atol=1e-4)


def test_the_reference_product_is_numpys_matmul_on_fp32_or_expanded_bf16() -> None:
    """What a plain weight runs on: x @ W^T in fp32, a bf16 weight (its bits) expanded exactly first."""
    weight, bias, x = _randn(24, 40), _randn(24, seed=1), _randn(5, 40, seed=2)
    assert_close(reference_product(x, weight, bias), plain(x, weight, bias), atol=1e-5)
    bits = bf16_bits(weight)
    assert_close(reference_product(x, bits, bias), plain(x, bf16_to_float32(bits), bias), atol=1e-5)


def test_no_panels_for_other_dtypes_or_when_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pack_weight(_randn(8, 8).astype(np.float64)) is None
    assert pack_weight(bf16_bits(_randn(8, 8))) is None  # bf16 bits take the BF16 blocks' panels instead
    monkeypatch.setenv("CONVEYOR_PACKED_LINEAR", "0")
    assert pack_weight(_randn(8, 8)) is None


def test_linear_holds_its_weight_once() -> None:
    layer = Linear(16, 24, bias=True)
    weight, x = _randn(24, 16), _randn(8, 16, seed=1)
    layer.load(weight)
    assert layer.packed is not None and layer.weight is None
    assert layer.bias is not None
    assert_close(layer(x), plain(x, weight, layer.bias), atol=1e-5)
    with pytest.raises(ValueError, match="projection"):
        layer.load(_randn(16, 16))


@pytest.mark.skipif(linear_module.quant_gemm() is None, reason="block kernel not built here")
def test_a_bf16_model_holds_its_weight_in_bf16_panels_and_multiplies_fp32_activations() -> None:
    """dtype "bfloat16": the weight rounded to bf16 (nearest even) in the BF16 panels, no fp32 copy;
    its exact product is fp32 activations times the bf16 values, bit for bit dequantize-then-multiply."""
    layer = Linear(64, 40, bias=True)
    weight, x = _randn(40, 64), _randn(9, 64, seed=1)
    layer.load(weight, "bfloat16")
    assert layer.weight is None and layer.packed is not None and layer.packed.layout == "BF16"
    assert layer.packed.nbytes == 40 // 16 * 16 * 64 * 2 + 16 * 64 * 2  # 3 panels of 16 columns, 2 bytes a weight
    rounded = bf16_to_float32(bf16_bits(weight))
    assert np.array_equal(layer.packed.rows(np.arange(40)), rounded)
    assert layer.bias is not None
    exact = linear_module.matmul_path("float32")(x, layer.weight, layer.packed, layer.bias)
    assert_close(exact, plain(x, rounded, layer.bias), atol=1e-5)


def test_a_bf16_weight_without_the_kernel_stays_its_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_KERNELS", "0")
    layer = Linear(64, 40)
    weight, x = _randn(40, 64), _randn(3, 64, seed=1)
    layer.load(weight, "bfloat16")
    assert layer.packed is None and layer.weight is not None and layer.weight.dtype == np.uint16
    assert_close(layer(x), plain(x, bf16_to_float32(bf16_bits(weight))), atol=1e-5)
    embed = Embedding(40, 64)
    embed.load(weight, "bfloat16")
    assert np.array_equal(embed(np.array([3, 0, 39])), bf16_to_float32(bf16_bits(weight[[3, 0, 39]])))


@pytest.mark.skipif(panel_gemm() is None, reason="panel kernel not built here")
def test_embedding_rows_come_from_the_panels_a_tied_head_multiplies_by() -> None:
    weight, ids = _randn(1000, 64), np.array([[0, 999, 17], [16, 15, 500]])
    embed = Embedding(1000, 64)
    embed.load(weight)
    assert embed.weight is None and embed.packed is not None and embed.packed.layout == "panels"
    assert np.array_equal(embed(ids), weight[ids])


@pytest.mark.skipif(panel_gemm() is None, reason="panel kernel not built here")
def test_packed_weights_concatenate_by_panels_or_side_by_side() -> None:
    a, b, c = _randn(32, 48, seed=1), _randn(16, 48, seed=2), _randn(8, 48, seed=3)
    pa, pb, pc = (pack_weight(w) for w in (a, b, c))
    assert pa is not None and pb is not None and pc is not None
    x = _randn(5, 48, seed=4)
    whole = PackedWeight.cat([pa, pb, pc])  # each part starts on a panel's edge: one weight
    assert whole.layout == "panels" and whole.out_features == 56
    assert_close(linear(x, None, whole), plain(x, np.concatenate([a, b, c])), atol=1e-4)
    split = PackedWeight.cat([pa, pc, pb])  # 32 + 8 ends inside a panel: b runs beside it
    assert split.layout == "parts" and [p.out_features for p in split.parts] == [40, 16]
    assert_close(linear(x, None, split), plain(x, np.concatenate([a, c, b])), atol=1e-4)


@pytest.mark.skipif(linear_module.quant_gemm() is None, reason="block kernel not built here")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "BF16"])
def test_blocks_packed_a_run_at_a_time_are_the_whole_matrix_packed(monkeypatch: pytest.MonkeyPatch, qtype: str) -> None:
    """Runs of whole panels (the last one short, 50 rows = 3 panels + 2 rows) laid one after another
    are byte for byte the matrix packed at once, and each run is handed to `taken` after it is packed,
    so a loader can drop its file pages."""
    from gguf import quants
    from gguf.constants import GGMLQuantizationType

    from conveyor.model.quantized import KERNEL_QTYPE, QuantizedWeight

    weight = _randn(50, 256, seed=3)
    if qtype == "BF16":
        held = QuantizedWeight.of_halves(bf16_bits(weight), "BF16")
    else:
        held = QuantizedWeight(qtype, quants.quantize(weight, GGMLQuantizationType[qtype]))
    once = linear_module.quant_gemm().pack_quantized(held.blocks, KERNEL_QTYPE[qtype])  # type: ignore[union-attr]
    monkeypatch.setattr(linear_module, "PACK_RUN_BYTES", 16 * held.blocks.shape[1])
    runs: list[tuple[int, int]] = []
    packed = linear_module.pack_blocks(held, lambda first, end: runs.append((first, end)))
    assert packed is not None and packed.out_features == 50 and packed.layout == qtype
    assert runs == [(0, 16), (16, 32), (32, 48), (48, 50)]
    assert np.array_equal(packed.data, once)


@pytest.mark.skipif(not linear_module.bf16_tiles_available(), reason="no AMX-BF16 tiles on this CPU")
def test_prompt_rows_take_the_tiles_and_the_other_rows_the_int8_kernel() -> None:
    """A step's product with its prompt rows given: those rows are the tile kernel's bits, the others
    the int8 kernel's, wherever they lie in the step; no prompt rows at all is the int8 product."""
    from conveyor.model.kernels import quant_int8
    from conveyor.model.quantized import KERNEL_QTYPE

    from .test_quant_gemm import random_blocks

    q = random_blocks("Q4_K", 48, 512, seed=1)
    layer = Linear(512, 48, bias=True)
    layer.load(q)
    layer.bias = _randn(48)
    assert layer.packed is not None and layer.packed.layout == "Q4_K"
    x = _randn(9, 512, seed=3)
    module, qtype = quant_int8(), KERNEL_QTYPE["Q4_K"]
    tiles = module.bf16_tile_matmul(x, layer.packed.data, 48, layer.bias, qtype)  # type: ignore[union-attr]
    int8 = module.int8_matmul(x, layer.packed.data, 48, layer.bias, qtype)  # type: ignore[union-attr]
    rows = linear_module.PromptRows.of(((1, 3), (5, 9)), 9)
    y = linear_module.matmul_path("int8", rows)(x, layer.weight, layer.packed, layer.bias)
    prompt = np.array([1, 2, 5, 6, 7, 8])
    generated = np.array([0, 3, 4])
    assert np.array_equal(y[prompt], tiles[prompt]) and np.array_equal(y[generated], int8[generated])
    every = linear_module.matmul_path("int8", linear_module.PromptRows.of(((0, 9),), 9))
    assert np.array_equal(every(x, layer.weight, layer.packed, layer.bias), tiles)
    assert linear_module.PromptRows.of((), 9) is None
    assert np.array_equal(linear_module.matmul_path("int8", None)(x, layer.weight, layer.packed, layer.bias), int8)
    fp32 = linear_module.matmul_path("float32", rows)(x, layer.weight, layer.packed, layer.bias)
    assert not np.array_equal(fp32, y), "fp32 activations take neither kernel"


@pytest.mark.parametrize("qtype", ["BF16", "F16"])
def test_16_bit_weights_take_the_bf16_product_with_fast_activations(qtype: str) -> None:
    """activation_dtype "int8" multiplies BF16 and F16 weights by x rounded to bf16 where the CPU
    has AVX512-BF16 (and exactly elsewhere); "float32" keeps the exact product everywhere."""
    from conveyor.model.kernels import quant_gemm, quant_int8
    from conveyor.model.quantized import KERNEL_QTYPE

    from .test_quant_gemm import random_blocks

    module = quant_int8()
    if module is None:
        pytest.skip("no int8 kernel here")
    layer = Linear(512, 48, bias=True)
    layer.load(random_blocks(qtype, 48, 512, seed=2))
    layer.bias = _randn(48)
    assert layer.packed is not None and layer.packed.layout == qtype
    x = _randn(9, 512, seed=3)
    code = KERNEL_QTYPE[qtype]
    exact = quant_gemm().quantized_matmul(x, layer.packed.data, 48, layer.bias, code)  # type: ignore[union-attr]
    fast = linear_module.matmul_path("int8")(x, layer.weight, layer.packed, layer.bias)
    if module.bf16_dot():  # type: ignore[attr-defined]
        assert np.array_equal(fast, module.bf16_dot_matmul(x, layer.packed.data, 48, layer.bias, code))  # type: ignore[attr-defined]
        assert not np.array_equal(fast, exact)
    else:
        assert np.array_equal(fast, exact)
    assert np.array_equal(linear_module.matmul_path("float32")(x, layer.weight, layer.packed, layer.bias), exact)
