"""Checkpoint files read through a private memory map, each tensor's pages dropped once it is taken
(packed a run of rows at a time, converted, or left as a view): a load then holds at most one
tensor's (a packed matrix: one run's) file pages beside what it built, not the whole file, so it
peaks near what the model holds (GGUF and safetensors alike)."""
from __future__ import annotations

import mmap
from pathlib import Path
from typing import Callable


def map_file(path: str | Path) -> mmap.mmap:
    """The whole file, mapped copy-on-write: tensors can be viewed in place (np.frombuffer then
    gives arrays the kernels may take as writable) and nothing is ever written back to the file."""
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)


def drop_pages(buffer: mmap.mmap, start: int, end: int) -> None:
    """Drops the mapping's resident pages over [start, end) (whole pages from the one holding start)."""
    if not hasattr(mmap, "MADV_DONTNEED") or end <= start:
        return
    first = start // mmap.PAGESIZE * mmap.PAGESIZE
    # A private mapping never written: the pages are only dropped, and re-read from the file if touched.
    buffer.madvise(mmap.MADV_DONTNEED, first, min(end, len(buffer)) - first)


def rows_dropper(buffer: mmap.mmap, start: int, row_bytes: int) -> Callable[[int, int], None]:
    """For a row-major tensor at `start`: drops the pages of rows [first, end) once they are taken
    (conveyor.model.linear.pack_blocks's `taken`), so a large matrix is not resident whole while it packs."""
    return lambda first, end: drop_pages(buffer, start + first * row_bytes, start + end * row_bytes)
