"""Checkpoint files read through a private memory map, each tensor's pages dropped once it is taken
(packed, converted or left as a view): a load then holds at most one tensor's file pages beside
what it built, not the whole file, so it peaks near what the model holds (GGUF and safetensors alike)."""
from __future__ import annotations

import mmap
from pathlib import Path


def map_file(path: str | Path) -> mmap.mmap:
    """The whole file, mapped copy-on-write: tensors can be viewed in place (torch.frombuffer wants a
    writable buffer) and nothing is ever written back to the file."""
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)


def drop_pages(buffer: mmap.mmap, start: int, end: int) -> None:
    """Drops the mapping's resident pages over [start, end) (whole pages from the one holding start)."""
    if not hasattr(mmap, "MADV_DONTNEED") or end <= start:
        return
    first = start // mmap.PAGESIZE * mmap.PAGESIZE
    # A private mapping never written: the pages are only dropped, and re-read from the file if touched.
    buffer.madvise(mmap.MADV_DONTNEED, first, min(end, len(buffer)) - first)
