"""Command-line options come from the config dataclasses: their defaults are the dataclasses'."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from conveyor.bench.compare import CompareConfig
from conveyor.cli import add_engine_args, engine_kwargs
from conveyor.config import EngineConfig, SchedulerConfig
from conveyor.options import add_config_args, config_fields


def test_every_engine_field_is_an_option_whose_default_is_the_fields() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args([])
    for cls in (EngineConfig, SchedulerConfig):
        for f in config_fields(cls):
            assert getattr(args, f.name) == f.default, f.name
    assert EngineConfig.from_kwargs(model=args.model, **engine_kwargs(args)) == EngineConfig()


def test_options_parse_to_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--max-num-seqs", "3", "--no-chunked-prefill", "--policy", "static",
                              "--kv-cache-memory", "64MiB", "--slo-tpot-ms", "40", "--dequantize-weights"])
    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert config.scheduler == SchedulerConfig("static", 3, SchedulerConfig.max_num_batched_tokens, False, 40.0)
    assert config.kv_cache_memory == "64MiB" and config.dequantize_weights
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float16"])  # the dataclass's choices


def test_a_command_may_override_a_default_for_itself_only() -> None:
    parser = argparse.ArgumentParser()
    add_config_args(parser, CompareConfig, only=("max_num_seqs", "block_size"), defaults={"block_size": 8})
    args = parser.parse_args([])
    assert (args.max_num_seqs, args.block_size) == (CompareConfig.max_num_seqs, 8)
    assert CompareConfig.block_size == EngineConfig.block_size  # the benchmark restates no engine default
    assert {f.name for f in dataclasses.fields(CompareConfig)} >= {"kv_cache_memory", "dtype"}


def test_a_number_of_tokens_as_vllm_writes_it() -> None:
    from conveyor.options import token_count

    import argparse

    import pytest

    assert [token_count(t) for t in ("4096", "4k", "4K", "1.5k", "32K", "1m", "1.001k")] == [
        4096, 4000, 4096, 1500, 32768, 10**6, 1001]
    for bad in ("infk", "1e400k", "1.0001k", "-4k", "4kb", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"got '{bad}'"):
            token_count(bad)


def test_a_kv_cache_size_as_vllm_and_conveyor_write_it() -> None:
    """vLLM's --kv-cache-memory-bytes: one letter, lowercase decimal and uppercase binary; conveyor's
    own units stay as they were (any case)."""
    from conveyor.config import parse_memory
    from conveyor.errors import ConfigError

    assert [parse_memory(v) for v in ("2G", "2g", "512M", "1.5k", "2GiB", "2gib", "1.5GB", "4096", 7)] == [
        2 * 2**30, 2 * 10**9, 512 * 2**20, 1500, 2 * 2**30, 2 * 2**30, 1.5e9, 4096, 7]
    for bad in ("2x", "G", "2 Gigs", "-1G"):
        with pytest.raises(ConfigError, match="cannot read memory size"):
            parse_memory(bad)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)  # vLLM's flags with conveyor's
    assert parser.parse_args(["--kv-cache-memory-bytes", "2G"]).kv_cache_memory == "2G"
    assert EngineConfig.from_kwargs(kv_cache_memory_bytes=2**30).kv_cache_memory == 2**30  # LLM(...) takes it too
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes .vLLM's name. and kv_cache_memory disagree"):
        EngineConfig.from_kwargs(kv_cache_memory_bytes="1G", kv_cache_memory="2G")
    assert EngineConfig.from_kwargs(kv_cache_memory_bytes=2**30, kv_cache_memory="1GiB").kv_cache_memory == "1GiB"
    assert EngineConfig.from_kwargs(kv_cache_memory_bytes=None).kv_cache_memory == EngineConfig.kv_cache_memory
