"""How many threads a step computes on: OpenMP's, which every C++ kernel shares (one libgomp in the
process), and numpy's BLAS (OpenBLAS, bundled with numpy's wheels), which the reference products
multiply on where a kernel is off or failed to build.

Both are set at run time, on the thread that then steps the model (libgomp keeps the count per
thread that starts parallel regions): OpenMP's through a kernel module's set_num_threads, OpenBLAS's
through its own exported setter, found among the libraries numpy loaded. (OPENBLAS_NUM_THREADS and
OMP_NUM_THREADS would have to be set before numpy loads, which a library cannot promise, and
threadpoolctl, which does the same lookup, is not a dependency.)"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

# OpenBLAS's setter, by the names its builds export (numpy's scipy-openblas with 64-bit ints, a
# plain OpenBLAS), most specific first.
_BLAS_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
                 "openblas_set_num_threads")
_BLAS_GETTERS = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads", "openblas_get_num_threads64_",
                 "openblas_get_num_threads")


@functools.cache
def _openblas() -> ctypes.CDLL | None:
    """The OpenBLAS numpy loaded (the first library mapped into the process whose name says openblas)."""
    import numpy  # noqa: F401 - loads its BLAS, whose path is then in the process's maps

    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    paths = dict.fromkeys(line.split()[-1] for line in maps if "openblas" in line.rsplit("/", 1)[-1].lower())
    for path in paths:
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        if any(hasattr(library, name) for name in _BLAS_SETTERS):
            return library
    return None


def set_blas_threads(n: int) -> bool:
    """numpy's BLAS on `n` threads; False where its setter is not found (another BLAS, not Linux)."""
    library = _openblas()
    setter = next((getattr(library, name) for name in _BLAS_SETTERS if hasattr(library, name)), None) \
        if library is not None else None
    if setter is None:
        return False
    setter.argtypes = [ctypes.c_int]
    setter(n)
    return True


def blas_threads() -> int | None:
    library = _openblas()
    getter = next((getattr(library, name) for name in _BLAS_GETTERS if hasattr(library, name)), None) \
        if library is not None else None
    return None if getter is None else int(getter())


def set_num_threads(n: int) -> None:
    """A step's threads: OpenMP's for the kernels (conveyor.model.kernels.set_num_threads: those
    loaded and those loaded later) and numpy's BLAS for the reference products."""
    from conveyor.model import kernels

    kernels.set_num_threads(n)
    if not set_blas_threads(n):
        logger.info("num_threads %d: numpy's BLAS setter was not found; its products keep their threads", n)


def get_num_threads() -> int:
    """The kernels' OpenMP thread count."""
    from conveyor.model import kernels

    return int(kernels.get_num_threads())


def physical_cores() -> int:
    """The physical cores this process may run on (torch's default thread count, which OpenMP's
    one per logical CPU doubles on a host with SMT: memory-bound kernels gain nothing from a core's
    second thread, and every barrier waits on it)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip()))
        except OSError:  # no sysfs topology (a container without it, another OS): count the CPU
            cores.add((str(cpu), ""))
    return max(1, len(cores))


def default_num_threads() -> int:
    """OMP_NUM_THREADS where set (OpenMP reads it itself), else one thread per physical core."""
    configured = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(configured) if configured.isdigit() and int(configured) > 0 else physical_cores()
