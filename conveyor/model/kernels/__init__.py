"""Optional C++ kernels, compiled on first use by the C++ compiler (CXX, else c++ or g++) against
pybind11's headers, with no torch: their functions take and return numpy arrays. Each build is
cached under CONVEYOR_KERNELS_DIR (default: $CONVEYOR_CACHE/kernels, else ~/.cache/conveyor/kernels),
named by what it depends on, so a start that finds its builds imports them without running the
compiler. When a kernel cannot be built, callers fall back to their plain paths, which give the same
results a little differently rounded. CONVEYOR_KERNELS=0 forces the fallback (A/B comparisons,
debugging)."""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from numpy.typing import NDArray

logger = logging.getLogger(__name__)

_SOURCE_DIR = Path(__file__).parent

Array = NDArray[Any]

# gcc and clang default to 256-bit vectors even where AVX-512 exists; the flag is x86-only.
_VECTOR_WIDTH_FLAGS = ["-mprefer-vector-width=512"] if platform.machine() in ("x86_64", "AMD64") else []
# Without it gcc keeps floor() a scalar call (it would have to preserve FP exception flags), so
# no loop calling fast_exp vectorizes; nothing here reads those flags.
_COMMON_FLAGS = ["-march=native", "-fopenmp", "-fno-trapping-math", *_VECTOR_WIDTH_FLAGS]
# fused_ops rounds its products and sums one by one, as its numpy reference (model/ops.py) does.
_MODULE_FLAGS = {"fused_ops": ["-ffp-contract=off"]}
# The panel kernels are written with their loops unrolled by pragma, so -O3 adds little to them
# (within noise but for the fp32 vocabulary projection at 32+ rows: docs/PERF.md, "Building the
# kernels") while taking 4-5x as long to compile their many tile instantiations, most of a fresh
# install's first start. The others gain from -O3's vectorizer and build quickly either way.
_OPTIMIZATION = {"panel_gemm": "-O2", "quant_gemm": "-O2"}
# Every module is one translation unit built and linked in one command; pybind11's headers need C++17.
_BUILD_FLAGS = ["-shared", "-fPIC", "-std=c++17"]
_LINK_FLAGS = ["-fopenmp"]


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


def _sources(name: str) -> dict[str, bytes]:
    """The kernel's files by name, read once: what a build is named by is what it compiles."""
    return {file.name: file.read_bytes() for file in _kernel_files(name)}


def _cflags(name: str) -> list[str]:
    return [_OPTIMIZATION.get(name, "-O3"), *_COMMON_FLAGS, *_MODULE_FLAGS.get(name, [])]


def _compiler() -> list[str] | None:
    """The C++ compiler's command: CXX (which may carry arguments, e.g. "ccache g++"), else c++ or g++."""
    configured = os.environ.get("CXX", "").strip()
    if configured:
        return shlex.split(configured)
    found = shutil.which("c++") or shutil.which("g++")
    return [found] if found else None


def _compiler_identity(command: list[str]) -> str:
    """The compiler named by its resolved file, its size and its time: a compiler upgrade is a new
    build, and finding out costs a stat, not a run of `--version` on every start."""
    identity = " ".join(command)
    for word in command:
        path = shutil.which(word)
        if path is not None:
            real = os.path.realpath(path)
            stat = os.stat(real)
            identity += f"\0{real}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return identity


def _pybind11_version() -> str:
    import pybind11

    return str(pybind11.__version__)


def _build_tag(name: str, sources: dict[str, bytes] | None = None) -> str:
    """Short hash of what a build depends on beyond the CPU: the kernel's source and headers, the
    flags, the compiler, Python's version (the module's ABI) and pybind11's (its headers). A start
    that finds a build of this name imports it without running the compiler (`_import_built`);
    checkouts of the same sources share one build."""
    digest = hashlib.sha1(" ".join([*_BUILD_FLAGS, *_cflags(name), *_LINK_FLAGS]).encode() + b"\0")
    compiler = _compiler()
    for fact in (_compiler_identity(compiler) if compiler else "", sys.version, str(sysconfig.get_config_var("EXT_SUFFIX")),
                 _pybind11_version()):
        digest.update(fact.encode() + b"\0")
    for file_name, content in (sources if sources is not None else _sources(name)).items():
        digest.update(file_name.encode() + b"\0" + content + b"\0")
    return digest.hexdigest()[:12]


def _extension_name(name: str, sources: dict[str, bytes] | None = None) -> str:
    return f"conveyor_{name}_{_cpu_tag()}_{_build_tag(name, sources)}"


def _cache_root() -> Path:
    """Where builds are kept: CONVEYOR_KERNELS_DIR, else the kernels/ folder of conveyor's cache
    (CONVEYOR_CACHE, else ~/.cache/conveyor), a folder per build."""
    configured = os.environ.get("CONVEYOR_KERNELS_DIR")
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("CONVEYOR_CACHE") or Path.home() / ".cache" / "conveyor").expanduser() / "kernels"


