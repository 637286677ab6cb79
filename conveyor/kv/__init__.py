"""Paged KV-cache accounting (pure Python, no torch)."""
from conveyor.errors import OutOfBlocksError
from conveyor.kv.block_pool import BlockPool
from conveyor.kv.manager import KVCacheManager, KVUsage, blocks_for, iter_block_keys

__all__ = ["BlockPool", "KVCacheManager", "KVUsage", "OutOfBlocksError", "blocks_for", "iter_block_keys"]
