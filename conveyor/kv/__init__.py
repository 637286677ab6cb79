"""Paged KV-cache accounting (pure Python, no torch). The scheduler owns the manager."""
from conveyor.errors import OutOfBlocksError
from conveyor.kv.block_pool import BlockPool
from conveyor.kv.keys import SequenceKey, iter_block_keys
from conveyor.kv.manager import KVCacheManager, KVUsage, blocks_for

__all__ = ["BlockPool", "KVCacheManager", "KVUsage", "OutOfBlocksError", "SequenceKey", "blocks_for",
           "iter_block_keys"]
