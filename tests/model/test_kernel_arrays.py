"""What the kernels' Python side promises (conveyor/model/kernels/array.h): numpy arrays in, numpy
arrays out that own their memory (or views that keep their input alive), RuntimeError for a bad
argument and TypeError for what is not a numpy array, the GIL released while a kernel runs, the
thread count settable without torch, and no torch imported at all."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

import numpy as np
import pytest

from conveyor.model import kernels

pytestmark = pytest.mark.skipif(kernels.fused_ops() is None or kernels.panel_gemm() is None,
                                reason="C++ kernels could not be built here")
OPS: Any = kernels.fused_ops()
PANELS: Any = kernels.panel_gemm()


def test_a_result_is_a_new_aligned_numpy_array_that_owns_its_memory() -> None:
    x = np.random.default_rng(0).standard_normal((3, 576)).astype(np.float32)
    y = OPS.rms_norm(x, np.ones(576, np.float32), 1e-5)
    assert type(y) is np.ndarray and y.dtype == np.float32 and y.shape == (3, 576)
    assert y.flags.c_contiguous and y.flags.writeable and y.ctypes.data % 64 == 0
    assert y.base is not None and not isinstance(y.base, np.ndarray)  # a capsule holding the C++ buffer
    before = y.copy()
    del x
    gc.collect()
    y += 1  # its own memory: writing it disturbs nothing
    assert np.array_equal(y, before + 1)


def test_views_into_an_input_keep_it_alive() -> None:
    heads, kv_heads, d, rows = 2, 1, 8, 3
    qkv = np.random.default_rng(1).standard_normal((rows, (heads + 2 * kv_heads) * d)).astype(np.float32)
    cos, sin = np.ones((rows, d), np.float32), np.zeros((rows, d), np.float32)
    caches = [np.zeros((2, 4, kv_heads, d), np.float32) for _ in range(2)]
    q, k, v = OPS.rope_and_cache(qkv, cos, sin, *caches, np.arange(rows), heads, kv_heads, None, None, 1e-6)
    assert k.base is qkv and v.base is qkv and not np.shares_memory(q, qkv)
    assert k.shape == (rows, kv_heads, d) and k.strides == (qkv.strides[0], d * 4, 4)
    assert np.array_equal(v, qkv[:, (heads + kv_heads) * d:].reshape(rows, kv_heads, d))
    want = v.copy()
    alive = weakref.ref(qkv)
    del qkv
    gc.collect()
    assert alive() is not None and np.array_equal(v, want)
    del q, k, v
    gc.collect()
    assert alive() is None


def test_what_is_not_a_numpy_array_is_refused_and_read_only_arrays_are_not_written() -> None:
    with pytest.raises(TypeError):
        OPS.rms_norm([[1.0, 2.0]], np.ones(2, np.float32), 1e-5)
    residual = np.ones((2, 8), np.float32)
    residual.setflags(write=False)
    with pytest.raises(RuntimeError, match="writeable"):
        OPS.add_rms_norm_(residual, np.ones((2, 8), np.float32), np.ones(8, np.float32), 1e-5)
    assert (residual == 1).all()
    weight = np.ones((4, 8), np.float32)
    weight.setflags(write=False)  # read-only inputs are fine where the kernel only reads
    assert PANELS.pack_panels(weight).shape == (1, 8, 16)


def test_the_thread_count_is_set_for_every_module_and_every_calling_thread() -> None:
    before = kernels.get_num_threads()
    try:
        kernels.set_num_threads(1)
        assert OPS.get_num_threads() == 1 and PANELS.get_num_threads() == 1 and kernels.get_num_threads() == 1
        seen: list[int] = []
        worker = threading.Thread(target=lambda: seen.append(OPS.get_num_threads()))
        worker.start()
        worker.join()
        assert seen == [1], "a thread that calls a kernel later applies the count too"
        with pytest.raises(ValueError):
            kernels.set_num_threads(0)
        with pytest.raises(RuntimeError):
            OPS.set_num_threads(0)
    finally:
        kernels.set_num_threads(before)
    assert OPS.get_num_threads() == before


def test_a_result_does_not_depend_on_the_thread_count_where_the_kernel_splits_rows() -> None:
    x = np.random.default_rng(2).standard_normal((300, 576)).astype(np.float32)
    weight = np.random.default_rng(3).standard_normal(576).astype(np.float32)
    before = kernels.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            kernels.set_num_threads(threads)
            results.append(OPS.rms_norm(x, weight, 1e-5))
    finally:
        kernels.set_num_threads(before)
    assert np.array_equal(*results)


def test_the_gil_is_released_while_a_kernel_runs() -> None:
    rng = np.random.default_rng(4)
    packed = PANELS.pack_panels(rng.standard_normal((2048, 2048)).astype(np.float32))
    x = rng.standard_normal((3072, 2048)).astype(np.float32)
    span: list[float] = []

    def run() -> None:
        for _ in range(3):
            start = time.perf_counter()
            PANELS.panel_matmul(x, packed, 2048, None)
            span.append(time.perf_counter() - start)
            if span[-1] > 0.05:
                span.append(start)
                return

    worker = threading.Thread(target=run)
    ticks = []
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
        time.sleep(0.001)
    worker.join()
    if len(span) < 2 or span[-2] <= 0.05:
        pytest.skip("the product ran too quickly here to see")
    start, length = span[-1], span[-2]
    inside = [t for t in ticks if start + 0.01 < t < start + length - 0.01]
    assert len(inside) >= 3, "Python ran on beside the kernel"


def test_no_kernel_imports_torch() -> None:
    probe = """
import sys
import numpy as np
import conveyor.model.kernels as k
k.build_kernels()
modules = [k.fused_ops(), k.panel_gemm(), k.quant_gemm(), k.quant_int8(), k.paged_decode_kernel(), k.paged_prefill_kernel()]
if any(m is None for m in modules):
    print("unbuilt")
else:
    k.fused_ops().rms_norm(np.ones((1, 576), np.float32), np.ones(576, np.float32), 1e-5)
    print('torch' in sys.modules)
"""
    env = {key: value for key, value in os.environ.items() if key != "CONVEYOR_KERNELS"}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr
    if result.stdout.strip() == "unbuilt":
        pytest.skip("the C++ kernels do not all build here")
    assert result.stdout.strip() == "False"
