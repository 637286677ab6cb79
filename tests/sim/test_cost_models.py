"""Cost-model arithmetic against values computed by hand."""
from __future__ import annotations

import pytest

from conveyor.errors import ConfigError
from conveyor.request import Request
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler import SchedulerOutput
from conveyor.sim.hardware import HardwareSpec, get_hardware
from conveyor.sim.models import ModelSpec, get_model
from conveyor.sim.roofline import RooflineCostModel
from conveyor.sim.shape import StepShape, decode_shape, prefill_shape

# layers 2, hidden 8, 2 heads x 4, 1 KV head x 4, MLP 16, vocab 32, fp32
TOY = ModelSpec("toy", num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                intermediate_size=16, vocab_size=32, dtype="float32", tie_word_embeddings=False)
TOY_HW = HardwareSpec("toy-hw", {"float32": 1e6}, memory_bandwidth=1e4, memory_bytes=1e9,
                      interconnect_bandwidth=1e3, allreduce_latency_s=0.0, step_overhead_s=0.0)


def test_toy_model_counts() -> None:
    # per layer: q 8x8 + k,v 2 x 8x4 + o 8x8 + MLP 3 x 8x16 = 64 + 64 + 64 + 384 = 576
    assert TOY.layer_matmul_params == 576
    # layers x (576 + 2 norms x 8) + final norm 8 + embedding 256 + LM head 256
    assert TOY.num_params == 2 * 592 + 8 + 512
    assert TOY.weight_bytes == 4 * 1704
    assert TOY.kv_bytes_per_token == 2 * 2 * 1 * 4 * 4  # K and V, 2 layers, 1 head of 4, fp32
    # reads 8 + 8 + 8 + 16, writes (8 + 2x4) + 8 + 32 + 8
    assert TOY.layer_activation_elements == 40 + 64


def test_published_model_sizes() -> None:
    assert get_model("llama-3-8b").num_params == pytest.approx(8.03e9, rel=0.005)
    assert get_model("llama-2-13b").num_params == pytest.approx(13.02e9, rel=0.005)
    assert get_model("llama-3-70b").num_params == pytest.approx(70.6e9, rel=0.005)
    assert get_model("smollm2-135m").weight_bytes == 538_060_032  # `bench roofline --dequantize-weights`: fp32
    assert get_model("llama-3-8b").kv_bytes_per_token == 128 * 1024  # 32 layers x 8 heads x 128 x 2 x bf16


def test_decode_step_by_hand() -> None:
    cost = RooflineCostModel(TOY, TOY_HW).cost(decode_shape([10, 20]))
    # FLOPs: 2 tokens x 2 x (2 x 576) + 2 sampled x 2 x 256 + attention 4 x 2 layers x 8 x 30 pairs
    assert cost.compute_s == pytest.approx((4608 + 1024 + 1920) / 1e6)
    # bytes: weights 6816 + KV (30 read + 2 written) x 64 + activations 2 x 2 x 104 x 4 + samples 2 x 40 x 4
    assert cost.memory_s == pytest.approx((6816 + 32 * 64 + 1664 + 320) / 1e4)
    assert cost.allreduce_s == 0.0
    assert cost.total_s == pytest.approx(max(cost.compute_s, cost.memory_s))


def test_prefill_chunk_by_hand() -> None:
    shape = prefill_shape(4, cached=6, sampled=False)
    assert shape.prefill_attention == 4 * 6 + (1 + 2 + 3 + 4)  # each query sees the cache and itself causally
    cost = RooflineCostModel(TOY, TOY_HW).cost(shape)
    assert cost.compute_s == pytest.approx((4 * 2 * 1152 + 64 * 34) / 1e6)
    # no logits: the LM head is not read; KV 6 cached read + 4 written
    assert cost.memory_s == pytest.approx((6816 - 1024 + 10 * 64 + 4 * 2 * 104 * 4) / 1e4)


def test_tensor_parallel_divides_and_adds_two_allreduces_per_layer() -> None:
    shape = decode_shape([10, 20])
    one, two = RooflineCostModel(TOY, TOY_HW).cost(shape), RooflineCostModel(TOY, TOY_HW, tp=2).cost(shape)
    assert two.compute_s == pytest.approx(one.compute_s / 2)
    assert two.memory_s == pytest.approx(one.memory_s / 2)
    # 2 per layer x 2 layers, ring over 2 devices moves 2(2-1)/2 = 1 x the 2 tokens x 8 x 4 bytes
    assert two.allreduce_s == pytest.approx(4 * 64 / 1e3)


def test_h100_decode_knee_matches_the_seed_arithmetic() -> None:
    # Weights / bandwidth = 2 FLOP per param x batch / peak at b = peak x bytes_per_param / (2 x bandwidth) ~ 295.
    model = RooflineCostModel(get_model("llama-3-8b"), get_hardware("h100"))
    small = model.cost(decode_shape([1] * 64))
    large = model.cost(decode_shape([1] * 512))
    assert small.memory_s > small.compute_s and large.compute_s > large.memory_s
    assert model.cost(decode_shape([1])).total_s == pytest.approx(16.06e9 / 3.35e12 + 1e-3, rel=0.02)


