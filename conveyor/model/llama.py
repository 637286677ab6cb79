"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Gemma 3) over one flat batch of tokens.

The batch mixes prefill chunks of some requests with single decode tokens of others; the model
knows nothing of requests, only of tokens, positions and the attention metadata the runner built.
Q/K/V and gate/up are fused into one matmul each: fewer, larger kernels per layer. Gemma 3 is this
decoder with the switches of ModelConfig on (see conveyor.model.config).

Plain classes over numpy arrays: the weights as conveyor.model.linear holds them, norms and biases
fp32, activations fp32 whatever dtype the weights are served in, the KV cache float16 or float32.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from conveyor.model.attention import AttentionMetadata, attend
from conveyor.model.config import ModelConfig
from conveyor.model.kernels import PagedDecodeKernel, PagedPrefillKernel, paged_decode_kernel, paged_prefill_kernel
from conveyor.model.linear import (WEIGHT_DTYPES, Embedding, Linear, Matmul, PackedWeight, PromptRows, WeightSource,
                                   matmul_path, screen_norms, screened_argmax)
from conveyor.model import memory
from conveyor.model.memory import return_freed_memory
from conveyor.model.ops import LayerOps, layer_ops
from conveyor.model.rope import inverse_frequencies, rope_at

KVCache = tuple[np.ndarray, np.ndarray]


