"""ModelRunner: the only stage that touches arrays. Owns the model, the KV arrays, the sampler."""
from __future__ import annotations

import functools
import logging
import math
import mmap
import time
from dataclasses import dataclass

import numpy as np

from conveyor.config import EngineConfig, SchedulerConfig, parse_memory
from conveyor.errors import ConfigError, ConveyorError, ModelLoadError
from conveyor.kv import NULL_BLOCK, SlidingWindow, split_kv_memory
from conveyor.model.config import ModelConfig
from conveyor.model.kernels import build_kernels
from conveyor.model.linear import bf16_tiles_available
from conveyor.model.llama import KVCache, LlamaModel, model_bytes
from conveyor.model.facts import ModelFacts
from conveyor.model.loader import checkpoint_bytes, describe_model, load_checkpoint, resolve_model_path
from conveyor.model.memory import (available_memory, keep_large_allocations_returnable, return_freed_memory,
                                   reuse_freed_memory, step_working_set_bytes)
from conveyor.model.ops import layer_ops
from conveyor.model.threads import default_num_threads, set_num_threads
from conveyor.model.tokenizer import Tokenizer, token_piece
from conveyor.request import Request
from conveyor.runner.inputs import build_inputs
from conveyor.runner.stats import StepStats
from conveyor.sampling.chain import InfillVocabulary
from conveyor.sampling.outputs import SamplerOutput, verify_rows
from conveyor.structured.masking import apply_token_masks
from conveyor.sampling.sampler import Sampler
from conveyor.structured.spec import TokenMasks
from conveyor.scheduler import SchedulerOutput

DTYPES = ("float32", "bfloat16")  # what a model's matrices are held in (EngineConfig.dtype)
logger = logging.getLogger(__name__)


def kv_cache_dtype(name: str, model_dtype: str = "float32") -> np.dtype:
    """EngineConfig.kv_cache_dtype as a numpy dtype ("auto": float16, as llama.cpp's default cache).
    A bfloat16 model's "auto" is float16 too: its activations, and so the keys and values written,
    are fp32 (conveyor.model.linear), and the attention kernels read float16 or float32."""
    del model_dtype  # the same for both: activations are fp32 whatever the weights are held in
    if name == "auto":
        return np.dtype(np.float16)
    return np.dtype({"float16": np.float16, "float32": np.float32}[name])


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: np.dtype, layers: int | None = None) -> int:
    """A block's bytes in `layers` layers (None: all of them)."""
    per_layer = cfg.kv_bytes_per_token // cfg.num_layers
    return block_size * per_layer * (cfg.num_layers if layers is None else layers) * dtype.itemsize


def fitted_max_model_len(max_model_len: int, given: bool, kv_tokens: int, sched: SchedulerConfig) -> int:
    """The longest request the engine takes: at most what the KV cache holds (one request alone may
    fill it), and without chunked prefill what one step computes (a prompt, or a request recomputed
    after preemption, is one step's). A max_model_len given above that is refused, as vLLM refuses
    it, rather than advertised and then refused in every long request; the model's own is lowered to
    it, and the log says so."""
    limits = [(kv_tokens, "the KV cache holds", "raise --kv-cache-memory (or --num-kv-blocks)")]
    if not sched.chunked_prefill:
        limits.append((sched.max_num_batched_tokens, "one step computes without chunked prefill",
                       "raise --max-num-batched-tokens or turn chunked prefill on"))
    for tokens, what, remedy in limits:
        if max_model_len <= tokens:
            continue
        if given:
            raise ConfigError(f"max_model_len {max_model_len} is more tokens than {what} ({tokens}): {remedy}, "
                              "or lower --max-model-len")
        logger.warning("max_model_len %d: the tokens %s (the model's context is %d; %s for more)", tokens, what,
                       max_model_len, remedy)
        max_model_len = tokens
    return max_model_len


