"""glibc's allocator as conveyor sets it: freed weights go back to the system while a model loads,
and once it serves, a step's freed activations are reused by the next step instead of being mapped
and faulted in again. Each case runs in a fresh interpreter, whose allocator this test may change."""
from __future__ import annotations

import ctypes.util
import dataclasses
import json
import subprocess
import sys

import pytest

from conveyor.model.config import ModelConfig
from conveyor.model.memory import LAYER_ROWS, step_working_set_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None,
                                reason="glibc's mallopt")

# Runs the products and frees of two MLP layers over a 512-token prefill (gate/up 20 MB, their
# product 10 MB, down 2 MB), `ROUNDS` times, on the main thread or on another thread (the server
# steps its engine on one), and prints each round's page faults.
PROBE = r"""
import json, resource, sys, threading
import conveyor  # first, as the server does
import numpy as np
from conveyor.model import memory

mode, where = sys.argv[1], sys.argv[2]
memory.keep_large_allocations_returnable()
if mode == "reuse":
    memory.reuse_freed_memory(256 * 2**20)
x = np.ones((512, 896), dtype=np.float32)
rng = np.random.default_rng(0)
gate_up, down = rng.standard_normal((9728, 896), dtype=np.float32), rng.standard_normal((896, 4864), dtype=np.float32)
gate_up *= 0.01  # in place: a freed temporary would be the heap's free memory before the first round
down *= 0.01
faults = []

def rounds():
    for _ in range(8):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _layer in range(2):
            h = x @ gate_up.T
            a = h[:, :4864] * h[:, 4864:]
            del h
            y = a @ down.T
            del a, y
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

if where == "thread":
    thread = threading.Thread(target=rounds)
    thread.start()
    thread.join()
else:
    rounds()
print(json.dumps(faults))
"""
LAYER_PAGES = 512 * (9728 + 4864 + 896) * 4 // 4096  # what one layer's outputs span


def page_faults(mode: str, where: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode, where], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_while_loading_freed_memory_goes_back_and_every_round_faults_again() -> None:
    faults = page_faults("load", "main")
    assert all(f >= LAYER_PAGES for f in faults), faults


@pytest.mark.parametrize("where", ["main", "thread"])
def test_once_serving_freed_activations_are_reused_without_faults(where: str) -> None:
    faults = page_faults("reuse", where)
    assert faults[0] >= LAYER_PAGES // 2, faults  # the first round takes new memory
    # the heap may grow over a few rounds (freed blocks sit between live ones), then holds
    assert all(f < LAYER_PAGES // 20 for f in faults[-3:]), faults


def test_the_working_set_estimate_grows_with_rows_and_sampled_rows() -> None:
    cfg = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16)
    one = step_working_set_bytes(cfg, 1, 0)
    # 4 bytes a float: the residual (hidden) and the rotary cos and sin (head_dim each) for every row
    # of the step; for a run's rows the normed
    # input and attention output (hidden), q and its output, k and v, gate/up and their product;
    # two bytes for the product as the kernel takes it (int8 codes take one, bf16 pairs two)
    residual, run_row = 4 * 64 + 2 * 4 * 16, 4 * (2 * 64 + 2 * 64 + 2 * 32) + 4 * 3 * 256 + 2 * 256
    assert one == residual + run_row
    assert step_working_set_bytes(cfg, 10, 0) == 10 * one
    assert step_working_set_bytes(cfg, 10, 3) == 10 * one + 3 * 2 * 4 * 1000
    # a step's layers run LAYER_ROWS rows at a time (LlamaModel's row_runs): only the residual grows past it
    assert step_working_set_bytes(cfg, 4 * LAYER_ROWS, 0) == 4 * LAYER_ROWS * residual + LAYER_ROWS * run_row
    # sliding-window layers rotating with a base of their own: a second pair of tables a row
    windowed = dataclasses.replace(cfg, sliding_window=8, rope_local_theta=10_000.0)
    assert step_working_set_bytes(windowed, 10, 0) == step_working_set_bytes(cfg, 10, 0) + 10 * 2 * 4 * 16

SPIKE = r"""
import re
import conveyor
import numpy as np
from conveyor.model import memory

def resident():
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024

memory.keep_large_allocations_returnable()
memory.reuse_freed_memory(64 * 2**20)
spike = np.ones(256 * 2**20 // 4, dtype=np.float32)  # 256 MiB of logits, say
fence = [bytearray(100_000) for _ in range(4)]  # allocated after it and still alive: no trim from the top
held = resident()
del spike
freed = resident()
memory.return_freed_memory()
print(held, freed, resident())
"""


def test_a_freed_spike_stays_in_the_heap_until_handed_back() -> None:
    out = subprocess.run([sys.executable, "-c", SPIKE], check=True, capture_output=True, text=True)
    held, freed, handed_back = map(int, out.stdout.split())
    assert freed > held - 64 * 2**20  # freeing alone keeps it: it is not at the heap's top
    assert handed_back < freed - 192 * 2**20
