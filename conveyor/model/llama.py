"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Gemma 3) over one flat batch of tokens.

The batch mixes prefill chunks of some requests with single decode tokens of others; the model
knows nothing of requests, only of tokens, positions and the attention metadata the runner built.
Q/K/V and gate/up are fused into one matmul each: fewer, larger kernels per layer. Gemma 3 is this
decoder with the switches of ModelConfig on (see conveyor.model.config).
"""
from __future__ import annotations

import torch
from torch import nn

from conveyor.model.attention import AttentionMetadata, attend
from conveyor.model.config import ModelConfig
from conveyor.model.kernels import PagedDecodeKernel, PagedPrefillKernel, paged_decode_kernel, paged_prefill_kernel
from conveyor.model.linear import Linear, Matmul, PackedWeight, matmul_path, pack_weight, screened_argmax
from conveyor.model.ops import LayerOps, layer_ops
from conveyor.model.quantized import QuantizedWeight
from conveyor.model.rope import rope_tables

KVCache = tuple[torch.Tensor, torch.Tensor]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.window = cfg.window(index)  # None: full attention
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=False)
        self.gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.input_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.post_attention_norm = nn.Parameter(torch.ones(cfg.hidden_size))  # before the MLP
        self.q_norm = nn.Parameter(torch.ones(cfg.head_dim)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(cfg.head_dim)) if cfg.qk_norm else None
        # Gemma: on the attention's and the MLP's outputs, before each joins the residual.
        self.attn_out_norm = nn.Parameter(torch.ones(cfg.hidden_size)) if cfg.sandwich_norms else None
        self.mlp_out_norm = nn.Parameter(torch.ones(cfg.hidden_size)) if cfg.sandwich_norms else None
        self.scale = cfg.attention_scale
        if cfg.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported activation {cfg.hidden_act!r}")

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache, meta: AttentionMetadata,
        ops: LayerOps, matmul: Matmul, decode_kernel: PagedDecodeKernel | None,
        prefill_kernel: PagedPrefillKernel | None = None,
    ) -> torch.Tensor:
        """Updates the residual stream x in place and returns it. `ops`, `matmul` and the attention
        kernels are resolved once per forward pass (the env switches are not read per op)."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        qk_norm = None if self.q_norm is None or self.k_norm is None else (self.q_norm, self.k_norm, eps)
        qkv = self.qkv.forward(ops.rms_norm(x, self.input_norm, eps), matmul)
        q, k, v = ops.rope_and_cache(qkv, cos, sin, kv[0], kv[1], meta.slot_mapping, cfg.num_heads,
                                     cfg.num_kv_heads, qk_norm)
        attn = attend(q, k, v, kv[0], kv[1], meta, self.scale, decode_kernel, self.window, prefill_kernel)
        attn_out = self.o_proj.forward(attn.view(x.shape[0], -1), matmul)
        if self.attn_out_norm is not None:
            attn_out = ops.rms_norm(attn_out, self.attn_out_norm, eps)
        h = ops.add_rms_norm_(x, attn_out, self.post_attention_norm, eps)
        gate_up = self.gate_up.forward(h, matmul)
        act = ops.silu_and_mul(gate_up) if cfg.hidden_act == "silu" else ops.gelu_tanh_and_mul(gate_up)
        mlp_out = self.down.forward(act, matmul)
        if self.mlp_out_norm is not None:
            mlp_out = ops.rms_norm(mlp_out, self.mlp_out_norm, eps)
        return x.add_(mlp_out)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.head_packed: PackedWeight | None = None
        self.head_quantized: QuantizedWeight | None = None
        self._head_finite = False
        self.max_positions = max_positions or cfg.max_position_embeddings
        self._build_rope()

    def _build_rope(self) -> None:
        # Plain fp32 tensors, not buffers: they must survive meta-device construction and .to(bf16).
        cfg = self.cfg
        self.rope_cos, self.rope_sin = rope_tables(
            cfg.head_dim, self.max_positions, cfg.rope_theta, cfg.rope_scaling, torch.float32
        )
        # Gemma's sliding-window layers rotate with their own base (and no scaling).
        self.rope_local: tuple[torch.Tensor, torch.Tensor] | None = None
        if cfg.rope_local_theta is not None and any(layer.window is not None for layer in self.layers):
            self.rope_local = rope_tables(cfg.head_dim, self.max_positions, cfg.rope_local_theta, None, torch.float32)

    @classmethod
    def from_weights(
        cls, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, max_positions: int | None = None,
        quantized: dict[str, QuantizedWeight] | None = None,
    ) -> "LlamaModel":
        """`quantized`: HF names -> the checkpoint's blocks, which the matmuls then stream."""
        # Build on the meta device so no time goes into random init of weights we overwrite.
        with torch.device("meta"):
            model = cls(cfg, max_positions)
        model = model.to_empty(device="cpu").to(dtype)
        model._build_rope()
        model.load_weights(weights, quantized)
        model.pack_weights()
        return model.eval()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Returns fp32 logits [len(logits_indices), vocab] for the rows that sample a token."""
        return self.logits(self.sampling_hidden(input_ids, positions, meta, kv_caches, logits_indices))

    @torch.inference_mode()
    def sampling_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """The final-normed hidden states of the rows that sample a token: what the vocabulary
        projection takes."""
        x = self.embed(input_ids)
        if self.cfg.scale_embeddings:  # the scale rounded to the weights' dtype first, as HF's Gemma does
            x = x * torch.tensor(self.cfg.hidden_size**0.5).to(x.dtype)
        cos = self.rope_cos[positions].to(x.dtype)
        sin = self.rope_sin[positions].to(x.dtype)
        local = None if self.rope_local is None else tuple(t[positions].to(x.dtype) for t in self.rope_local)
        ops, matmul = layer_ops(x.dtype), matmul_path()
        decode_kernel = paged_decode_kernel() if x.dtype == torch.float32 else None
        prefill_kernel = paged_prefill_kernel() if x.dtype == torch.float32 and meta.prefills else None
        for layer, kv in zip(self.layers, kv_caches):
            layer_cos, layer_sin = local if local is not None and layer.window is not None else (cos, sin)
            x = layer.forward(x, layer_cos, layer_sin, kv, meta, ops, matmul, decode_kernel, prefill_kernel)
        # Only the last token of each sampling request needs the (large) vocabulary projection.
        return ops.rms_norm(x[logits_indices], self.norm, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = matmul_path()(h, self.head_weight, self.head_packed, None).float()
        if (cap := self.cfg.final_logit_softcapping) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.inference_mode()
    def greedy_tokens(self, h: torch.Tensor) -> torch.Tensor | None:
        """argmax(self.logits(h), -1) without the full vocabulary projection where the head's
        blocks allow it (conveyor.model.linear.screened_argmax), else None. A logit cap is monotone
        but can round distinct logits to one value, which moves a tie's first index: not there."""
        if self.cfg.final_logit_softcapping is not None or not self._head_finite:
            return None
        return screened_argmax(h, self.head_packed)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def pack_weights(self) -> None:
        """Lays every projection out for the fast fp32 matmul (see conveyor.model.linear); call
        after the weights are final."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        self.head_packed = pack_weight(self.head_weight, self.head_quantized)
        # The screened argmax's bound needs finite weights (inf or NaN logits take the full product).
        self._head_finite = bool(torch.isfinite(self.head_weight).all())

    def load_weights(self, weights: dict[str, torch.Tensor], quantized: dict[str, QuantizedWeight] | None = None) -> None:
        """Takes HF-named tensors; fuses q/k/v and gate/up as this module stores them. `quantized`
        blocks are fused alike and kept for pack_weights."""
        own = dict(self.named_parameters())
        blocks = quantized or {}
        modules = dict(self.named_modules())

        def put_blocks(linear: str, names: list[str]) -> None:
            modules[linear].quantized = QuantizedWeight.cat([blocks.get(n) for n in names])

        def put(name: str, tensor: torch.Tensor) -> None:
            own[name].data = tensor.to(own[name].dtype).contiguous()

        def put_norm(name: str, tensor: torch.Tensor) -> None:
            # Gemma's norms scale by 1 + weight: added once here, in fp32 as HF's Gemma3RMSNorm does.
            offset = self.cfg.norm_weight_offset
            put(name, tensor.float() + offset if offset else tensor)

        put("embed.weight", weights["model.embed_tokens.weight"])
        put_norm("norm", weights["model.norm.weight"])
        if self.lm_head is not None:
            put("lm_head.weight", weights["lm_head.weight"])
        self.head_quantized = blocks.get("model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight")
        for i in range(self.cfg.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            attn = src + "self_attn."
            put(dst + "qkv.weight", torch.cat([weights[f"{attn}{p}_proj.weight"] for p in "qkv"]))
            put_blocks(dst + "qkv", [f"{attn}{p}_proj.weight" for p in "qkv"])
            if self.cfg.attention_bias:
                put(dst + "qkv.bias", torch.cat([weights[f"{attn}{p}_proj.bias"] for p in "qkv"]))
            put(dst + "o_proj.weight", weights[attn + "o_proj.weight"])
            put_blocks(dst + "o_proj", [attn + "o_proj.weight"])
            mlp = src + "mlp."
            put(dst + "gate_up.weight", torch.cat([weights[mlp + "gate_proj.weight"], weights[mlp + "up_proj.weight"]]))
            put_blocks(dst + "gate_up", [mlp + "gate_proj.weight", mlp + "up_proj.weight"])
            put(dst + "down.weight", weights[mlp + "down_proj.weight"])
            put_blocks(dst + "down", [mlp + "down_proj.weight"])
            put_norm(dst + "input_norm", weights[src + "input_layernorm.weight"])
            if self.cfg.sandwich_norms:  # HF's post_attention_layernorm is then the attention output's norm
                put_norm(dst + "attn_out_norm", weights[src + "post_attention_layernorm.weight"])
                put_norm(dst + "post_attention_norm", weights[src + "pre_feedforward_layernorm.weight"])
                put_norm(dst + "mlp_out_norm", weights[src + "post_feedforward_layernorm.weight"])
            else:
                put_norm(dst + "post_attention_norm", weights[src + "post_attention_layernorm.weight"])
            if self.cfg.qk_norm:
                put_norm(dst + "q_norm", weights[attn + "q_norm.weight"])
                put_norm(dst + "k_norm", weights[attn + "k_norm.weight"])