def _library(extension_name: str) -> Path:
    return _cache_root() / extension_name / f"{extension_name}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"


def _staged_source(name: str, folder: Path, sources: dict[str, bytes] | None = None) -> Path:
    """The kernel's files written into `folder` (inside the build's folder, which is named by their
    content), so the build compiles exactly the bytes its name was hashed from and the cache shows
    what each build was built from. A file lands whole (os.replace), so processes staging at once agree."""
    folder.mkdir(parents=True, exist_ok=True)
    for file_name, content in (sources if sources is not None else _sources(name)).items():
        target = folder / file_name
        if not target.is_file():
            partial = folder / f".{file_name}.{os.getpid()}.{threading.get_ident()}.partial"
            partial.write_bytes(content)
            os.replace(partial, target)
    return folder / f"{name}.cpp"


# A build killed half-way (Ctrl-C during a server's first start) leaves its lock file behind, which
# would make every later start wait on it. A kernel builds in well under a minute here, so a lock
# this old is stale.
STALE_LOCK_SECONDS = 300.0


def _lock_path(extension_name: str) -> Path:
    return _cache_root() / extension_name / "lock"


def wait_for_build_lock(extension_name: str, stale_after: float = STALE_LOCK_SECONDS, poll: float = 1.0) -> bool:
    """Waits while another process builds the extension; removes the lock once it is `stale_after`
    seconds old and returns True if it did."""
    lock = _lock_path(extension_name)
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


def _import_module(extension_name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(extension_name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"{library} is not a loadable module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _import_built(extension_name: str) -> ModuleType | None:
    """The build from the cache when it is there (a build is installed whole, by rename, so a
    library found is a finished one), None otherwise."""
    library = _library(extension_name)
    return _import_module(extension_name, library) if library.is_file() else None


def compile_module(extension_name: str, source: Path, flags: list[str], library: Path,
                   include_dirs: tuple[Path, ...] = ()) -> ModuleType:
    """Compiles and links `source` into the Python module `extension_name` at `library` (written under
    a temporary name, then renamed into place), and imports it. Raises RuntimeError with the
    compiler's output when it fails (its whole output also lands beside the library, in build.log)."""
    import pybind11

    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install c++ / g++)")
    library.parent.mkdir(parents=True, exist_ok=True)
    partial = library.with_name(f".{library.name}.{os.getpid()}.{threading.get_ident()}.partial")
    includes = [pybind11.get_include(), sysconfig.get_paths()["include"], *map(str, include_dirs)]
    command = [*compiler, *_BUILD_FLAGS, *flags, *(f"-I{folder}" for folder in includes),
               f"-DCONVEYOR_MODULE_NAME={extension_name}", str(source), "-o", str(partial), *_LINK_FLAGS]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        log = library.parent / "build.log"
        log.write_text(f"{shlex.join(command)}\n\n{result.stdout}{result.stderr}")
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-20:])
        raise RuntimeError(f"compiling {source.name} failed (exit {result.returncode}; all of it in {log}):\n{tail}")
    os.replace(partial, library)
    return _import_module(extension_name, library)


def _build(name: str, extension_name: str, sources: dict[str, bytes]) -> ModuleType:
    """Builds the kernel into the cache under a lock (another process building the same waits for
    it, then imports its build), or imports the build a process finished meanwhile."""
    library = _library(extension_name)
    lock = _lock_path(extension_name)
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        if library.is_file():
            return _import_module(extension_name, library)
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            wait_for_build_lock(extension_name)
            continue
        try:
            if library.is_file():  # finished between the look and the lock
                return _import_module(extension_name, library)
            source = _staged_source(name, library.parent / "src", sources)
            return compile_module(extension_name, source, _cflags(name), library)
        finally:
            lock.unlink(missing_ok=True)


# Modules loaded so far, and the thread count set_num_threads gave them (applied to later ones too).
_LOADED: dict[str, Any] = {}
_THREADS: list[int] = []


@functools.cache
def _load(name: str) -> object | None:
    try:
        sources = _sources(name)
        extension_name = _extension_name(name, sources)
    except Exception as exc:  # no pybind11, unreadable sources: the plain paths still work
        logger.warning("conveyor: C++ kernel %r unavailable, using the fallback (%s)", name, exc)
        return None
    module: Any = None
    try:
        module = _import_built(extension_name)
    except Exception as exc:  # e.g. a damaged library: built again below
        logger.warning("conveyor: cached C++ kernel %r did not load, building it again (%s)", name, exc)
        _library(extension_name).unlink(missing_ok=True)
    if module is None:
        logger.info("building C++ kernels, first start only: %s (cached for later starts)", name)
        started = time.monotonic()
        try:
            module = _build(name, extension_name, sources)
        except Exception as exc:  # no compiler, odd platform: the plain paths still work
            logger.warning("conveyor: C++ kernel %r unavailable, using the fallback (%s)", name, exc)
            return None
        logger.info("built C++ kernel %s in %.0f s", name, time.monotonic() - started)
    if _THREADS:
        module.set_num_threads(_THREADS[-1])
    _LOADED[name] = module
    return module


