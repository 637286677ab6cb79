import pytest
import torch
import torch.nn.functional as F

from conveyor.model import linear as linear_module
from conveyor.model.kernels import panel_gemm
from conveyor.model.linear import Embedding, Linear, PackedWeight, linear, pack_weight

pytestmark = pytest.mark.skipif(pack_weight(torch.ones(4, 4)) is None, reason="neither the panel kernel nor oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 33, 200, 600])
@pytest.mark.parametrize("out_features", [960, 1000])  # 1000: the last panel holds 8 real columns
def test_packed_product_matches_plain(rows: int, out_features: int) -> None:
    torch.manual_seed(0)
    weight, bias, x = torch.randn(out_features, 576), torch.randn(out_features), torch.randn(rows, 576)
    packed = pack_weight(weight)
    assert packed is not None
    torch.testing.assert_close(linear(x, weight, packed, bias), F.linear(x, weight, bias), rtol=1e-5, atol=2e-4)
    torch.testing.assert_close(linear(x, weight, packed), F.linear(x, weight), rtol=1e-5, atol=2e-4)


@pytest.mark.skipif(panel_gemm() is None, reason="panel kernel not built here")
def test_a_rows_product_does_not_depend_on_the_rows_beside_it() -> None:
    # A token's projections must come out the same in a decode step, a prefill chunk or the suffix
    # after a prefix-cache hit: each column is one FMA chain over k whatever the tile or row block.
    torch.manual_seed(2)
    weight, bias = torch.randn(200, 576), torch.randn(200)
    x = torch.randn(301, 576)  # row blocks of 120 / 96, tiles of 12 / 6 and their remainders
    packed = pack_weight(weight)
    assert packed is not None
    whole = linear(x, weight, packed, bias)
    for start, rows in ((0, 1), (7, 1), (0, 13), (250, 51), (3, 130), (0, 241)):
        assert torch.equal(linear(x[start : start + rows], weight, packed, bias), whole[start : start + rows]), rows


def test_rows_of_a_wider_tensor_need_no_copy() -> None:
    torch.manual_seed(1)
    weight, wide = torch.randn(48, 64), torch.randn(9, 200)
    x = wide[:, 10:74]  # row stride 200, columns contiguous
    packed = pack_weight(weight)
    torch.testing.assert_close(linear(x, weight, packed), F.linear(x, weight), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear(x.t().contiguous().t(), weight, packed), F.linear(x, weight), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(panel_gemm() is None, reason="panel kernel not built here")
def test_panel_kernel_rejects_mismatched_shapes() -> None:
    kernel = panel_gemm()
    packed = kernel.pack_panels(torch.randn(40, 32))
    with pytest.raises(RuntimeError, match="features"):
        kernel.panel_matmul(torch.randn(3, 31), packed, 40, None)
    with pytest.raises(RuntimeError, match="out_features"):
        kernel.panel_matmul(torch.randn(3, 32), packed, 60, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernel.panel_matmul(torch.randn(3, 32), packed, 40, torch.randn(39))
    assert kernel.panel_matmul(torch.randn(0, 32), packed, 40, None).shape == (0, 40)


def test_packed_path_is_taken_for_fp32_batches_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = linear_module.packed_product
    monkeypatch.setattr(linear_module, "packed_product", lambda *args: calls.append(1) or real(*args))
    weight = torch.randn(64, 32)
    packed = pack_weight(weight)
    linear(torch.randn(1, 32), weight, packed)
    assert len(calls) == 1
    linear(torch.randn(3, 32, dtype=torch.bfloat16), weight.bfloat16(), packed)  # dtype mismatch: plain path
    assert len(calls) == 1
    linear(torch.randn(4096, 32), None, packed)  # held only packed: the kernel at any number of rows
    assert len(calls) == 2
    monkeypatch.setenv("CONVEYOR_PACKED_LINEAR", "0")
    linear(torch.randn(1, 32), weight, packed)
    assert len(calls) == 2


def test_kernels_turned_off_after_packing_fall_back_to_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    weight, x = torch.randn(40, 24), torch.randn(4, 24)
    packed = pack_weight(weight)
    monkeypatch.setenv("CONVEYOR_KERNELS", "0")
    torch.testing.assert_close(linear(x, weight, packed), F.linear(x, weight))
    # A weight held only packed still runs: the switch decides at load whether to pack.
    torch.testing.assert_close(linear(x, None, packed), F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_onednn_layout_where_the_kernel_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    monkeypatch.setattr(linear_module, "panel_gemm", lambda: None)
    weight, x = torch.randn(72, 40), torch.randn(5, 40)
    packed = pack_weight(weight)
    assert packed is not None and packed.layout == "onednn"
    torch.testing.assert_close(linear(x, weight, packed), F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_no_packing_for_bf16_or_when_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pack_weight(torch.randn(8, 8, dtype=torch.bfloat16)) is None
    monkeypatch.setenv("CONVEYOR_PACKED_LINEAR", "0")
    assert pack_weight(torch.randn(8, 8)) is None


def test_linear_module_holds_its_weight_once() -> None:
    layer = Linear(16, 24, bias=True)
    weight, x = torch.randn(24, 16), torch.randn(8, 16)
    layer.load(weight)
    assert layer.packed is not None and layer.weight is None
    torch.testing.assert_close(layer(x), F.linear(x, weight, layer.bias), rtol=1e-5, atol=1e-5)
    layer.load(weight.bfloat16(), torch.bfloat16)  # bf16 stays a plain bf16 tensor, no fp32 copy
    assert layer.packed is None and layer.weight is not None and layer.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="projection"):
        layer.load(torch.randn(16, 16))


@pytest.mark.skipif(panel_gemm() is None, reason="panel kernel not built here")
def test_embedding_rows_come_from_the_panels_a_tied_head_multiplies_by() -> None:
    weight, ids = torch.randn(1000, 64), torch.tensor([[0, 999, 17], [16, 15, 500]])
    embed = Embedding(1000, 64)
    embed.load(weight)
    assert embed.weight is None and embed.packed is not None and embed.packed.layout == "panels"
    assert torch.equal(embed(ids), F.embedding(ids, weight))


@pytest.mark.skipif(panel_gemm() is None, reason="panel kernel not built here")
def test_packed_weights_concatenate_by_panels_or_side_by_side() -> None:
    a, b, c = torch.randn(32, 48), torch.randn(16, 48), torch.randn(8, 48)
    pa, pb, pc = (pack_weight(w) for w in (a, b, c))
    assert pa is not None and pb is not None and pc is not None
    x = torch.randn(5, 48)
    whole = PackedWeight.cat([pa, pb, pc])  # each part starts on a panel's edge: one weight
    assert whole.layout == "panels" and whole.out_features == 56
    torch.testing.assert_close(linear(x, None, whole), F.linear(x, torch.cat([a, b, c])), rtol=1e-5, atol=1e-4)
    split = PackedWeight.cat([pa, pc, pb])  # 32 + 8 ends inside a panel: b runs beside it
    assert split.layout == "parts" and [p.out_features for p in split.parts] == [40, 16]
    torch.testing.assert_close(linear(x, None, split), F.linear(x, torch.cat([a, c, b])), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(linear_module.quant_gemm() is None, reason="block kernel not built here")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "BF16"])
def test_blocks_packed_a_run_at_a_time_are_the_whole_matrix_packed(monkeypatch: pytest.MonkeyPatch, qtype: str) -> None:
    """Runs of whole panels (the last one short, 50 rows = 3 panels + 2 rows) laid one after another
    are byte for byte the matrix packed at once, and each run is handed to `taken` after it is packed,
    so a loader can drop its file pages."""
    from gguf import quants
    from gguf.constants import GGMLQuantizationType

    from conveyor.model.quantized import KERNEL_QTYPE, QuantizedWeight

    torch.manual_seed(3)
    weight = torch.randn(50, 256)
    if qtype == "BF16":
        held = QuantizedWeight.of_halves(weight.to(torch.bfloat16))
    else:
        held = QuantizedWeight(qtype, torch.from_numpy(quants.quantize(weight.numpy(), GGMLQuantizationType[qtype])))
    once = linear_module.quant_gemm().pack_quantized(held.blocks, KERNEL_QTYPE[qtype])
    monkeypatch.setattr(linear_module, "PACK_RUN_BYTES", 16 * held.blocks.shape[1])
    runs: list[tuple[int, int]] = []
    packed = linear_module.pack_blocks(held, lambda first, end: runs.append((first, end)))
    assert packed is not None and packed.out_features == 50 and packed.layout == qtype
    assert runs == [(0, 16), (16, 32), (32, 48), (48, 50)]
    assert torch.equal(packed.data, once)


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
    layer.bias = torch.nn.Parameter(torch.randn(48))
    assert layer.packed is not None and layer.packed.layout == "Q4_K"
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(3))
    module, qtype = quant_int8(), KERNEL_QTYPE["Q4_K"]
    tiles = module.bf16_tile_matmul(x, layer.packed.data, 48, layer.bias, qtype)  # type: ignore[union-attr]
    int8 = module.int8_matmul(x, layer.packed.data, 48, layer.bias, qtype)  # type: ignore[union-attr]
    rows = linear_module.PromptRows.of(((1, 3), (5, 9)), 9)
    y = linear_module.matmul_path("int8", rows)(x, layer.weight, layer.packed, layer.bias)
    prompt = torch.tensor([1, 2, 5, 6, 7, 8])
    generated = torch.tensor([0, 3, 4])
    assert torch.equal(y[prompt], tiles[prompt]) and torch.equal(y[generated], int8[generated])
    every = linear_module.matmul_path("int8", linear_module.PromptRows.of(((0, 9),), 9))
    assert torch.equal(every(x, layer.weight, layer.packed, layer.bias), tiles)
    assert linear_module.PromptRows.of((), 9) is None
    assert torch.equal(linear_module.matmul_path("int8", None)(x, layer.weight, layer.packed, layer.bias), int8)
    fp32 = linear_module.matmul_path("float32", rows)(x, layer.weight, layer.packed, layer.bias)
    assert not torch.equal(fp32, y), "fp32 activations take neither kernel"


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
    layer.bias = torch.nn.Parameter(torch.randn(48))
    assert layer.packed is not None and layer.packed.layout == qtype
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(3))
    code = KERNEL_QTYPE[qtype]
    exact = quant_gemm().quantized_matmul(x, layer.packed.data, 48, layer.bias, code)  # type: ignore[union-attr]
    fast = linear_module.matmul_path("int8")(x, layer.weight, layer.packed, layer.bias)
    if module.bf16_dot():  # type: ignore[attr-defined]
        assert torch.equal(fast, module.bf16_dot_matmul(x, layer.packed.data, 48, layer.bias, code))  # type: ignore[attr-defined]
        assert not torch.equal(fast, exact)
    else:
        assert torch.equal(fast, exact)
    assert torch.equal(linear_module.matmul_path("float32")(x, layer.weight, layer.packed, layer.bias), exact)
