"""Roofline cost model: a step takes max(FLOPs / peak FLOP/s, bytes / bandwidth) + all-reduce + overhead.

FLOPs: 2 per matmul parameter per token, the LM head only on sampled rows, and attention's
QK^T and PV (4 x heads x head_dim per query-key pair per layer). Bytes: every weight once per
step (the LM head only when something is sampled), each row's KV read at its context length,
new KV written, and activations (each matmul reads its input and writes its output once). A
sliding-window layer's pairs and KV reads stop at its window (StepShape's window_ fields).
Tensor parallelism over `tp` devices divides FLOPs and bytes by tp and adds two ring all-reduces
of the hidden states per layer (after attention and after the MLP), not overlapped with compute.
"""
from __future__ import annotations

from dataclasses import dataclass

from conveyor.errors import ConfigError
from conveyor.sim.hardware import HardwareSpec
from conveyor.sim.models import ModelSpec
from conveyor.sim.shape import StepShape


@dataclass(frozen=True)
class StepCost:
    compute_s: float
    memory_s: float
    allreduce_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.allreduce_s + self.overhead_s


class RooflineCostModel:
    name = "roofline"

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, tp: int = 1) -> None:
        if tp < 1:
            raise ConfigError(f"tensor parallel size must be positive, got {tp}")
        if model.num_heads % tp:
            raise ConfigError(f"tensor parallel size {tp} does not divide {model.name}'s {model.num_heads} attention heads")
        if tp > 1 and hardware.interconnect_bandwidth <= 0:
            raise ConfigError(f"hardware {hardware.name!r} has no interconnect for tensor parallelism")
        self.model, self.hardware, self.tp = model, hardware, tp
        m, b = model, model.dtype_bytes
        flops, bandwidth = hardware.flops(m.dtype) * tp, hardware.bandwidth * tp  # tp devices share the work
        self._s_per_token_flop = 2 * m.num_layers * m.layer_matmul_params / flops
        self._s_per_sample_flop = 2 * m.lm_head_params / flops
        self._s_per_pair = 4 * m.num_layers * m.num_heads * m.head_dim / flops
        lm_head_bytes = m.lm_head_params * b
        self._s_body_weights = (m.weight_bytes - lm_head_bytes) / bandwidth
        self._s_lm_head = lm_head_bytes / bandwidth
        self._s_per_kv_token = m.kv_bytes_per_token / bandwidth
        self._s_per_window_kv_token = m.window_kv_bytes_per_token / bandwidth
        self._window_share = m.window_layer_share
        self._s_per_token_act = m.num_layers * m.layer_activation_elements * b / bandwidth
        self._s_per_sample_act = (m.hidden_size + m.vocab_size) * b / bandwidth
        if tp > 1:  # ring all-reduce moves 2(tp-1)/tp of the message over each link
            per_token = 2 * (tp - 1) / tp * m.hidden_size * b / hardware.interconnect_bandwidth
            self._s_allreduce_per_token = 2 * m.num_layers * per_token
            self._s_allreduce_fixed = 2 * m.num_layers * hardware.allreduce_latency_s
        else:
            self._s_allreduce_per_token = self._s_allreduce_fixed = 0.0

    def cost(self, s: StepShape) -> StepCost:
        tokens = s.prefill_tokens + s.decode_tokens
        share = self._window_share
        pairs = ((1.0 - share) * (s.prefill_attention + s.decode_context)
                 + share * (s.window_prefill_attention + s.window_decode_context))
        compute = tokens * self._s_per_token_flop + s.sampled * self._s_per_sample_flop + pairs * self._s_per_pair
        read_back = s.decode_context + s.prefill_cached  # every layer's KV, the window layers' too
        window_read_back = s.window_decode_context + s.window_prefill_cached
        kv_s = ((read_back + tokens) * self._s_per_kv_token  # read back, plus the new KV written
                - (read_back - window_read_back) * self._s_per_window_kv_token)
        memory = (self._s_body_weights + (self._s_lm_head if s.sampled else 0.0) + kv_s
                  + tokens * self._s_per_token_act + s.sampled * self._s_per_sample_act)
        allreduce = tokens * self._s_allreduce_per_token + self._s_allreduce_fixed if tokens else 0.0
        return StepCost(compute, memory, allreduce, self.hardware.step_overhead_s)

    def step_time(self, s: StepShape) -> float:
        return self.cost(s).total_s

    def describe(self) -> str:
        m, h = self.model, self.hardware
        return (f"roofline: {m.name} ({m.num_params / 1e9:.2f}B params, {m.dtype}) on {self.tp} x {h.name} "
                f"({h.flops(m.dtype) / 1e12:.3g} TFLOP/s, {h.bandwidth / 1e9:.3g} GB/s each)")
