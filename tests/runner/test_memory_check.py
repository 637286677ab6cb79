"""A model or KV pool larger than the machine can hold is refused with a clear error that names both
numbers and the flag that lowers the pool, before anything large is allocated: never an OOM kill."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conveyor.config import EngineConfig
from conveyor.errors import ConfigError
from conveyor.model.memory import available_memory
from conveyor.runner.model_runner import ModelRunner, check_fits


def test_check_fits_names_both_numbers_and_the_way_out() -> None:
    available, source = available_memory()
    check_fits("a small thing", 1 << 20, "no hint needed")
    with pytest.raises(ConfigError) as e:
        check_fits("the KV cache", available + (1 << 30), "lower it with --kv-cache-memory")
    message = str(e.value)
    assert f"{(available + (1 << 30)) / 2**30:.2f} GiB" in message and "available" in message
    assert source in message and "--kv-cache-memory" in message


def test_a_kv_pool_beyond_free_memory_fails_before_loading(smollm_gguf_path) -> None:
    """In a fresh process, so its peak memory shows what was allocated before the refusal."""
    script = (
        "from conveyor.config import EngineConfig; from conveyor.runner.model_runner import ModelRunner\n"
        "from conveyor.errors import ConfigError\n"
        "try:\n"
        "    ModelRunner.from_config(EngineConfig(kv_cache_memory='100000GiB'))\n"
        "except ConfigError as e:\n"
        "    print('refused:', e)\n"
        "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0])\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert "refused:" in out.stdout and "--kv-cache-memory" in out.stdout and "GiB" in out.stdout
    peak_kib = int(out.stdout.strip().splitlines()[-1].split()[1])
    assert peak_kib < 1_000_000  # the interpreter and libraries; neither the weights' pool nor a KV pool was made


def test_serve_with_a_pool_beyond_free_memory_exits_with_the_message() -> None:
    out = subprocess.run([sys.executable, "-m", "conveyor.cli", "serve", "--kv-cache-memory", "100000GiB", "--port", "8199"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--kv-cache-memory" in out.stderr + out.stdout


def test_a_pool_given_in_blocks_is_checked_once_the_block_size_is_known(smollm_gguf_path) -> None:
    with pytest.raises(ConfigError, match="--kv-cache-memory"):
        ModelRunner.from_config(EngineConfig(num_kv_blocks=1 << 40))