def window_layers(cfg: ModelConfig) -> int:
    """How many layers have a sliding window."""
    return sum(1 for layer in range(cfg.num_layers) if cfg.window(layer) is not None)


def kv_pools(cfg: ModelConfig, config: EngineConfig, dtype: np.dtype) -> tuple[int, SlidingWindow | None]:
    """(blocks of the main pool, the sliding-window layers' pool or None). Sliding-window layers
    (Gemma 3's local ones) only ever read a request's last `window` tokens, so they get a pool of
    their own sized for what the running requests can see (split_kv_memory), and the rest of the
    KV memory goes to the main pool, whose blocks the other layers fill for the whole context."""
    bs, sliding = config.block_size, window_layers(cfg)
    if not config.window_kv_pool or not sliding or sliding == cfg.num_layers or cfg.sliding_window is None:
        blocks = config.num_kv_blocks or parse_memory(config.kv_cache_memory) // kv_block_bytes(cfg, bs, dtype)
        return blocks, None
    sched = config.scheduler
    return split_kv_memory(cfg.sliding_window, bs, sched.max_num_seqs, sched.max_num_batched_tokens,
                           kv_block_bytes(cfg, bs, dtype, cfg.num_layers - sliding), kv_block_bytes(cfg, bs, dtype, sliding),
                           parse_memory(config.kv_cache_memory), config.num_kv_blocks)


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: np.dtype | type,
                      window_blocks: int | None = None) -> list[KVCache]:
    """A layer's (keys, values); a sliding-window layer's has window_blocks blocks where given."""
    def blocks(layer: int) -> int:
        return window_blocks if window_blocks is not None and cfg.window(layer) is not None else num_blocks

    shapes = [(blocks(layer), block_size, cfg.num_kv_heads, cfg.head_dim) for layer in range(cfg.num_layers)]
    return [(zeros_mapped_on_use(shape, dtype), zeros_mapped_on_use(shape, dtype)) for shape in shapes]