def set_num_threads(n: int) -> None:
    """The OpenMP threads every kernel uses, those loaded now and those loaded later (each module
    keeps its own count; OpenMP's default is one per CPU, or OMP_NUM_THREADS)."""
    if n < 1:
        raise ValueError(f"set_num_threads: expected a positive number of threads, not {n}")
    _THREADS[:] = [n]
    for module in list(_LOADED.values()):
        module.set_num_threads(n)


def get_num_threads() -> int:
    """The OpenMP threads a kernel called now uses (without a kernel loaded: what it would use)."""
    for module in list(_LOADED.values()):
        return int(module.get_num_threads())
    if _THREADS:
        return _THREADS[-1]
    configured = os.environ.get("OMP_NUM_THREADS", "").split(",")[0]
    return int(configured) if configured.isdigit() and int(configured) > 0 else len(os.sched_getaffinity(0))


PagedDecodeKernel = Callable[[Array, Array, Array, Array, Array, float, int], Array]


def paged_decode_kernel() -> PagedDecodeKernel | None:
    """(q [D,H,d] float32, k_cache, v_cache [blocks, block_size, kv_heads, d] float32 or float16,
    block_tables [D,W] int64, context_lens [D] int64, scale, window) -> [D,H,d] float32; window > 0
    limits each row to its last `window` tokens (0: all). None when unavailable or disabled."""
    if not kernels_enabled():
        return None
    module = _load("paged_decode")
    return None if module is None else module.paged_decode_attention  # type: ignore[attr-defined]


PagedPrefillKernel = Callable[[Array, Array, Array, Array, int, float, int], Array]


def paged_prefill_kernel() -> PagedPrefillKernel | None:
    """(q [n,H,d] float32, k_cache, v_cache [blocks, block_size, kv_heads, d] float32 or float16,
    block_table [blocks] (int64; other integer types are converted), num_cached, scale, window) ->
    [n,H,d] float32: causal attention of one prefill chunk whose queries sit at positions
    num_cached.., every key (cached and the chunk's own) read from the cache; window > 0 limits each
    query to its last `window` positions. Head dims 64, 128 or 256. None when unavailable or disabled
    (CONVEYOR_KERNELS=0, or CONVEYOR_PREFILL_ATTENTION=0 for this one alone)."""
    if not kernels_enabled() or os.environ.get("CONVEYOR_PREFILL_ATTENTION", "1") == "0":
        return None
    module = _load("paged_prefill")
    return None if module is None else module.paged_prefill_attention  # type: ignore[attr-defined]


def fused_ops() -> object | None:
    """The module of fused per-layer ops (fused_ops.cpp: rms_norm, add_rms_norm_, rope_and_cache,
    silu_and_mul, argmax_rows; float32 only), or None when unavailable or disabled."""
    return _load("fused_ops") if kernels_enabled() else None


def panel_gemm(force: bool = False) -> object | None:
    """The module of the skinny fp32 matmul (panel_gemm.cpp: pack_panels, panel_matmul; x86 with
    AVX2 and FMA), or None when unavailable or disabled (`force`: whatever CONVEYOR_KERNELS says,
    for a weight already held only in its panels)."""
    return _load("panel_gemm") if force or kernels_enabled() else None


def quant_gemm(force: bool = False) -> object | None:
    """The module of the matmul on GGUF blocks (quant_gemm.cpp: pack_quantized, pack_quantized_into,
    quantized_matmul, dequantize_rows, column_norms, q8_0_argmax where AVX-512 VNNI/VBMI; x86 with
    AVX2, FMA and F16C), or None when unavailable or disabled (`force`: as panel_gemm's)."""
    return _load("quant_gemm") if force or kernels_enabled() else None


def quant_int8() -> object | None:
    """The module of the integer matmul on GGUF blocks (quant_int8.cpp: int8_matmul on quant_gemm's
    packed panels, x quantised per 32 features to int8; quantize_activations; the bf16 products;
    AVX-512 VNNI or AVX2), or None when unavailable or disabled."""
    return _load("quant_int8") if kernels_enabled() else None


def build_kernels(fp32: bool = True) -> None:
    """Builds (or loads from the cache) every kernel a forward pass resolves, so that none is built
    inside a request: the matmul path resolves the three matmul kernels whatever the dtype
    (conveyor/model/linear.py); `fp32` (fp32 activations, which every model now has, whatever its
    weights are held in) adds the fused ops and the attention kernels, which take fp32 only."""
    kernels: list[Callable[[], object]] = [quant_int8, quant_gemm, panel_gemm]
    if fp32:
        kernels += [paged_decode_kernel, paged_prefill_kernel, fused_ops]
    # A cold build compiles each kernel's one source on one core: build them side by side, the
    # longest builds first so that no core idles at the end.
    with ThreadPoolExecutor(max_workers=max(1, min(len(kernels), os.cpu_count() or 1))) as pool:
        for built in [pool.submit(kernel) for kernel in kernels]:
            built.result()
