"""Paged KV-cache accounting (pure Python, no torch). The scheduler owns the manager."""
from conveyor.errors import OutOfBlocksError
from conveyor.kv.block_pool import BlockPool
from conveyor.kv.keys import SequenceKey, iter_block_keys
from conveyor.kv.manager import (
    NULL_BLOCK,
    KVCacheManager,
    KVUsage,
    SlidingWindow,
    blocks_for,
    leading_null_blocks,
    split_kv_memory,
)

__all__ = ["NULL_BLOCK", "BlockPool", "KVCacheManager", "KVUsage", "OutOfBlocksError", "SequenceKey", "SlidingWindow",
           "blocks_for", "iter_block_keys", "leading_null_blocks",
           "split_kv_memory"]
