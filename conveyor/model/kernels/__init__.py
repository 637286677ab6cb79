"""Optional C++ kernels, compiled on first use by torch's extension builder (a C++ compiler and
ninja are needed; the build is cached under ~/.cache/torch_extensions). When a kernel cannot be
built, callers fall back to plain torch ops, which give the same results a little differently
rounded. CONVEYOR_KERNELS=0 forces the fallback (A/B comparisons, debugging)."""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger(__name__)

_SOURCE_DIR = Path(__file__).parent


# gcc and clang default to 256-bit vectors even where AVX-512 exists; the flag is x86-only.
_VECTOR_WIDTH_FLAGS = ["-mprefer-vector-width=512"] if platform.machine() in ("x86_64", "AMD64") else []
# Without it gcc keeps floor() a scalar call (it would have to preserve FP exception flags), so
# no loop calling fast_exp vectorizes; nothing here reads those flags.
_COMMON_FLAGS = ["-march=native", "-fopenmp", "-fno-trapping-math", *_VECTOR_WIDTH_FLAGS]
# fused_ops rounds its products and sums one by one, as the torch ops it replaces do.
_MODULE_FLAGS = {"fused_ops": ["-ffp-contract=off"]}
# The panel kernels are written with their loops unrolled by pragma, so -O3 adds little to them
# (within noise but for the fp32 vocabulary projection at 32+ rows: docs/PERF.md, "Building the
# kernels") while taking 4-5x as long to compile their many tile instantiations, most of a fresh
# install's first start. The others gain from -O3's vectorizer and build quickly either way.
_OPTIMIZATION = {"panel_gemm": "-O2", "quant_gemm": "-O2"}


def kernels_enabled() -> bool:
    return os.environ.get("CONVEYOR_KERNELS", "1") != "0"


def _cpu_tag() -> str:
    """Short hash of the CPU's feature flags: the build uses -march=native, so a cache shared
    across machines (a home directory on a cluster) must not hand one CPU another's binary."""
    flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags += next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags += platform.processor()
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def _kernel_files(name: str) -> list[Path]:
    """The kernel's source and every header it may include."""
    return [_SOURCE_DIR / f"{name}.cpp", *sorted(_SOURCE_DIR.glob("*.h"))]


def _cflags(name: str) -> list[str]:
    return [_OPTIMIZATION.get(name, "-O3"), *_COMMON_FLAGS, *_MODULE_FLAGS.get(name, [])]


def _build_tag(name: str) -> str:
    """Short hash of what a build depends on beyond the CPU: the kernel's source and headers (torch's
    builder compares no content across processes: ninja looks at times and at the compile command),
    the flags, where torch lies (its include paths are in the compile command, so a build made in
    another virtual environment would be rebuilt, and would then rebuild this one's), and what else
    the command or the library's ABI comes from (torch's and Python's versions, the compiler named
    by CXX): a start that finds its build imports it without asking ninja (`_import_built`)."""
    digest = hashlib.sha1(str(Path(torch.__file__).resolve().parent).encode() + b"\0")
    digest.update(" ".join(_cflags(name)).encode() + b"\0")
    for fact in (torch.__version__, str(torch.version.git_version), sys.version, os.environ.get("CXX", "")):
        digest.update(fact.encode() + b"\0")
    for file in _kernel_files(name):
        digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def _staged_source(name: str, folder: Path) -> Path:
    """The kernel's files copied into `folder` (inside the build directory, which is named by their
    content), so that checkouts of the same sources using one torch (the dev tree and a worktree, or
    a clone) share one build instead of each rebuilding the others' out of the cache. Written once;
    a file lands whole (os.replace), so processes staging at once agree."""
    folder.mkdir(parents=True, exist_ok=True)
    for file in _kernel_files(name):
        target = folder / file.name
        if not target.is_file():
            partial = folder / f".{file.name}.{os.getpid()}.partial"
            partial.write_bytes(file.read_bytes())
            os.replace(partial, target)
    return folder / f"{name}.cpp"