def _ones(n: int) -> np.ndarray:
    return np.ones(n, dtype=np.float32)


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        self.cfg = cfg
        self.window = cfg.window(index)  # None: full attention
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=False)
        self.gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.input_norm = _ones(cfg.hidden_size)
        self.post_attention_norm = _ones(cfg.hidden_size)  # before the MLP
        self.q_norm = _ones(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = _ones(cfg.head_dim) if cfg.qk_norm else None
        # Gemma: on the attention's and the MLP's outputs, before each joins the residual.
        self.attn_out_norm = _ones(cfg.hidden_size) if cfg.sandwich_norms else None
        self.mlp_out_norm = _ones(cfg.hidden_size) if cfg.sandwich_norms else None
        self.scale = cfg.attention_scale
        if cfg.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported activation {cfg.hidden_act!r}")

    def linears(self) -> tuple[Linear, ...]:
        return self.qkv, self.o_proj, self.gate_up, self.down

    def vectors(self) -> list[np.ndarray]:
        """The layer's norms and biases."""
        held = [self.input_norm, self.post_attention_norm, self.q_norm, self.k_norm, self.attn_out_norm,
                self.mlp_out_norm, self.qkv.bias]
        return [v for v in held if v is not None]

    def forward(
        self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, kv: KVCache, runs: list[RowRun], ops: LayerOps,
        decode_kernel: PagedDecodeKernel | None, prefill_kernel: PagedPrefillKernel | None = None,
    ) -> np.ndarray:
        """Updates the residual stream x in place and returns it, one run of rows after another
        (row_runs): a run's keys and values are in the cache before the next run's queries read them.
        `ops` and the attention kernels are resolved once per forward pass (the env switches are not
        read per op)."""
        for run in runs:
            whole = run.end - run.start == x.shape[0]  # a decode step's one run: no views to make
            rows = slice(run.start, run.end)
            # A sliding-window layer's KV may live in a pool of its own (the runner's kv_window).
            meta = run.meta.window_group if self.window is not None and run.meta.window_group is not None else run.meta
            self._forward_rows(x if whole else x[rows], cos if whole else cos[rows], sin if whole else sin[rows], kv,
                               meta, ops, run.matmul, decode_kernel, prefill_kernel)
        return x

    def _forward_rows(
        self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, kv: KVCache, meta: AttentionMetadata, ops: LayerOps,
        matmul: Matmul, decode_kernel: PagedDecodeKernel | None, prefill_kernel: PagedPrefillKernel | None,
    ) -> None:
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
        attn_out = self.o_proj.forward(attn.reshape(x.shape[0], -1), matmul)
        del attn
        if self.attn_out_norm is not None:
            attn_out = ops.rms_norm(attn_out, self.attn_out_norm, eps)
        h = ops.add_rms_norm_(x, attn_out, self.post_attention_norm, eps)
        del attn_out
        gate_up = self.gate_up.forward(h, matmul)
        del h
        act = ops.silu_and_mul(gate_up) if cfg.hidden_act == "silu" else ops.gelu_tanh_and_mul(gate_up)
        del gate_up
        mlp_out = self.down.forward(act, matmul)
        del act
        if self.mlp_out_norm is not None:
            mlp_out = ops.rms_norm(mlp_out, self.mlp_out_norm, eps)
        x += mlp_out

    __call__ = forward


class LlamaModel:
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg, i) for i in range(cfg.num_layers)]
        self.norm = _ones(cfg.hidden_size)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # What the matrices are held in ("float32" or "bfloat16": conveyor.model.linear.held_once);
        # activations, norms and biases are fp32 either way.
        self.dtype = "float32"
        # "int8" or "float32": the activations products on GGUF blocks (and 16-bit float weights) take
        # (conveyor.model.linear)
        self.activation_dtype = "float32"
        # True: with int8 activations, a step's prompt rows (AttentionMetadata.prompt_rows) take the
        # bf16 tile kernel; the runner sets it only where that kernel runs (linear.bf16_tiles_available)
        self.prompt_tiles = False
        self.max_positions = max_positions or cfg.max_position_embeddings
        # The head's column norms where greedy's screened argmax needs them (linear.screen_norms).
        self.head_norms: np.ndarray | None = None
        self._build_rope()

    def _build_rope(self) -> None:
        cfg = self.cfg
        self.rope_inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        # Gemma's sliding-window layers rotate with their own base (and no scaling).
        self.rope_local_inv_freq: np.ndarray | None = None
        if cfg.rope_local_theta is not None and any(layer.window is not None for layer in self.layers):
            self.rope_local_inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_local_theta, None)

    @classmethod
    def from_weights(
        cls, cfg: ModelConfig, weights: dict[str, WeightSource], dtype: str = "float32", max_positions: int | None = None,
        consume: bool = False,
    ) -> "LlamaModel":
        """`weights`: HF names -> dense arrays, raw blocks or packed blocks (conveyor.model.linear):
        each is held once, in the form that serves it. `dtype` ("float32" or "bfloat16"): what
        matrices not kept in the file's own form are held in. `consume`: the caller hands the dict
        over and each weight leaves it as it is taken, so no weight is held twice (unfused and
        fused) while the model is built."""
        if dtype not in WEIGHT_DTYPES:
            raise ValueError(f"a model's weights are held in one of {WEIGHT_DTYPES}, not {dtype!r}")
        # The projections and the embedding hold nothing until loaded: only norms and biases are
        # made here, overwritten below.
        model = cls(cfg, max_positions)
        model.dtype = dtype
        model.load_weights(weights if consume else dict(weights))
        return model

    def modules(self) -> Iterator[Linear | Embedding]:
        """Every projection and the embedding, each once (a tied head is the embedding)."""
        yield self.embed
        for layer in self.layers:
            yield from layer.linears()
        if self.lm_head is not None:
            yield self.lm_head

    def vectors(self) -> list[np.ndarray]:
        """Every norm and bias."""
        return [self.norm, *(v for layer in self.layers for v in layer.vectors())]

    def forward(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        logits_indices: np.ndarray,
    ) -> np.ndarray:
        """Returns fp32 logits [len(logits_indices), vocab] for the rows that sample a token."""
        return self.logits(self.sampling_hidden(input_ids, positions, meta, kv_caches, logits_indices))

    __call__ = forward

    def sampling_hidden(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        logits_indices: np.ndarray,
    ) -> np.ndarray:
        """The final-normed hidden states (fp32) of the rows that sample a token: what the vocabulary
        projection takes."""
        x = self.embed(input_ids)
        if self.cfg.scale_embeddings:  # HF's Gemma scales by sqrt(hidden) in the activations' dtype: fp32
            x = x.astype(np.float32, copy=False)  # the embedding's rows: this step's own array
            x *= np.float32(self.cfg.hidden_size**0.5)
        cos, sin = rope_at(self.rope_inv_freq, positions)
        local = None if self.rope_local_inv_freq is None else rope_at(self.rope_local_inv_freq, positions)
        ops = layer_ops()
        decode_kernel = paged_decode_kernel()
        prefill_kernel = paged_prefill_kernel() if meta.prefills else None
        runs = row_runs(x.shape[0], meta, self.activation_dtype, self.prompt_tiles)
        for layer, kv in zip(self.layers, kv_caches):
            layer_cos, layer_sin = local if local is not None and layer.window is not None else (cos, sin)
            x = layer.forward(x, layer_cos, layer_sin, kv, runs, ops, decode_kernel, prefill_kernel)
        # Only the last token of each sampling request needs the (large) vocabulary projection.
        rows = np.ascontiguousarray(x[np.asarray(logits_indices, dtype=np.int64)])
        if rows.shape[0] == 0:  # no row samples (a chunk mid-prompt): numpy's empty arrays have no row stride to pass
            return np.empty((0, self.cfg.hidden_size), dtype=np.float32)
        return ops.rms_norm(rows, self.norm, self.cfg.rms_norm_eps)

    def logits(self, h: np.ndarray, sampled: np.ndarray | None = None) -> np.ndarray:
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
            logits = exact(h, head.weight, head.packed, None)
        elif bool(sampled.all()):
            logits = matmul_path(self.activation_dtype)(h, head.weight, head.packed, None)
        else:
            fast = matmul_path(self.activation_dtype)(np.ascontiguousarray(h[sampled]), head.weight, head.packed, None)
            logits = np.empty((h.shape[0], fast.shape[1]), dtype=np.float32)
            logits[sampled] = fast
            logits[~sampled] = exact(np.ascontiguousarray(h[~sampled]), head.weight, head.packed, None)
        logits = logits.astype(np.float32, copy=False)
        if (cap := self.cfg.final_logit_softcapping) is not None:
            logits = np.tanh(logits / np.float32(cap)) * np.float32(cap)
        return logits

    def greedy_tokens(self, h: np.ndarray) -> np.ndarray | None:
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
        this model stores them."""
        dtype = self.dtype

        def take(name: str) -> WeightSource:
            return weights.pop(name)

        def dense(name: str) -> np.ndarray:
            w = take(name)
            if not isinstance(w, np.ndarray):
                raise ValueError(f"{name} must be a dense array")
            return w

        def vector(name: str, like: np.ndarray, offset: float = 0.0) -> np.ndarray:
            w = np.asarray(dense(name), dtype=np.float32)
            if w.shape != like.shape:
                raise ValueError(f"{name} of shape {w.shape} where {like.shape} is expected")
            # Gemma's norms scale by 1 + weight: added once here, in fp32 as HF's Gemma3RMSNorm does.
            return np.ascontiguousarray(w + np.float32(offset) if offset else w)

        def put_linear(linear: Linear, names: list[str]) -> None:
            parts = [take(n) for n in names]
            linear.load(fuse(parts) if len(parts) > 1 else parts[0], dtype)

        offset = self.cfg.norm_weight_offset
        self.embed.load(take("model.embed_tokens.weight"), dtype, rows_only=self.lm_head is not None)
        self.norm = vector("model.norm.weight", self.norm, offset)
        if self.lm_head is not None:
            self.lm_head.load(take("lm_head.weight"), dtype)
        self.head_norms = screen_norms(self.head.packed)
        for i, layer in enumerate(self.layers):
            src = f"model.layers.{i}."
            attn = src + "self_attn."
            put_linear(layer.qkv, [f"{attn}{p}_proj.weight" for p in "qkv"])
            if self.cfg.attention_bias:
                assert layer.qkv.bias is not None
                bias = np.concatenate([np.asarray(dense(f"{attn}{p}_proj.bias"), dtype=np.float32) for p in "qkv"])
                if bias.shape != layer.qkv.bias.shape:
                    raise ValueError(f"q/k/v biases of {bias.shape[0]} values for a {layer.qkv.out_features}-wide projection")
                layer.qkv.bias = bias
            put_linear(layer.o_proj, [attn + "o_proj.weight"])
            mlp = src + "mlp."
            put_linear(layer.gate_up, [mlp + "gate_proj.weight", mlp + "up_proj.weight"])
            put_linear(layer.down, [mlp + "down_proj.weight"])
            # The fused projections' parts were freed beside the layers still to come, and below
            # glibc's mapping threshold they stay in the heap until trimmed: a load would peak a few
            # layers' parts above what the model then holds.
            return_freed_memory()
            layer.input_norm = vector(src + "input_layernorm.weight", layer.input_norm, offset)
            if self.cfg.sandwich_norms:  # HF's post_attention_layernorm is then the attention output's norm
                assert layer.attn_out_norm is not None and layer.mlp_out_norm is not None
                layer.attn_out_norm = vector(src + "post_attention_layernorm.weight", layer.attn_out_norm, offset)
                layer.post_attention_norm = vector(src + "pre_feedforward_layernorm.weight", layer.post_attention_norm,
                                                   offset)
                layer.mlp_out_norm = vector(src + "post_feedforward_layernorm.weight", layer.mlp_out_norm, offset)
            else:
                layer.post_attention_norm = vector(src + "post_attention_layernorm.weight", layer.post_attention_norm,
                                                   offset)
            if self.cfg.qk_norm:
                assert layer.q_norm is not None and layer.k_norm is not None
                layer.q_norm = vector(attn + "q_norm.weight", layer.q_norm, offset)
                layer.k_norm = vector(attn + "k_norm.weight", layer.k_norm, offset)


@dataclass(frozen=True)
class RowRun:
    """Rows [start, end) of a step that each layer computes together, with their attention metadata
    (numbered from `start`) and their products (the prompt rows among them their own)."""

    start: int
    end: int
    meta: AttentionMetadata
    matmul: Matmul


def row_runs(num_rows: int, meta: AttentionMetadata, activation_dtype: str, prompt_tiles: bool) -> list[RowRun]:
    """A step's rows in runs of at most memory.LAYER_ROWS, in order: a layer computes one run whole
    (projections, attention, MLP) before the next, so its temporaries are held for that many rows
    at most, not for all of a full-budget prefill's. Every op but attention is row-local, and on
    conveyor's kernels (blocks, fp32 panels, int8 activations, 16-bit weights times bf16
    activations, the bf16 tiles a prompt row takes in any run) a row's product does not depend on
    the rows beside it (linear.INT8_FROM_ROWS). A prefill chunk cut between runs reads its earlier
    rows' keys back from the cache, as a chunked prefill does, and the prefill kernel gives each
    query the same bits wherever its chunk starts (its steps of keys start on fixed multiples). So a
    run's rows get the bits they would in one run of all. numpy's own products (the reference path:
    the kernels off or not built) may split their work by the row count, as under chunked prefill.
    The decode rows (the step's first, single-query rows, a speculative verification's among them)
    stay together in the first run, however many: the paged decode kernel cuts a request's context
    into slices when it has few rows a thread, so a decode row's sums depend on how many decode rows
    share its call, and a cut there would change them; a step of decode rows only is one run, its
    weights streamed once.
    `prompt_tiles`: the step's prompt rows take the bf16 tile kernel (LlamaModel.prompt_tiles)."""
    step = memory.LAYER_ROWS
    starts = [0, *range(max(meta.num_decode_tokens, step), num_rows, step)]
    runs = []
    for start, end in zip(starts, [*starts[1:], num_rows]):
        part = meta.rows(start, end)
        prompt_rows = PromptRows.of(part.prompt_rows, end - start) if prompt_tiles else None
        runs.append(RowRun(start, end, part, matmul_path(activation_dtype, prompt_rows)))
    return runs


def fuse(parts: list[WeightSource]) -> WeightSource:
    """Row-wise concatenation of a fused projection's weights (q/k/v, gate/up): packed blocks join
    as packed (conveyor.model.linear.PackedWeight.cat); where any part is dense, all are made dense
    (fp32)."""
    packed = [p for p in parts if isinstance(p, PackedWeight)]
    if len(packed) == len(parts):
        return PackedWeight.cat(packed)

    def dense(p: WeightSource) -> np.ndarray:
        if isinstance(p, PackedWeight):
            return p.rows(np.arange(p.out_features))
        return np.asarray(p, dtype=np.float32) if isinstance(p, np.ndarray) else p.dequantize()
    return np.concatenate([dense(p) for p in parts])


def model_bytes(model: LlamaModel) -> int:
    """What the model's weights hold: packed weights, plain arrays, norms and biases, each once."""
    total = sum(int(v.nbytes) for v in model.vectors())
    for module in model.modules():
        if isinstance(module, Embedding):
            total += module.nbytes
        else:
            total += module.nbytes - (int(module.bias.nbytes) if module.bias is not None else 0)
    return total
