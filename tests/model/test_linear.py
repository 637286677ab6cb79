import pytest
import torch
import torch.nn.functional as F

from conveyor.model import linear as linear_module
from conveyor.model.linear import PLAIN_FROM_ROWS, Linear, linear, pack_weight

pytestmark = pytest.mark.skipif(pack_weight(torch.ones(4, 4)) is None, reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 33, 200])
def test_packed_product_matches_plain(rows: int) -> None:
    torch.manual_seed(0)
    weight, bias, x = torch.randn(960, 576), torch.randn(960), torch.randn(rows, 576)
    packed = pack_weight(weight)
    assert packed is not None
    torch.testing.assert_close(linear(x, weight, packed, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_packed_path_is_taken_for_fp32_decode_batches_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(linear_module, "packed_product", lambda *args: calls.append(1) or real(*args, "none", [], ""))
    weight = torch.randn(64, 32)
    packed = pack_weight(weight)
    linear(torch.randn(1, 32), weight, packed)
    assert len(calls) == 1
    linear(torch.randn(3, 32, dtype=torch.bfloat16), weight.bfloat16(), packed)  # dtype mismatch: plain path
    assert len(calls) == 1
    linear(torch.randn(PLAIN_FROM_ROWS, 32), weight, packed)  # prefill-sized: MKL on the plain weight
    assert len(calls) == 1
    monkeypatch.setenv("CONVEYOR_PACKED_LINEAR", "0")
    linear(torch.randn(1, 32), weight, packed)
    assert len(calls) == 1


def test_no_packing_for_bf16_or_when_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pack_weight(torch.randn(8, 8, dtype=torch.bfloat16)) is None
    monkeypatch.setenv("CONVEYOR_PACKED_LINEAR", "0")
    assert pack_weight(torch.randn(8, 8)) is None


def test_linear_module_packs_after_loading() -> None:
    layer = Linear(16, 24, bias=True)
    x = torch.randn(8, 16)
    plain = layer(x)
    layer.pack()
    assert layer.packed is not None
    torch.testing.assert_close(layer(x), plain, rtol=1e-5, atol=1e-5)