def zeros_mapped_on_use(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """Zeros in an anonymous mapping of their own, whose pages the OS maps (zeroed) as they are first
    written: a KV pool then holds the memory of the blocks requests have used, not all of it from the
    start (a filled array writes every page), and a start does not wait for the whole pool to be
    zeroed. The memory check before a load still counts the whole pool; the OS charges it as it is
    written. Zeros, not empty: masked-out slots are multiplied by zero weights, and 0 * NaN is NaN."""
    dtype = np.dtype(dtype)
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes == 0:
        return np.zeros(shape, dtype=dtype)
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:  # where transparent huge pages are "always", one write would map 2 MiB: hundreds of blocks
        area.madvise(mmap.MADV_NOHUGEPAGE)
    except (AttributeError, OSError):  # no such advice here (another OS, or a kernel without THP)
        pass
    return np.frombuffer(area, dtype=dtype, count=count).reshape(shape)  # the array keeps the mapping


def infill_vocabulary(tokenizer: Tokenizer | None) -> InfillVocabulary | None:
    """The vocabulary facts a sampler chain's infill step reads (None without a tokenizer or EOS)."""
    if tokenizer is None or tokenizer.eos_token_id is None:
        return None
    return InfillVocabulary(frozenset(tokenizer.end_of_generation_ids), tokenizer.eos_token_id,
                            functools.partial(token_piece, tokenizer))


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: Tokenizer
    facts: ModelFacts | None = None  # what the file is (None: weights built in memory)


# What a serving process holds beyond its weights and KV pool: the server's libraries, the
# tokenizer, a step's activations and logits (measured: docs/PERF.md, "Memory").
RUNTIME_MARGIN_BYTES = 512 * 2**20


def check_fits(what: str, needed: int, hint: str) -> None:
    """Refuses, before allocating, `needed` bytes (plus the runtime margin) that the machine lacks."""
    available, source = available_memory()
    if needed + RUNTIME_MARGIN_BYTES > available:
        gib = 2**30
        raise ConfigError(
            f"{what} needs {needed / gib:.2f} GiB (+ {RUNTIME_MARGIN_BYTES / gib:.2f} GiB for the runtime), but only "
            f"{available / gib:.2f} GiB is available ({source}); {hint}")


def load_model(config: EngineConfig) -> LoadedModel:
    dtype, keep_blocks = config.dtype, not config.dequantize_weights
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    path = resolve_model_path(config.model)
    weight_bytes = checkpoint_bytes(path, dtype, keep_blocks)
    # The KV pool is allocated after the weights; where its size is given in bytes, both are checked now.
    kv_bytes = 0 if config.num_kv_blocks else parse_memory(config.kv_cache_memory)
    check_fits(f"{path.name}'s weights ({weight_bytes / 2**30:.2f} GiB) with a {kv_bytes / 2**30:.2f} GiB KV cache",
               weight_bytes + kv_bytes, "lower the KV cache with --kv-cache-memory, or serve a smaller model")
    keep_large_allocations_returnable()
    started = time.perf_counter()
    checkpoint = load_checkpoint(str(path), dtype, keep_blocks=keep_blocks)
    cfg = checkpoint.config
    if config.max_model_len and config.max_model_len > cfg.max_position_embeddings:
        raise ConfigError(
            f"max_model_len {config.max_model_len} exceeds the model's context length {cfg.max_position_embeddings}"
        )
    try:
        model = LlamaModel.from_weights(cfg, checkpoint.weights, dtype, consume=True)
    except ConveyorError:
        raise
    except (KeyError, ValueError) as e:  # a weight missing, or of a shape config.json does not give it
        detail = f"no weight {e.args[0]}" if isinstance(e, KeyError) else str(e)
        raise ModelLoadError(f"{path.name}: its weights do not match its config ({detail})") from e
    model.activation_dtype = config.activation_dtype
    return_freed_memory()
    mapped = model.embed.nbytes if model.embed.blocks is not None else 0
    logger.info("loaded %s in %.1f s: weights %.0f MiB%s", path.name, time.perf_counter() - started, model_bytes(model) / 2**20,
                f" ({mapped / 2**20:.0f} MiB of them the embedding's rows, read from the file as tokens are looked up)"
                if mapped else "")
    try:
        facts: ModelFacts | None = describe_model(path, cfg)
    except Exception as e:  # noqa: BLE001 - what the file is only describes it: serve it anyway
        logger.warning("%s: could not describe the file for model lists (%s)", path.name, e)
        facts = None
    return LoadedModel(model, checkpoint.tokenizer, facts)


class ModelRunner:
    supports_token_masks = True  # execute() applies structured-output masks
    supports_speculation = True  # execute() verifies requests' speculative tokens (SamplerOutput.num_accepted)
    supports_pooling = True  # execute() pools embedding requests' hidden states (SamplerOutput.pooled)

    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Tokenizer | None,
        num_kv_blocks: int,
        block_size: int,
        max_model_len: int,
        seed: int = 0,
        activation_dtype: str | None = None,
        kv_dtype: np.dtype | type | None = None,
        prompt_bf16_tiles: bool = False,
        kv_window: SlidingWindow | None = None,
    ) -> None:
        """`kv_dtype`: the KV cache's (float16 or float32; None: float32, the activations' own).
        `kv_window`: the sliding-window layers' own KV pool (kv_pools), None: theirs is the main pool."""
        self.model = model
        # Engines may share one loaded model (tests, benchmarks): each runs its own activation dtype,
        # set on the model at every step (None: the model's own).
        self.activation_dtype = activation_dtype or model.activation_dtype
        # EngineConfig.prompt_bf16_tiles, where the tiles run (set on the model at every step, as above)
        self.prompt_bf16_tiles = prompt_bf16_tiles and model.dtype == "float32" and bf16_tiles_available()
        self.model_config = model.cfg
        self.tokenizer = tokenizer
        self.model_facts: ModelFacts | None = None  # set by from_config, from the file loaded
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        # The freed memory steps keep for the next (from_config sets it); larger prompt logits are
        # handed back after their step. None: nothing is kept beyond glibc's defaults.
        self.keep_free_bytes: int | None = None
        self.kv_window = kv_window  # the engine's KV manager gives these layers tables of their own
        self.kv_caches = allocate_kv_cache(model.cfg, num_kv_blocks, block_size,
                                           np.float32 if kv_dtype is None else kv_dtype,
                                           kv_window.num_blocks if kv_window is not None else None)
        self._window_layers = frozenset(layer for layer in range(model.cfg.num_layers)
                                        if kv_window is not None and model.cfg.window(layer) is not None)
        self.sampler = Sampler(seed, tokenizer.eos_token_ids if tokenizer is not None else (),
                               argmax=layer_ops().argmax_rows, infill=infill_vocabulary(tokenizer))
        # build (or load) every C++ kernel the model runs now, not inside a request; activations are
        # fp32 whatever the weights are held in, so the fused ops and attention kernels are always run
        build_kernels(fp32=True)

    @property
    def prompt_rows_apart(self) -> bool:
        """Whether a prompt's tokens compute differently from generated ones here (bf16 tiles against
        int8): the prefix cache then keys a block holding generated tokens apart from the same tokens
        met as a prompt (conveyor/kv/keys.py), so a hit never changes a result."""
        return self.prompt_bf16_tiles and self.activation_dtype == "int8"

    @classmethod
    def from_config(cls, config: EngineConfig, loaded: "LoadedModel | None" = None) -> "ModelRunner":
        """Builds the runner; `loaded` lets several engines share one set of weights (tests, benchmarks)."""
        # the kernels' OpenMP threads and numpy's BLAS (model/threads.py)
        set_num_threads(config.num_threads or default_num_threads())
        loaded = loaded or load_model(config)
        cfg = loaded.model.cfg
        max_model_len = config.max_model_len or cfg.max_position_embeddings
        if max_model_len > loaded.model.max_positions:
            raise ConfigError(
                f"max_model_len {max_model_len} exceeds the model's context length {loaded.model.max_positions}"
            )
        kv_dtype = kv_cache_dtype(config.kv_cache_dtype, loaded.model.dtype)
        num_blocks, window = kv_pools(cfg, config, kv_dtype)
        if num_blocks < 1:
            raise ConfigError(f"kv_cache_memory {config.kv_cache_memory!r} holds less than one KV block")
        max_model_len = fitted_max_model_len(max_model_len, config.max_model_len is not None,
                                             num_blocks * config.block_size, config.scheduler)
        sliding = window_layers(cfg) if window is not None else 0
        main_bytes = num_blocks * kv_block_bytes(cfg, config.block_size, kv_dtype, cfg.num_layers - sliding)
        window_bytes = window.num_blocks * kv_block_bytes(cfg, config.block_size, kv_dtype, sliding) if window else 0
        check_fits(f"the KV cache ({num_blocks} blocks of {config.block_size} tokens)", main_bytes + window_bytes,
                   "lower it with --kv-cache-memory (or --num-kv-blocks)")
        logger.info("KV cache: %d blocks of %d tokens, %s, %.0f MiB%s", num_blocks, config.block_size,
                    kv_dtype.name, (main_bytes + window_bytes) / 2**20,
                    f" ({sliding} sliding-window layers of {cfg.sliding_window} tokens in a pool of their own: "
                    f"{window.num_blocks} blocks, {window_bytes / 2**20:.0f} MiB)" if window else "")
        runner = cls(loaded.model, loaded.tokenizer, num_blocks, config.block_size, max_model_len, config.seed,
                     config.activation_dtype, kv_dtype, config.prompt_bf16_tiles, window)
        runner.model_facts = loaded.facts
        if runner.prompt_rows_apart:
            logger.info("prompt tokens on AMX bf16 tiles, generated tokens on the int8 kernel (--no-prompt-bf16-tiles: "
                        "int8 for both)")
        # Twice the estimate: steps of the configured budget never hand their memory back.
        runner.keep_free_bytes = 2 * step_working_set_bytes(cfg, config.scheduler.max_num_batched_tokens,
                                                            config.scheduler.max_num_seqs)
        reuse_freed_memory(runner.keep_free_bytes)
        return runner

    def execute(self, out: SchedulerOutput, stats: StepStats, token_masks: TokenMasks | None = None) -> SamplerOutput:
        t0 = time.perf_counter()
        self._copy_blocks(out.block_copies, out.window_block_copies)
        inputs = build_inputs(out, self.block_size)
        self.model.activation_dtype = self.activation_dtype
        self.model.prompt_tiles = self.prompt_bf16_tiles
        t1 = time.perf_counter()
        h = self.model.sampling_hidden(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches,
                                       inputs.logits_indices)
        pooled = None
        if inputs.pooled_rows:  # the last rows: embeddings take no vocabulary projection
            pooled = self._pooled(h[h.shape[0] - inputs.num_pooled_rows:], inputs.pooled_rows)
            h = h[: h.shape[0] - inputs.num_pooled_rows]
            if not h.shape[0]:
                stats.prepare_s, stats.model_s, stats.sample_s = t1 - t0, time.perf_counter() - t1, 0.0
                return SamplerOutput([], pooled=pooled)
        num_sampling = inputs.num_sampling_rows
        requests = out.sampling_requests()
        speculating = num_sampling > len(requests)
        if (num_sampling and token_masks is None and not inputs.prompt_logprob_rows
                and Sampler.argmax_is_all(requests)):
            # Greedy tokens and nothing else: the argmax may skip most of the vocabulary projection.
            tokens = self.model.greedy_tokens(h)
            if tokens is not None:
                tokens = tokens.tolist()
                t2 = time.perf_counter()
                stats.prepare_s, stats.model_s, stats.sample_s = t1 - t0, t2 - t1, 0.0
                if not speculating:
                    return SamplerOutput(tokens, pooled=pooled)
                chosen, accepted = verify_rows(tokens, [r.spec_token_ids for r in requests])
                return SamplerOutput(chosen, num_accepted=accepted, pooled=pooled)
        # Rows that draw at a temperature take the head in the activation dtype; greedy rows and
        # prompt logprobs stay exact (LlamaModel.logits).
        row_requests = [r for r in requests for _ in range(1 + len(r.spec_token_ids))] if speculating else requests
        sampled_rows = np.array([not r.sampling_params.greedy for r in row_requests]
                                + [False] * (h.shape[0] - num_sampling), dtype=np.bool_)
        logits = self.model.logits(h, sampled_rows)
        t2 = time.perf_counter()
        masked_rows: list[int] = []
        if token_masks is not None:
            apply_token_masks(logits[:num_sampling], token_masks)
            masked_rows = token_masks.rows
        if speculating:
            sampled = self.sampler.verify(logits[:num_sampling], requests, masked_rows)
        else:
            sampled = self.sampler(logits[:num_sampling], requests, masked_rows) if num_sampling else SamplerOutput([])
        if inputs.prompt_logprob_rows:
            sampled.prompt_logprobs = self._prompt_logprobs(logits[num_sampling:], inputs.prompt_logprob_rows)
            if self.keep_free_bytes is not None and logits.nbytes > self.keep_free_bytes:
                # Logits of a long prompt, larger than what steps keep free: hand them back now
                # rather than hold them in the heap (model/memory.py, reuse_freed_memory).
                del logits
                return_freed_memory()
        sampled.pooled = pooled
        t3 = time.perf_counter()
        stats.prepare_s, stats.model_s, stats.sample_s = t1 - t0, t2 - t1, t3 - t2
        return sampled

    @staticmethod
    def _pooled(h: np.ndarray, rows: list[tuple[Request, int]]) -> dict[str, tuple[list[float], int]]:
        sums = {}
        at = 0
        for request, count in rows:
            sums[request.request_id] = (h[at: at + count].astype(np.float64).sum(axis=0).tolist(), count)
            at += count
        return sums

    def _prompt_logprobs(self, logits: np.ndarray, rows: list) -> dict[str, list[dict[int, float]]]:
        result, at = {}, 0
        for request, start, count in rows:
            targets = request.prompt_token_ids[start + 1 : start + 1 + count]
            top = request.sampling_params.prompt_logprobs
            result[request.request_id] = self.sampler.prompt_logprobs(logits[at : at + count], targets, top)
            at += count
        return result

    # LLMEngine re-runs a step that raised on parts of its batch; these make the retries draw the
    # same random numbers. Block copies and KV writes need nothing: a retry repeats them exactly.
    def save_rng_state(self, out: SchedulerOutput) -> object:
        return self.sampler.save_rng_state(out.sampling_requests())

    def restore_rng_state(self, state: object) -> None:
        self.sampler.restore_rng_state(state)  # type: ignore[arg-type]

    def _copy_blocks(self, copies: list[tuple[int, int]], window_copies: list[tuple[int, int]]) -> None:
        if not copies and not window_copies:
            return
        # (sources, destinations) of each pool, built once for all of its layers
        main, window = ((np.array([s for s, _ in pairs], dtype=np.int64), np.array([d for _, d in pairs], dtype=np.int64))
                        for pairs in (copies, window_copies))
        for layer, (k_cache, v_cache) in enumerate(self.kv_caches):
            src, dst = window if layer in self._window_layers else main
            if len(src):
                k_cache[dst] = k_cache[src]
                v_cache[dst] = v_cache[src]

    # KV handover: a request's blocks leave one runner and enter another, never the whole pool.
    def kv_layer_groups(self) -> tuple[list[int], list[int]]:
        """(layers whose KV is in the main pool, sliding-window layers with a pool of their own)."""
        layers = range(len(self.kv_caches))
        return ([layer for layer in layers if layer not in self._window_layers],
                [layer for layer in layers if layer in self._window_layers])

    def read_kv_layers(self, layers: list[int], block_ids: list[int]) -> np.ndarray:
        """[len(layers), 2 (k, v), len(block_ids), block_size, kv_heads, head_dim], a copy: those
        layers' blocks, each layer's from its own pool (kv_layer_groups)."""
        index = np.array(block_ids, dtype=np.int64)
        if not layers:
            shape = self.kv_caches[0][0].shape[1:] if self.kv_caches else ()
            return np.empty((0, 2, len(block_ids), *shape), dtype=self.kv_caches[0][0].dtype if self.kv_caches else np.float32)
        return np.stack([np.stack((self.kv_caches[layer][0][index], self.kv_caches[layer][1][index]))
                         for layer in layers])

    def write_kv_layers(self, layers: list[int], block_ids: list[int], data: np.ndarray) -> None:
        """What read_kv_layers gave, into these blocks of those layers' pools; a sliding-window
        layer writes none of NULL_BLOCK's (out of sight)."""
        index = np.array(block_ids, dtype=np.int64)
        for row, layer in enumerate(layers):
            k_cache, v_cache = self.kv_caches[layer]
            rows = np.arange(len(block_ids))
            if layer in self._window_layers:
                rows = rows[index != NULL_BLOCK]
            k_cache[index[rows]] = data[row, 0, rows].astype(k_cache.dtype, copy=False)
            v_cache[index[rows]] = data[row, 1, rows].astype(v_cache.dtype, copy=False)
