"""Build one of conveyor's C++ kernels as its source stood at a git revision, beside the working
tree's build, for A/B runs of a kernel change in one process (`--baseline REV` in
decode_attention.py and panel_gemm.py)."""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from torch.utils.cpp_extension import load

from conveyor.model.kernels import _SOURCE_DIR, _cflags


def kernel_at(revision: str, name: str) -> object:
    """The module `name` (e.g. "paged_decode") compiled from its source and headers at `revision`."""
    root = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True, cwd=_SOURCE_DIR).strip())
    relative = _SOURCE_DIR.relative_to(root)
    folder = Path(tempfile.mkdtemp(prefix="conveyor-kernel-"))
    listed = subprocess.check_output(["git", "ls-tree", "--name-only", f"{revision}:{relative}"], text=True, cwd=root)
    for file in [f"{name}.cpp", *(line for line in listed.split() if line.endswith(".h"))]:
        (folder / file).write_text(subprocess.check_output(["git", "show", f"{revision}:{relative / file}"], text=True, cwd=root))
    tag = subprocess.check_output(["git", "rev-parse", "--short", revision], text=True, cwd=root).strip()
    return load(name=f"conveyor_{name}_at_{tag}", sources=[str(folder / f"{name}.cpp")],
                extra_cflags=_cflags(name), extra_ldflags=["-fopenmp"],
                build_directory=str(folder))
