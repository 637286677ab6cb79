"""Build one of conveyor's C++ kernels as its source stood at a git revision, beside the working
tree's build, for A/B runs of a kernel change in one process (`--baseline REV` in
decode_attention.py and panel_gemm.py). The revision's sources must be the torch-free ones (array.h):
this builder compiles no torch extension."""
from __future__ import annotations

import subprocess
import sysconfig
import tempfile
from pathlib import Path

from conveyor.model.kernels import _SOURCE_DIR, _cflags, compile_module


def kernel_at(revision: str, name: str) -> object:
    """The module `name` (e.g. "paged_decode") compiled from its source and headers at `revision`."""
    root = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True, cwd=_SOURCE_DIR).strip())
    relative = _SOURCE_DIR.relative_to(root)
    folder = Path(tempfile.mkdtemp(prefix="conveyor-kernel-"))
    listed = subprocess.check_output(["git", "ls-tree", "--name-only", f"{revision}:{relative}"], text=True, cwd=root)
    for file in [f"{name}.cpp", *(line for line in listed.split() if line.endswith(".h"))]:
        (folder / file).write_text(subprocess.check_output(["git", "show", f"{revision}:{relative / file}"], text=True, cwd=root))
    tag = subprocess.check_output(["git", "rev-parse", "--short", revision], text=True, cwd=root).strip()
    extension = f"conveyor_{name}_at_{tag}"
    return compile_module(extension, folder / f"{name}.cpp", _cflags(name),
                          folder / f"{extension}{sysconfig.get_config_var('EXT_SUFFIX')}")
