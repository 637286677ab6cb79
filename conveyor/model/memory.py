"""What the process holds, and what the machine has: the numbers a load is checked against before it
allocates, and glibc's allocator told to give freed weights back to the system."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
from pathlib import Path

# Allocations from this size up get their own mapping, returned to the system when freed. glibc
# otherwise raises the threshold as large blocks are freed, and a load that frees one tensor for
# every two it keeps (raw blocks, fused projections) leaves the freed ones stranded in its heap.
_OWN_MAPPING_FROM = 1 << 20
_M_MMAP_THRESHOLD = -3


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def keep_large_allocations_returnable() -> None:
    """Call before a load: large blocks freed while it runs go back to the system (glibc only)."""
    if (libc := _libc()) is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, _OWN_MAPPING_FROM)


def return_freed_memory() -> None:
    """Hands the heap's free pages back to the system (glibc's malloc_trim), after a load."""
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
