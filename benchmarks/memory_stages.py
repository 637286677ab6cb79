"""Where a conveyor process's resident memory goes, stage by stage, beside llama-server's whole
process on the same GGUF file with the same context capacity (benchmarks/footprint.py's settings):
the interpreter, conveyor's serving layers (api, engine, scheduler, kv), the loaded model (its
weights and tokenizer: the model, kernels and runner are numpy, no torch), the KV pool with the
engine, a few requests served, and SLOTS long prompts at once (footprint.py's full-budget prefill).
Then whether torch was imported by the end (a serving process imports none: "yes" is a
regression), and the process against llama-server's after the same 3 requests and after the same
long prompts.

    .venv/bin/python benchmarks/memory_stages.py --model smollm2-135m
    .venv/bin/python benchmarks/memory_stages.py --model gemma3-270m --slots 4 --ctx-per-slot 1024

The stages run in this process, in order, through the library (LLMEngine, no HTTP server; the
server's own modules are imported at the second stage); each figure is VmRSS after it. The
tokenizer's share is measured apart, before the load: a copy built from the file's metadata (the
load then builds its own). llama-server (benchmarks/peers/llama_cpp.sh --setup-only) runs after
the stages in a process of its own (this one idle beside it), measured as footprint.py measures
it; without it only conveyor's stages print.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20


def resident() -> int:
    # Not footprint.status: importing footprint first (urllib, ssl) would move the first stage.
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a conveyor model name or a .gguf path")
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--ctx-per-slot", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out-dir", default="out/footprint")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    stages: list[tuple[str, int]] = []
    torch_from: list[str] = []  # the first stage after which torch was in the process, if any

    def stage(name: str) -> None:
        stages.append((name, resident()))
        if not torch_from and "torch" in sys.modules:
            torch_from.append(name)

    stage("python interpreter")
    import conveyor.api.server  # noqa: F401 - the serving layers: api, engine, scheduler, kv

    stage("+ conveyor's serving layers")
    from conveyor.config import EngineConfig
    from conveyor.engine.llm import LLM
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.model.gguf_loader import read_gguf
    from conveyor.model.loader import resolve_model_path
    from conveyor.model.memory import return_freed_memory
    from conveyor.model.tokenizer import Tokenizer
    from conveyor.runner.model_runner import kv_block_bytes, kv_cache_dtype, load_model, model_bytes
    from conveyor.sampling.params import SamplingParams

    path = resolve_model_path(args.model)
    if not path.is_file():
        p.error(f"{path} is not a GGUF file")
    tokens = args.slots * args.ctx_per_slot
    num_blocks = tokens // 16
    config = EngineConfig.from_kwargs(model=str(path), num_kv_blocks=num_blocks, max_num_seqs=args.slots,
                                      num_threads=args.threads)
    # The tokenizer's share, measured alone before the load (the load builds its own copy).
    before = resident()
    spare = Tokenizer.from_gguf(read_gguf(path).metadata)
    gc.collect()
    return_freed_memory()
    tokenizer = resident() - before
    del spare
    gc.collect()
    return_freed_memory()
    loaded = load_model(config)
    weights = model_bytes(loaded.model)
    stage("+ model loaded (weights, tokenizer)")
    engine = LLMEngine.from_config(config, loaded)
    kv_dtype = kv_cache_dtype(config.kv_cache_dtype, config.dtype)
    kv = num_blocks * kv_block_bytes(loaded.model.cfg, config.block_size, kv_dtype)
    stage("+ KV pool and engine")
    from footprint import LLAMA_SERVER, SHORT_PROMPT, llama_server_cmd, long_prompt, measure

    llm = LLM.from_engine(engine)
    for _ in range(3):  # footprint.py's requests
        llm.generate([SHORT_PROMPT], SamplingParams(max_tokens=64, temperature=0))
    stage("+ 3 requests served")
    text = long_prompt(str(path), args.ctx_per_slot)  # footprint.py's full-budget prefill
    llm.generate([f"# {i}\n{text}" for i in range(args.slots)], SamplingParams(max_tokens=16, temperature=0))
    stage(f"+ {args.slots} long prompts at once")

    print(f"{path.name}: {args.slots} x {args.ctx_per_slot} tokens of context, {args.threads} threads")
    print(f"{'stage':<44} {'resident MiB':>12} {'added':>8}")
    last = 0
    for name, rss in stages:
        print(f"{name:<44} {rss / MIB:>12.1f} {(rss - last) / MIB:>8.1f}")
        last = rss
    final, loaded_final = stages[-2][1], stages[-1][1]
    print(f"of which: weights {weights / MIB:.1f} MiB, KV pool {kv / MIB:.1f} MiB (mapped as its blocks are written), "
          f"tokenizer {tokenizer / MIB:.1f} MiB")
    print("torch imported by the end: " + (f"YES, from the stage '{torch_from[0]}' on (it must not be)" if torch_from
                                            else "no"))
    del llm, engine, loaded
    gc.collect()
    if not LLAMA_SERVER.is_file():
        print("llama-server not built (benchmarks/peers/llama_cpp.sh --setup-only): no comparison")
        return 0
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    time.sleep(1)
    peer = measure(llama_server_cmd(path, 8132, args.threads, args.slots, tokens), 8132,
                   out_dir / "llama.cpp stages.log", text, args.slots)
    for when, ours, theirs in (("after 3 requests", final, peer["rss_gib"] * 2**30),
                               ("after the long prompts", loaded_final, peer["loaded_rss_gib"] * 2**30)):
        print(f"{when}: llama-server resident {theirs / MIB:.1f} MiB: conveyor {ours / MIB:.1f} MiB, "
              f"{ours / theirs:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
