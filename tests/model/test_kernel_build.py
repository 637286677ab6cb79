"""A build lock left by an interrupted kernel build must not hang every later start."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from conveyor.model.kernels import wait_for_build_lock


@pytest.fixture()
def lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
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


def test_a_kernel_build_is_named_by_its_sources_content_not_their_checkout(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from conveyor.model import kernels

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


@pytest.mark.parametrize("configured", [False, True])
def test_the_cache_folder_is_the_one_torchs_builder_uses(configured: bool, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils.cpp_extension import _get_build_directory

    from conveyor.model import kernels

    if configured:
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    else:  # the user cache's folder, here under tmp_path (torch's builder creates the folder it names)
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernels._extensions_root() / "conveyor_probe" == Path(_get_build_directory("conveyor_probe", verbose=False))


def test_a_build_is_imported_from_the_cache_only_while_current_and_unlocked(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from conveyor.model import kernels

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = tmp_path / "conveyor_k_ext"
    source = directory / "src" / "k.cpp"
    source.parent.mkdir(parents=True)
    source.write_text("int f() { return 1; }\n")
    assert kernels._import_built("k", "conveyor_k_ext") is None, "nothing built yet"
    library = directory / "conveyor_k_ext.so"
    library.write_bytes(b"not a library")
    assert kernels._import_built("k", "conveyor_k_ext") is None, "no build.ninja: nothing says what it was built from"
    (directory / "build.ninja").write_text(f"build k.o: compile {tmp_path / 'elsewhere' / 'k.cpp'}\n")
    assert kernels._import_built("k", "conveyor_k_ext") is None, "built from another checkout's source"
    (directory / "build.ninja").write_text(f"build k.o: compile {source}\n")
    os.utime(source, (time.time() - 100, time.time() - 100))
    (directory / "lock").touch()
    assert kernels._import_built("k", "conveyor_k_ext") is None, "another process is building it"
    (directory / "lock").unlink()
    with pytest.raises(ImportError):  # current, so it is imported (and this one is no library)
        kernels._import_built("k", "conveyor_k_ext")
    os.utime(source, (time.time() + 100, time.time() + 100))
    assert kernels._import_built("k", "conveyor_k_ext") is None, "its source changed since"


def test_a_start_that_finds_its_kernels_built_does_not_import_the_builder() -> None:
    import subprocess
    import sys

    probe = ("import sys; from conveyor.model import kernels; module = kernels._load('fused_ops'); "
             "print(module is not None, 'torch.utils.cpp_extension' in sys.modules)")
    env = {key: value for key, value in os.environ.items() if key != "CONVEYOR_KERNELS"}
    for _ in range(2):  # the first may build it
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=600)
        assert result.returncode == 0, result.stderr
    loaded, builder_imported = result.stdout.split()
    if loaded != "True":
        pytest.skip("the C++ kernels do not build here (no compiler or ninja)")
    assert builder_imported == "False"