# A build killed half-way (Ctrl-C during a server's first start) leaves torch's lock file behind,
# and torch then waits on it forever, silently. A kernel builds in well under a minute here, so a
# lock this old is stale.
STALE_LOCK_SECONDS = 300.0


def wait_for_build_lock(extension_name: str, stale_after: float = STALE_LOCK_SECONDS, poll: float = 1.0) -> bool:
    """Waits while another process builds the extension; removes the lock once it is `stale_after`
    seconds old and returns True if it did."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        lock = Path(_get_build_directory(extension_name, verbose=False)) / "lock"
    except (ImportError, OSError):  # a torch without the helper: torch's own wait applies
        return False
    warned = False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except OSError:  # no lock: nobody is building
            return False
        if age >= stale_after:
            logger.warning("conveyor: removing stale build lock %s (%.0f s old; a build was interrupted)", lock, age)
            lock.unlink(missing_ok=True)
            return True
        if not warned:
            logger.warning("conveyor: waiting for build lock %s (another process is building, or one was "
                           "interrupted: it counts as stale after %.0f s)", lock, stale_after)
            warned = True
        time.sleep(poll)


def _why_build(directory: Path, extension_name: str, source: Path) -> str | None:
    """Why loading the extension from its build `directory` will build it, or None if the
    builder's cache holds it built from `source` as it is now (the library exists, was built from
    this path, and is newer)."""
    try:
        library = directory / f"{extension_name}.so"
        if not library.is_file():
            return "first start only"
        if os.path.abspath(source) not in (directory / "build.ninja").read_text():
            return "built before by another version of conveyor"
        if source.stat().st_mtime > library.stat().st_mtime:
            return "its source changed"
        return None
    except OSError as exc:
        return f"its build could not be read ({exc.strerror})"


def _extensions_root() -> Path:
    """The folder torch's extension builder keeps its builds in, by the builder's own rule
    (TORCH_EXTENSIONS_DIR, else the user cache's torch_extensions/py<version>_<accelerator>),
    worked out without importing the builder: `torch.utils.cpp_extension` brings setuptools with
    it, a tenth of a second and a few MiB that a start finding every kernel built has no use for.
    A test holds the rule to torch's (the pinned version's); a build found elsewhere is still one
    of this tree's sources, flags and torch, which its name says (`_build_tag`)."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured is not None:
        return Path(configured)
    from torch import _appdirs

    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions"))) / f"{python}_{accelerator}"


def _import_built(name: str, extension_name: str) -> object | None:
    """The extension straight from the builder's cache when it is there, current and nobody is
    building it (a lock); None otherwise, and the builder then decides."""
    directory = _extensions_root() / extension_name
    source = directory / "src" / f"{name}.cpp"
    if (directory / "lock").exists() or not source.is_file() or _why_build(directory, extension_name, source):
        return None
    spec = importlib.util.spec_from_file_location(extension_name, directory / f"{extension_name}.so")
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def _load(name: str) -> object | None:
    extension_name = f"conveyor_{name}_{_cpu_tag()}_{_build_tag(name)}"
    try:
        if (module := _import_built(name, extension_name)) is not None:
            return module
    except Exception as exc:  # e.g. a damaged library: the builder's own load says what it can do
        logger.warning("conveyor: cached C++ kernel %r did not load, handing it to torch's builder (%s)", name, exc)
    from torch.utils.cpp_extension import _get_build_directory, load

    wait_for_build_lock(extension_name)
    directory = Path(_get_build_directory(extension_name, verbose=False))
    source = _staged_source(name, directory / "src")
    if (reason := _why_build(directory, extension_name, source)) is not None:
        logger.info("building C++ kernels, %s: %s (cached for later starts)", reason, name)
    started = time.monotonic()
    try:
        module = load(
            name=extension_name,
            sources=[str(source)],
            extra_cflags=_cflags(name),
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, odd platform: the torch path still works
        logger.warning("conveyor: C++ kernel %r unavailable, using the torch fallback (%s)", name, exc)
        return None
    if reason is not None:
        logger.info("built C++ kernel %s in %.0f s", name, time.monotonic() - started)
    return module


PagedDecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int], torch.Tensor]


