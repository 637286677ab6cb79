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
