"""How the KV memory is split between the main pool and the sliding-window layers' own pool, and
how the pool's arrays hold memory."""
from __future__ import annotations

import gc
import mmap
from pathlib import Path

import numpy as np

from conveyor.config import EngineConfig
from conveyor.kv import blocks_for
from conveyor.model.config import ModelConfig
from conveyor.runner.model_runner import allocate_kv_cache, kv_block_bytes, kv_pools

# Gemma 3 270M's attention: 18 layers, 3 of them global, one KV head of 256, a 512-token window.
GEMMA = ModelConfig(vocab_size=1000, hidden_size=640, intermediate_size=2048, num_layers=18, num_heads=4,
                    num_kv_heads=1, head_dim=256, sliding_window=512,
                    layer_types=tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(18)))
F16 = np.dtype(np.float16)


def test_without_a_window_pool_every_layer_shares_one() -> None:
    config = EngineConfig(kv_cache_memory="1GiB", window_kv_pool=False)
    blocks, window = kv_pools(GEMMA, config, F16)
    assert window is None and blocks == 2**30 // kv_block_bytes(GEMMA, 16, F16)


def test_the_window_pool_holds_what_every_running_request_can_see() -> None:
    config = EngineConfig.from_kwargs(kv_cache_memory="1GiB", max_num_seqs=64, max_num_batched_tokens=2048)
    blocks, window = kv_pools(GEMMA, config, F16)
    assert window is not None and window.tokens == 512
    # 64 windows with the block being written and the one before, two steps' budget, an import's window
    in_sight = 64 * (blocks_for(512, 16) + 2) + 2 * blocks_for(2048, 16) + blocks_for(512, 16)
    assert window.num_blocks == in_sight + 1  # and its NULL_BLOCK
    full, sliding = kv_block_bytes(GEMMA, 16, F16, 3), kv_block_bytes(GEMMA, 16, F16, 15)
    used = blocks * full + window.num_blocks * sliding
    assert 2**30 - full < used <= 2**30, "the rest of the memory goes to the main pool"
    # The same gigabyte holds 2.6x the context it holds when every layer keeps the whole of it.
    assert blocks / (2**30 // kv_block_bytes(GEMMA, 16, F16)) > 2.5


def test_a_pool_given_in_blocks_keeps_its_context_and_saves_the_rest() -> None:
    """4 requests of 8,192 tokens (footprint.py's way of giving a context capacity): the main pool
    has its 2,048 blocks, the window pool only what 4 requests see and one step computes."""
    config = EngineConfig.from_kwargs(num_kv_blocks=2048, max_num_seqs=4, max_num_batched_tokens=512)
    blocks, window = kv_pools(GEMMA, config, F16)
    assert blocks == 2048 and window is not None and window.num_blocks == 4 * 34 + 2 * 32 + 32 + 1
    small = EngineConfig.from_kwargs(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=512)
    _, small_window = kv_pools(GEMMA, small, F16)
    assert small_window is not None and small_window.num_blocks == 64 + 1  # never more than the main pool


def test_tiny_memory_splits_evenly() -> None:
    config = EngineConfig.from_kwargs(kv_cache_memory=64 * 2**20, max_num_seqs=64)
    blocks, window = kv_pools(GEMMA, config, F16)
    assert window is not None and window.num_blocks == blocks + 1
    assert blocks * kv_block_bytes(GEMMA, 16, F16) + kv_block_bytes(GEMMA, 16, F16, 15) <= 64 * 2**20
    blocks, window = kv_pools(GEMMA, EngineConfig.from_kwargs(kv_cache_memory=2**10), F16)
    assert blocks < 1 and window is None, "the caller refuses a pool without a block"


def test_max_model_len_is_at_most_what_the_pool_and_an_unchunked_step_hold() -> None:
    import pytest

    from conveyor.config import SchedulerConfig
    from conveyor.errors import ConfigError
    from conveyor.runner.model_runner import fitted_max_model_len

    chunked, unchunked = SchedulerConfig(), SchedulerConfig(chunked_prefill=False, max_num_batched_tokens=512)
    assert fitted_max_model_len(8192, False, 1024, chunked) == 1024  # the model's context, lowered
    assert fitted_max_model_len(8192, False, 100_000, chunked) == 8192
    assert fitted_max_model_len(8192, False, 100_000, unchunked) == 512
    assert fitted_max_model_len(1024, True, 1024, chunked) == 1024
    with pytest.raises(ConfigError, match="KV cache holds"):
        fitted_max_model_len(2048, True, 1024, chunked)
    with pytest.raises(ConfigError, match="without chunked prefill"):
        fitted_max_model_len(1024, True, 100_000, unchunked)



def _resident_within(ranges: list[tuple[int, int]]) -> int:
    """Resident bytes of the mappings that overlap any of these address ranges (/proc/self/smaps)."""
    total, overlapping = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            overlapping = any(lo < end and start < hi for start, end in ranges)
        elif overlapping and head == "Rss:":
            total += int(line.split()[1]) * 1024
    return total


def test_a_pool_holds_the_memory_of_the_blocks_written_not_all_of_it() -> None:
    """The pool's pages are mapped as blocks are first written: a quarter-gigabyte pool holds nothing
    until used, reads as zeros, and a written block maps its own page(s), not its neighbours'."""
    cfg = ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=64)
    block_bytes = 16 * 2 * 64 * 2  # a layer's keys (or values) of one block: 16 tokens x 2 heads x 64 x fp16
    blocks = 256 * 2**20 // (2 * cfg.num_layers * block_bytes)
    caches = allocate_kv_cache(cfg, blocks, 16, F16)
    tensors = [t for kv in caches for t in kv]
    ranges = [(t.ctypes.data, t.ctypes.data + t.nbytes) for t in tensors]
    assert sum(end - start for start, end in ranges) == blocks * 2 * cfg.num_layers * block_bytes
    assert _resident_within(ranges) == 0, "allocating the pool wrote its pages"
    assert all(int(np.count_nonzero(t)) == 0 for t in tensors)
    assert _resident_within(ranges) == 0, "reading the pool mapped memory"
    written = list(range(3, blocks, 61))
    for k, v in caches:
        k[written] = 1.0
        v[written] = -1.0
    pages_per_tensor = len({b * block_bytes // mmap.PAGESIZE for b in written} |
                           {((b + 1) * block_bytes - 1) // mmap.PAGESIZE for b in written})
    written_bytes = len(tensors) * pages_per_tensor * mmap.PAGESIZE
    assert _resident_within(ranges) == written_bytes
    k, v = caches[0]
    assert float(k[3].sum(dtype=np.float64)) == k[3].size and float(v[64].sum(dtype=np.float64)) == -v[64].size
    assert float(np.abs(k[4]).sum()) == 0.0
    del caches, tensors, k, v
    gc.collect()
    # Unmapped: the addresses hold nothing now, or whatever mapping reused a part of them since.
    assert _resident_within(ranges) < written_bytes, "a freed pool gave its pages back"
