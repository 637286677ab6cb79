"""What the process holds, and what the machine has: the numbers a load is checked against before it
allocates, and glibc's allocator told to give freed weights back to the system while a model loads,
then to keep a step's freed activations for the next step once it serves."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
from pathlib import Path

from conveyor.model.config import ModelConfig

# Allocations from this size up get their own mapping, returned to the system when freed. glibc
# otherwise raises the threshold as large blocks are freed, and a load that frees one tensor for
# every two it keeps (raw blocks, fused projections) leaves the freed ones stranded in its heap.
_OWN_MAPPING_FROM = 1 << 20
# mallopt's parameters and glibc's defaults for the two a load puts back.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -3, -4, -8
_DEFAULT_TRIM_THRESHOLD, _DEFAULT_MMAP_MAX = 128 * 1024, 65536

# A step's layers compute at most this many rows at a time (LlamaModel's row_runs): a layer's
# temporaries (normed input, q/k/v, attention output, the MLP's gate/up and activation) are then
# held for these rows, not for all of a full-budget prefill's 2,048, and steps keep only that much
# (reuse_freed_memory); only the residual stream and the rotary tables span the step. llama.cpp's
# server computes micro-batches of 512 tokens likewise. Runs of 256 rows prefill as fast as runs of
# 512 and faster than one run of all rows (docs/PERF.md, "A layer's rows in runs"). A step's decode
# rows (a speculative verification's too) are never cut apart: a step of them alone is one run, its
# weights streamed once.
LAYER_ROWS = 256

_kept_free_bytes = 0  # the largest reuse_freed_memory asked for in this process


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def no_huge_pages_from_numpy() -> None:
    """numpy advises transparent huge pages on its arrays of 4 MiB and up (where the kernel's THP
    setting is "madvise"): the heap's blocks would then be faulted in, kept and handed back 2 MiB at
    a time, and a block partly written counted whole. Turned off, so the allocator policy here works
    in the pages it was measured in (docs/PERF.md, "Memory"), as it did under torch's allocator."""
    try:
        from numpy._core.multiarray import _set_madvise_hugepage  # type: ignore[attr-defined]
    except ImportError:  # a numpy without the switch
        return
    _set_madvise_hugepage(False)


def keep_large_allocations_returnable() -> None:
    """Call before a load: large blocks freed while it runs go back to the system (glibc only)."""
    no_huge_pages_from_numpy()
    if (libc := _libc()) is not None:
        libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
        libc.mallopt(_M_MMAP_THRESHOLD, _OWN_MAPPING_FROM)


def reuse_freed_memory(keep_bytes: int) -> None:
    """Call once a model is loaded and its KV pool allocated: from then on every allocation comes
    from the heap, and up to `keep_bytes` of freed heap stay there for the next step (glibc only).

    A step's activations are megabytes each (a 2,048-token prefill's MLP output alone is 80 MB on
    a 0.5B model). Given their own mappings, as during a load, every step mapped them again and
    the kernel faulted in and zeroed each page anew, which a prefill then waited for (docs/PERF.md,
    "Steps keep their memory"). Kept, the process holds its largest step's working set, which
    it needs at that step's peak anyway. A rarer, larger block stays too unless it lies at the
    heap's top: the runner hands prompt logits larger than `keep_bytes` back (return_freed_memory)
    after their step. Only the largest `keep_bytes` asked for in the process counts, so
    a draft model's runner does not shrink its target's."""
    global _kept_free_bytes
    _kept_free_bytes = max(_kept_free_bytes, keep_bytes)
    if (libc := _libc()) is not None:
        libc.mallopt(_M_MMAP_MAX, 0)
        libc.mallopt(_M_TRIM_THRESHOLD, min(_kept_free_bytes, 2**31 - 1))


def step_working_set_bytes(cfg: ModelConfig, rows: int, sampled_rows: int) -> int:
    """About what a step of `rows` tokens holds at once in fp32: the residual stream and the rotary
    tables (cos and sin, twice where sliding-window layers rotate with a base of their own) of all of
    them; for up to LAYER_ROWS of them a layer's normed input, q/k/v, attention output and its sum, the
    MLP's gate/up and their product (and that product as the down projection's kernel takes it: int8
    codes, or bf16 pairs for 16-bit weights); and the logits and probabilities of the rows it
    samples."""
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_run_row = 4 * (2 * cfg.hidden_size + 2 * q_dim + 2 * kv_dim) + 4 * 3 * cfg.intermediate_size \
        + 2 * cfg.intermediate_size
    rope_tables = 2 if cfg.rope_local_theta is not None and cfg.sliding_window is not None else 1
    per_row = 4 * cfg.hidden_size + rope_tables * 2 * 4 * cfg.head_dim
    return rows * per_row + min(rows, LAYER_ROWS) * per_run_row + 2 * 4 * sampled_rows * cfg.vocab_size


def share_one_heap() -> None:
    """Every thread allocates from the process's main heap, which keeps what reuse_freed_memory
    keeps (glibc only). A thread of its own (the server's engine thread) would allocate from an
    arena of 64 MiB heaps, which glibc unmaps whenever one falls empty, and the page faults came
    back (docs/PERF.md, "Steps keep their memory"). It holds only for threads that have not
    allocated yet and only while no other thread has an arena of its own, so `import conveyor`
    calls it before anything else; the other threads (the event loop, OpenMP's) allocate little."""
    if (libc := _libc()) is not None:
        libc.mallopt(_M_ARENA_MAX, 1)


def return_freed_memory() -> None:
    """Hands the heap's free pages back to the system (glibc's malloc_trim): after each layer of a
    load (LlamaModel.load_weights), after the load, and after a step that freed more than steps keep
    (ModelRunner.execute's prompt logits)."""
    if (libc := _libc()) is not None:
        libc.malloc_trim(0)


def available_memory() -> tuple[int, str]:
    """Bytes this process may still take, and where the figure comes from: MemAvailable, or the
    cgroup's limit less its usage where that is lower."""
    available, source = _meminfo_available(), "MemAvailable in /proc/meminfo"
    limit = _cgroup_room()
    if limit is not None and limit < available:
        available, source = limit, "the cgroup's memory limit less its usage"
    return available, source


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # not Linux: nothing to check against


def _cgroup_room() -> int | None:
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 1 << 60:
            return None
        return max(0, int(limit) - usage)
    return None


def resident_bytes() -> int:
    """This process's resident set (VmRSS)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
