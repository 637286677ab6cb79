"""The kernels' builder (conveyor/model/kernels/__init__.py): a build is named by what it depends on,
found again without running the compiler, installed whole, and a lock left by an interrupted build
must not hang every later start."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conveyor.model import kernels
from conveyor.model.kernels import wait_for_build_lock


@pytest.fixture()
def lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CONVEYOR_KERNELS_DIR", str(tmp_path))
    path = tmp_path / "conveyor_test_ext" / "lock"
    path.parent.mkdir()
    return path


def test_no_lock_means_no_wait(lock: Path) -> None:
    assert wait_for_build_lock("conveyor_test_ext") is False


def test_a_stale_lock_is_removed(lock: Path) -> None:
    lock.touch()
    old = time.time() - 1000
    os.utime(lock, (old, old))
    assert wait_for_build_lock("conveyor_test_ext", stale_after=300) is True
    assert not lock.exists()


def test_a_live_build_is_waited_for_and_left_alone(lock: Path) -> None:
    lock.touch()
    threading.Timer(0.3, lock.unlink).start()  # the other process finishes its build
    start = time.monotonic()
    assert wait_for_build_lock("conveyor_test_ext", stale_after=60, poll=0.05) is False
    assert 0.25 < time.monotonic() - start < 10


def test_a_young_lock_that_never_goes_away_is_removed_once_stale(lock: Path) -> None:
    lock.touch()
    assert wait_for_build_lock("conveyor_test_ext", stale_after=0.3, poll=0.05) is True
    assert not lock.exists()


def test_the_cache_folder_is_configurable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_KERNELS_DIR", str(tmp_path / "mine"))
    assert kernels._cache_root() == tmp_path / "mine"
    monkeypatch.delenv("CONVEYOR_KERNELS_DIR")
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path / "cache"))
    assert kernels._cache_root() == tmp_path / "cache" / "kernels"
    monkeypatch.delenv("CONVEYOR_CACHE")
    assert kernels._cache_root() == Path.home() / ".cache" / "conveyor" / "kernels"


def test_a_kernel_build_is_named_by_its_sources_content_not_their_checkout(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    checkouts = []
    for name in ("one", "two"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "k.cpp").write_text('#include "simd.h"\nint f() { return 1; }\n')
        (folder / "simd.h").write_text("// vectors\n")
        checkouts.append(folder)
    tags = []
    for folder in checkouts:
        monkeypatch.setattr(kernels, "_SOURCE_DIR", folder)
        tags.append(kernels._build_tag("k"))
    assert tags[0] == tags[1], "two checkouts of the same sources share one build"
    staged = kernels._staged_source("k", tmp_path / "build" / "src")
    assert staged.read_text() == (checkouts[1] / "k.cpp").read_text()
    assert (staged.parent / "simd.h").read_text() == "// vectors\n", "headers travel with the source"
    (checkouts[1] / "simd.h").write_text("// other vectors\n")
    assert kernels._build_tag("k") != tags[0], "a header's change is a new build"
    (checkouts[1] / "simd.h").write_text("// vectors\n")
    assert kernels._build_tag("k") == tags[0]
    monkeypatch.setitem(kernels._OPTIMIZATION, "k", "-O1")
    assert kernels._build_tag("k") != tags[0], "so is a change of flags"
    monkeypatch.delitem(kernels._OPTIMIZATION, "k")
    monkeypatch.setenv("CXX", "clang++")
    assert kernels._build_tag("k") != tags[0], "and another compiler"


# The smallest module the builder makes: a source including array.h, as every kernel does.
PROBE = """#include "array.h"
using namespace conveyor_array;
Array twice(const Array& x) {
  CHECK(x.dtype() == DType::kFloat32 && x.is_contiguous(), "x must be contiguous float32");
  Array y = empty_like(x);
  for (int64_t i = 0; i < x.numel(); ++i) y.data_ptr<float>()[i] = 2 * x.data_ptr<float>()[i];
  return y;
}
PYBIND11_MODULE(CONVEYOR_MODULE_NAME, m) {
  def_thread_functions(m);
  m.def("twice", &twice, py::call_guard<py::gil_scoped_release>());
  m.attr("version") = VERSION;
}
"""


def _probe_kernel(folder: Path, version: int) -> None:
    for header in kernels._kernel_files("fused_ops")[1:]:
        (folder / header.name).write_bytes(header.read_bytes())
    (folder / "probe.cpp").write_text(f"#define VERSION {version}\n{PROBE}")


@pytest.fixture()
def probe_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    if kernels._compiler() is None:
        pytest.skip("no C++ compiler here")
    folder = tmp_path / "src"
    folder.mkdir()
    _probe_kernel(folder, 1)
    monkeypatch.setattr(kernels, "_SOURCE_DIR", folder)
    monkeypatch.setenv("CONVEYOR_KERNELS_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(kernels._OPTIMIZATION, "probe", "-O0")
    kernels._load.cache_clear()
    yield folder
    kernels._load.cache_clear()


def test_a_build_is_installed_whole_found_again_without_the_compiler_and_rebuilt_when_its_source_changes(
        probe_tree: Path) -> None:
    import numpy as np

    module = kernels._load("probe")
    assert module is not None and module.version == 1  # type: ignore[attr-defined]
    assert np.array_equal(module.twice(np.arange(4, dtype=np.float32)), [0, 2, 4, 6])  # type: ignore[attr-defined]
    name = kernels._extension_name("probe")
    library = kernels._library(name)
    assert library.is_file() and not (library.parent / "lock").exists()
    assert not [p for p in library.parent.iterdir() if p.name.endswith(".partial")], "built under a temporary name"
    assert (library.parent / "src" / "probe.cpp").read_text() == (probe_tree / "probe.cpp").read_text()

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise AssertionError("the compiler ran although the build was in the cache")

    kernels._load.cache_clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels.subprocess, "run", no_compiler)
        assert kernels._load("probe").version == 1  # type: ignore[union-attr]  # the fast path: imported as it is
    _probe_kernel(probe_tree, 2)
    kernels._load.cache_clear()
    rebuilt = kernels._load("probe")
    assert rebuilt is not None and rebuilt.version == 2  # type: ignore[attr-defined]
    assert kernels._extension_name("probe") != name


def test_a_build_that_fails_leaves_no_library_and_the_kernel_unavailable(probe_tree: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    (probe_tree / "probe.cpp").write_text('#include "array.h"\nthis is not C++\n')
    assert kernels._load("probe") is None
    assert "unavailable" in caplog.text
    name = kernels._extension_name("probe")
    folder = kernels._library(name).parent
    assert not kernels._library(name).exists() and not (folder / "lock").exists()
    assert "this is not C++" in (folder / "src" / "probe.cpp").read_text() and (folder / "build.log").is_file()


def test_a_build_waits_for_another_process_s_build_and_takes_its_library(probe_tree: Path) -> None:
    name = kernels._extension_name("probe")
    lock = kernels._lock_path(name)
    lock.parent.mkdir(parents=True)
    lock.touch()

    def other_process_finishes() -> None:
        kernels.compile_module(name, kernels._staged_source("probe", lock.parent / "src"), kernels._cflags("probe"),
                               kernels._library(name))
        lock.unlink()

    threading.Timer(0.2, other_process_finishes).start()
    module = kernels._load("probe")
    assert module is not None and module.version == 1  # type: ignore[attr-defined]


def test_a_start_that_finds_its_kernels_built_imports_no_torch() -> None:
    probe = ("import sys; import conveyor.model.kernels as k; module = k.fused_ops(); "
             "print(module is not None, 'torch' in sys.modules)")
    env = {key: value for key, value in os.environ.items() if key != "CONVEYOR_KERNELS"}
    for _ in range(2):  # the first may build it
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=600)
        assert result.returncode == 0, result.stderr
    loaded, torch_imported = result.stdout.split()
    if loaded != "True":
        pytest.skip("the C++ kernels do not build here (no compiler)")
    assert torch_imported == "False"