def paged_decode_kernel() -> PagedDecodeKernel | None:
    """(q [D,H,d], k_cache, v_cache [blocks, block_size, kv_heads, d], block_tables [D,W] int64,
    context_lens [D] int64, scale, window) -> [D,H,d]; window > 0 limits each row to its last `window`
    tokens (0: all). fp32 only. None when unavailable or disabled."""
    if not kernels_enabled():
        return None
    module = _load("paged_decode")
    return None if module is None else module.paged_decode_attention  # type: ignore[attr-defined]


PagedPrefillKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float, int], torch.Tensor]


def paged_prefill_kernel() -> PagedPrefillKernel | None:
    """(q [n,H,d], k_cache, v_cache [blocks, block_size, kv_heads, d], block_table [blocks] int64,
    num_cached, scale, window) -> [n,H,d]: causal attention of one prefill chunk whose queries sit
    at positions num_cached.., every key (cached and the chunk's own) read from the cache; window > 0
    limits each query to its last `window` positions. fp32, head dims 64, 128 or 256. None when
    unavailable or disabled (CONVEYOR_KERNELS=0, or CONVEYOR_PREFILL_ATTENTION=0 for this one alone)."""
    if not kernels_enabled() or os.environ.get("CONVEYOR_PREFILL_ATTENTION", "1") == "0":
        return None
    module = _load("paged_prefill")
    return None if module is None else module.paged_prefill_attention  # type: ignore[attr-defined]


def fused_ops() -> object | None:
    """The module of fused per-layer ops (fused_ops.cpp: rms_norm, add_rms_norm_, rope_and_cache,
    silu_and_mul; fp32 only), or None when unavailable or disabled."""
    return _load("fused_ops") if kernels_enabled() else None


def panel_gemm(force: bool = False) -> object | None:
    """The module of the skinny fp32 matmul (panel_gemm.cpp: pack_panels, panel_matmul; x86 with
    AVX2 and FMA), or None when unavailable or disabled (`force`: whatever CONVEYOR_KERNELS says,
    for a weight already held only in its panels)."""
    return _load("panel_gemm") if force or kernels_enabled() else None


def quant_gemm(force: bool = False) -> object | None:
    """The module of the matmul on GGUF blocks (quant_gemm.cpp: pack_quantized, quantized_matmul,
    dequantize_rows; x86 with AVX2, FMA and F16C), or None when unavailable or disabled (`force`:
    as panel_gemm's)."""
    return _load("quant_gemm") if force or kernels_enabled() else None


def quant_int8() -> object | None:
    """The module of the integer matmul on GGUF blocks (quant_int8.cpp: int8_matmul on quant_gemm's
    packed panels, x quantised per 32 features to int8; quantize_activations; AVX-512 VNNI or AVX2),
    or None when unavailable or disabled."""
    return _load("quant_int8") if kernels_enabled() else None


def build_kernels(dtype: torch.dtype) -> None:
    """Builds (or loads from the cache) every kernel a forward pass in `dtype` resolves, so that
    none is built inside a request: the matmul path resolves both panel kernels whatever the
    dtype (conveyor/model/linear.py), the fused ops and the attention kernels are fp32 only."""
    kernels: list[Callable[[], object]] = [quant_int8, quant_gemm, panel_gemm]
    if dtype == torch.float32:
        kernels += [paged_decode_kernel, paged_prefill_kernel, fused_ops]
    # A cold build compiles each kernel's one source on one core: build them side by side, the
    # longest builds first so that no core idles at the end.
    with ThreadPoolExecutor(max_workers=max(1, min(len(kernels), os.cpu_count() or 1))) as pool:
        for built in [pool.submit(kernel) for kernel in kernels]:
            built.result()