def test_shape_of_a_scheduler_decision() -> None:
    params = SamplingParams(max_tokens=4)
    decoding = Request("a", list(range(12)), params, 0.0)
    decoding.output_token_ids = [1]
    decoding.num_computed_tokens = 12  # decodes its 13th token
    chunk = Request("b", list(range(100)), params, 0.0)
    chunk.num_computed_tokens = 40  # a 30-token chunk that does not finish the prompt
    last = Request("c", list(range(8)), params, 0.0)
    out = SchedulerOutput(scheduled=[(decoding, 1), (chunk, 30), (last, 8)])
    shape = StepShape.of(out)
    assert (shape.decode_tokens, shape.prefill_tokens, shape.prefill_chunks, shape.sampled) == (1, 38, 2, 2)
    assert (shape.decode_context, shape.max_decode_context, shape.prefill_cached) == (13, 13, 40)
    assert shape.prefill_attention == 30 * (40 + 15.5) + 8 * 4.5
    assert shape.cached_chunk_pairs == 30 * 70  # only the chunk that continues a cached prefix


def test_bad_descriptions_are_config_errors(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError):
        get_model("gpt-5")
    with pytest.raises(ConfigError):
        get_hardware("tpu-v9")
    with pytest.raises(ConfigError):
        get_hardware("this-machine", tmp_path / "missing.json")
    with pytest.raises(ConfigError):
        RooflineCostModel(TOY, get_hardware("h100"), tp=0)


# --- sliding-window layers --------------------------------------------------------------------------
TOY_WINDOW = ModelSpec("toy-window", num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                       intermediate_size=16, vocab_size=32, dtype="float32", sliding_window=4, num_window_layers=1)


@pytest.mark.parametrize("start, n", [(0, 1), (0, 4), (0, 9), (2, 1), (3, 1), (3, 2), (7, 5), (20, 3), (1, 30)])
@pytest.mark.parametrize("window", [None, 1, 4, 6])
def test_keys_in_window_counts_each_querys_keys(start: int, n: int, window: int | None) -> None:
    from conveyor.sim.shape import keys_in_window

    # The query at position p reads positions max(0, p - window + 1) .. p.
    want = sum(p + 1 if window is None else min(p + 1, window) for p in range(start, start + n))
    assert keys_in_window(start, n, window) == want


def test_published_gemma_3_27b() -> None:
    gemma = get_model("gemma-3-27b")
    assert gemma.num_params == pytest.approx(27.0e9, rel=0.01)
    assert (gemma.num_layers - gemma.num_window_layers, gemma.sliding_window) == (10, 1024)  # 1 global layer in 6
    assert gemma.window_kv_bytes_per_token == 52 * 2 * 16 * 128 * 2


def test_a_window_layers_attention_stops_at_its_window() -> None:
    model = RooflineCostModel(TOY_WINDOW, TOY_HW)
    whole = RooflineCostModel(TOY, TOY_HW)  # the same shapes, every layer sees the whole context
    # Within the window nothing differs.
    assert model.cost(decode_shape([3, 4], window=4)) == whole.cost(decode_shape([3, 4]))
    # At context 100 the window layer reads 4 keys: pairs (100 + 4) x 4 x 1 x 2 x 4, not 2 x 100 x ...
    near, far = model.cost(decode_shape([100], window=4)), whole.cost(decode_shape([100]))
    per_pair = 4 * 2 * 4 / 1e6  # a layer's QK^T and PV: 4 x heads x head_dim, over 1 MFLOP/s
    assert far.compute_s - near.compute_s == pytest.approx((100 - 4) * per_pair)
    per_token_layer = 2 * 1 * 4 * 4 / 1e4  # a layer's K and V of one token, over 10 kB/s
    assert far.memory_s - near.memory_s == pytest.approx((100 - 4) * per_token_layer)
    # A prefill chunk after 10 cached tokens: the window layer reads back 3 of them.
    chunk, whole_chunk = model.cost(prefill_shape(5, cached=10, window=4)), whole.cost(prefill_shape(5, cached=10))
    assert whole_chunk.memory_s - chunk.memory_s == pytest.approx((10 - 3) * per_token_layer)
    pairs = 5 * (10 + 3)  # each of the 5 queries: 15 .. 11 keys whole, 4 in the window
    assert whole_chunk.compute_s - chunk.compute_s == pytest.approx((pairs - 5 * 4) * per_pair)


def test_step_shape_of_a_scheduled_step_counts_the_window() -> None:
    decode = Request("d", list(range(19)), SamplingParams(), 0.0, output_token_ids=[19])  # decoding its output
    chunk = Request("p", list(range(30)), SamplingParams(), 0.0)
    decode.num_computed_tokens, chunk.num_computed_tokens = 19, 10
    out = SchedulerOutput(scheduled=[(decode, 1), (chunk, 8)])
    shape, whole = StepShape.of(out, window=4), StepShape.of(out)
    assert (shape.decode_context, shape.window_decode_context) == (20, 4)
    assert (shape.prefill_attention, shape.window_prefill_attention) == (8 * (10 + 4.5), 8 * 4)
    assert (shape.prefill_cached, shape.window_prefill_cached) == (10, 3)
    assert (whole.window_decode_context, whole.window_prefill_attention, whole.window_prefill_cached) == (20, 8 * 14.5, 10)
