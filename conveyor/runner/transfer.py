"""What a runner offers for a KV handover (prefill/decode disaggregation): a request's blocks read
out of its KV cache and written into another's, and the request's own sampler state (a seeded
request takes its draws along). ModelRunner provides it; the simulator's runner moves no data."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from conveyor.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np

    from conveyor.sampling.sampler import Sampler


@runtime_checkable
class KVTransferRunner(Protocol):
    sampler: Sampler

    def kv_layer_groups(self) -> tuple[list[int], list[int]]:
        """(layers whose KV is in the main pool, sliding-window layers with a pool of their own)."""
        ...

    def read_kv_layers(self, layers: list[int], block_ids: list[int]) -> np.ndarray:
        """[len(layers), 2 (k, v), len(block_ids), block_size, kv_heads, head_dim], a copy; each
        layer's blocks from its own pool."""
        ...

    def write_kv_layers(self, layers: list[int], block_ids: list[int], data: np.ndarray) -> None: ...


def kv_transfer(runner: object) -> KVTransferRunner:
    """The runner as a KV-transfer runner; ConfigError if it cannot move KV blocks."""
    if not isinstance(runner, KVTransferRunner):
        raise ConfigError(f"{type(runner).__name__} cannot export or import KV blocks")
    return runner
