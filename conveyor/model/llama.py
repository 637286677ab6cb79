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
from conveyor.model.linear import (Embedding, Linear, Matmul, PackedWeight, PromptRows, WeightSource, matmul_path,
                                   screen_norms, screened_argmax)
from conveyor.model import memory
from conveyor.model.memory import return_freed_memory
from conveyor.model.ops import LayerOps, layer_ops
from conveyor.model.rope import inverse_frequencies, rope_at

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
        ops: LayerOps, matmul: Matmul, mlp_parts: list[tuple[int, int, Matmul]],
        decode_kernel: PagedDecodeKernel | None, prefill_kernel: PagedPrefillKernel | None = None,
    ) -> torch.Tensor:
        """Updates the residual stream x in place and returns it. `ops`, `matmul` and the attention
        kernels are resolved once per forward pass (the env switches are not read per op);
        `mlp_parts`: the MLP's runs of rows [start, end) with their products (mlp_row_parts)."""
        # Each temporary is dropped as soon as it is used: at a prefill's rows they are megabytes
        # each, and the heap a step peaks at is what the process keeps (model/memory.py).
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        qk_norm = None if self.q_norm is None or self.k_norm is None else (self.q_norm, self.k_norm, eps)
        qkv = self.qkv.forward(ops.rms_norm(x, self.input_norm, eps), matmul)
        q, k, v = ops.rope_and_cache(qkv, cos, sin, kv[0], kv[1], meta.slot_mapping, cfg.num_heads,
                                     cfg.num_kv_heads, qk_norm)
        del qkv
        attn = attend(q, k, v, kv[0], kv[1], meta, self.scale, decode_kernel, self.window, prefill_kernel)
        del q, k, v
        attn_out = self.o_proj.forward(attn.view(x.shape[0], -1), matmul)
        del attn
        if self.attn_out_norm is not None:
            attn_out = ops.rms_norm(attn_out, self.attn_out_norm, eps)
        h = ops.add_rms_norm_(x, attn_out, self.post_attention_norm, eps)
        del attn_out
        for start, end, part_matmul in mlp_parts:
            whole = end - start == x.shape[0]  # a decode step's one run: no views to make
            gate_up = self.gate_up.forward(h if whole else h[start:end], part_matmul)
            act = ops.silu_and_mul(gate_up) if cfg.hidden_act == "silu" else ops.gelu_tanh_and_mul(gate_up)
            del gate_up
            mlp_out = self.down.forward(act, part_matmul)
            del act
            if self.mlp_out_norm is not None:
                mlp_out = ops.rms_norm(mlp_out, self.mlp_out_norm, eps)
            (x if whole else x[start:end]).add_(mlp_out)
            del mlp_out
        return x


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.dtype = torch.float32
        # "int8" or "float32": the activations products on GGUF blocks (and 16-bit float weights) take
        # (conveyor.model.linear)
        self.activation_dtype = "float32"
        # True: with int8 activations, a step's prompt rows (AttentionMetadata.prompt_rows) take the
        # bf16 tile kernel; the runner sets it only where that kernel runs (linear.bf16_tiles_available)
        self.prompt_tiles = False
        self.max_positions = max_positions or cfg.max_position_embeddings
        # The head's column norms where greedy's screened argmax needs them (linear.screen_norms).
        self.head_norms: torch.Tensor | None = None
        self._build_rope()

    def _build_rope(self) -> None:
        # Plain fp32 tensors, not buffers: they must stay fp32 through .to(bf16).
        cfg = self.cfg
        self.rope_inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        # Gemma's sliding-window layers rotate with their own base (and no scaling).
        self.rope_local_inv_freq: torch.Tensor | None = None
        if cfg.rope_local_theta is not None and any(layer.window is not None for layer in self.layers):
            self.rope_local_inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_local_theta, None)

    @classmethod
    def from_weights(
        cls, cfg: ModelConfig, weights: dict[str, WeightSource], dtype: torch.dtype, max_positions: int | None = None,
        consume: bool = False,
    ) -> "LlamaModel":
        """`weights`: HF names -> dense tensors, raw blocks or packed blocks (conveyor.model.linear):
        each is held once, in the form that serves it. `consume`: the caller hands the dict over and
        each weight leaves it as it is taken, so no weight is held twice (unfused and fused) while
        the model is built."""
        # The projections and the embedding hold nothing until loaded: only norms and biases are
        # made here, overwritten below.
        model = cls(cfg, max_positions).to(dtype)
        model.dtype = dtype
        model.load_weights(weights if consume else dict(weights))
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
        x = self.embed(input_ids).to(self.dtype)
        if self.cfg.scale_embeddings:  # the scale rounded to the weights' dtype first, as HF's Gemma does
            x = x * torch.tensor(self.cfg.hidden_size**0.5).to(x.dtype)
        cos, sin = (t.to(x.dtype) for t in rope_at(self.rope_inv_freq, positions))
        local = None if self.rope_local_inv_freq is None else tuple(
            t.to(x.dtype) for t in rope_at(self.rope_local_inv_freq, positions))
        prompt_rows = PromptRows.of(meta.prompt_rows, x.shape[0]) if self.prompt_tiles else None
        ops, matmul = layer_ops(x.dtype), matmul_path(self.activation_dtype, prompt_rows)
        decode_kernel = paged_decode_kernel() if x.dtype == torch.float32 else None
        prefill_kernel = paged_prefill_kernel() if x.dtype == torch.float32 and meta.prefills else None
        mlp_parts = mlp_row_parts(x.shape[0], matmul, self.activation_dtype, prompt_rows)
        for layer, kv in zip(self.layers, kv_caches):
            layer_cos, layer_sin = local if local is not None and layer.window is not None else (cos, sin)
            # A sliding-window layer's KV may live in a pool of its own (the runner's kv_window).
            layer_meta = meta.window_group if layer.window is not None and meta.window_group is not None else meta
            x = layer.forward(x, layer_cos, layer_sin, kv, layer_meta, ops, matmul, mlp_parts, decode_kernel,
                              prefill_kernel)
        # Only the last token of each sampling request needs the (large) vocabulary projection.
        return ops.rms_norm(x[logits_indices], self.norm, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def logits(self, h: torch.Tensor, sampled: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits of h's rows. The rows `sampled` marks (a bool a row: its request draws its
        token at a temperature) take the head's product in activation_dtype, as every other layer
        does (int8 by default: on a head in blocks about half the time of fp32 activations, and the
        head is the largest product of a small model's step). The others take fp32 activations
        whatever activation_dtype says: screened_argmax (greedy_tokens) is the exact fp32 argmax, so
        a greedy request gets the same token whether its batch samples or not, and prompt logprobs
        score the model exactly. Each product is row by row, so a row's logits do not depend on the
        rows beside it."""
        head = self.head
        exact = matmul_path("float32")
        if sampled is None or self.activation_dtype == "float32" or not bool(sampled.any()):
            logits = exact(h, head.weight, head.packed, None).float()
        elif bool(sampled.all()):
            logits = matmul_path(self.activation_dtype)(h, head.weight, head.packed, None).float()
        else:
            fast = matmul_path(self.activation_dtype)(h[sampled], head.weight, head.packed, None).float()
            logits = torch.empty(h.shape[0], fast.shape[1], dtype=torch.float32)
            logits[sampled] = fast
            logits[~sampled] = exact(h[~sampled], head.weight, head.packed, None).float()
        if (cap := self.cfg.final_logit_softcapping) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.inference_mode()
    def greedy_tokens(self, h: torch.Tensor) -> torch.Tensor | None:
        """argmax(self.logits(h), -1) without the full vocabulary projection where the head's
        blocks allow it (conveyor.model.linear.screened_argmax), else None. A logit cap is monotone
        but can round distinct logits to one value, which moves a tie's first index: not there."""
        if self.cfg.final_logit_softcapping is not None:
            return None
        return screened_argmax(h, self.head.packed, self.head_norms)

    @property
    def head(self) -> Linear | Embedding:
        """What the vocabulary projection multiplies by: the embedding's own weight when tied."""
        return self.embed if self.lm_head is None else self.lm_head

    def load_weights(self, weights: dict[str, WeightSource]) -> None:
        """Takes HF-named weights (see from_weights), emptying `weights`; fuses q/k/v and gate/up as
        this module stores them."""
        own = dict(self.named_parameters())
        modules = dict(self.named_modules())
        dtype = self.dtype

        def take(name: str) -> WeightSource:
            return weights.pop(name)

        def dense(name: str) -> torch.Tensor:
            w = take(name)
            if not isinstance(w, torch.Tensor):
                raise ValueError(f"{name} must be a dense tensor")
            return w

        def put_linear(linear: str, names: list[str]) -> None:
            parts = [take(n) for n in names]
            modules[linear].load(fuse(parts) if len(parts) > 1 else parts[0], dtype)

        def put(name: str, tensor: torch.Tensor) -> None:
            own[name].data = tensor.to(own[name].dtype).contiguous()

        def put_norm(name: str, tensor: torch.Tensor) -> None:
            # Gemma's norms scale by 1 + weight: added once here, in fp32 as HF's Gemma3RMSNorm does.
            offset = self.cfg.norm_weight_offset
            put(name, tensor.float() + offset if offset else tensor)

        self.embed.load(take("model.embed_tokens.weight"), dtype, rows_only=self.lm_head is not None)
        put_norm("norm", dense("model.norm.weight"))
        if self.lm_head is not None:
            self.lm_head.load(take("lm_head.weight"), dtype)
        self.head_norms = screen_norms(self.head.packed)
        for i in range(self.cfg.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            attn = src + "self_attn."
            put_linear(dst + "qkv", [f"{attn}{p}_proj.weight" for p in "qkv"])
            if self.cfg.attention_bias:
                put(dst + "qkv.bias", torch.cat([dense(f"{attn}{p}_proj.bias") for p in "qkv"]))
            put_linear(dst + "o_proj", [attn + "o_proj.weight"])
            mlp = src + "mlp."
            put_linear(dst + "gate_up", [mlp + "gate_proj.weight", mlp + "up_proj.weight"])
            put_linear(dst + "down", [mlp + "down_proj.weight"])
            # The fused projections' parts were freed beside the layers still to come, and below
            # glibc's mapping threshold they stay in the heap until trimmed: a load would peak a few
            # layers' parts above what the model then holds.
            return_freed_memory()
            put_norm(dst + "input_norm", dense(src + "input_layernorm.weight"))
            if self.cfg.sandwich_norms:  # HF's post_attention_layernorm is then the attention output's norm
                put_norm(dst + "attn_out_norm", dense(src + "post_attention_layernorm.weight"))
                put_norm(dst + "post_attention_norm", dense(src + "pre_feedforward_layernorm.weight"))
                put_norm(dst + "mlp_out_norm", dense(src + "post_feedforward_layernorm.weight"))
            else:
                put_norm(dst + "post_attention_norm", dense(src + "post_attention_layernorm.weight"))
            if self.cfg.qk_norm:
                put_norm(dst + "q_norm", dense(attn + "q_norm.weight"))
                put_norm(dst + "k_norm", dense(attn + "k_norm.weight"))


def mlp_row_parts(num_rows: int, matmul: Matmul, activation_dtype: str,
                  prompt_rows: PromptRows | None) -> list[tuple[int, int, Matmul]]:
    """A step's rows in runs of at most memory.MLP_ROWS, each with its product (`matmul` where one
    run takes them all). Every MLP op is row-local, and on conveyor's kernels (blocks, fp32 panels,
    int8 activations, 16-bit weights times bf16 activations, the bf16 tiles a prompt row takes in
    any run) a row's product does not depend
    on the rows beside it (linear.INT8_FROM_ROWS), so a run's rows get the bits they would in one
    product of all. torch's own products (F.linear, oneDNN: the kernels off, --dtype bfloat16) may
    split their work by the row count, as they do under chunked prefill."""
    run = memory.MLP_ROWS
    if num_rows <= run:
        return [(0, num_rows, matmul)]
    return [(start, min(start + run, num_rows),
             matmul_path(activation_dtype, None if prompt_rows is None
                         else prompt_rows.within(start, min(start + run, num_rows))))
            for start in range(0, num_rows, run)]


def fuse(parts: list[WeightSource]) -> WeightSource:
    """Row-wise concatenation of a fused projection's weights (q/k/v, gate/up): packed blocks join
    as packed (conveyor.model.linear.PackedWeight.cat); where any part is dense, all are made dense."""
    packed = [p for p in parts if isinstance(p, PackedWeight)]
    if len(packed) == len(parts):
        return PackedWeight.cat(packed)

    def dense(p: WeightSource) -> torch.Tensor:
        if isinstance(p, PackedWeight):
            return p.rows(torch.arange(p.out_features))
        return p if isinstance(p, torch.Tensor) else p.dequantize()
    tensors = [dense(p) for p in parts]
    return torch.cat([t.to(tensors[0].dtype) for t in tensors])


def model_bytes(model: nn.Module) -> int:
    """What the model's weights hold: packed weights, plain tensors and parameters, each once."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, Embedding):
            total += module.nbytes
        elif isinstance(module, Linear):
            total += module.packed.nbytes if module.packed is not None else 0
            total += module.weight.numel() * module.weight.element_size() if module.weight is not None else 0
    return total
