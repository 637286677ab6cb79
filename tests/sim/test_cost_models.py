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
