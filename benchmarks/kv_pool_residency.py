"""Resident memory of an engine before and after a stream of requests served one at a time, with
prefix caching on or off: how much of the KV pool (mapped as its blocks are written) the traffic
leaves resident. Each request is a different 3,000-character piece of the standard library's
argparse.py (no download), 16 greedy tokens out.

    .venv/bin/python benchmarks/kv_pool_residency.py --model smollm2-135m --prefix-caching off
    .venv/bin/python benchmarks/kv_pool_residency.py --model smollm2-135m --prefix-caching on
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def resident_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prefix-caching", choices=["on", "off"], default="on")
    p.add_argument("--requests", type=int, default=33, help="pieces of argparse.py (33 of 3,000 characters cover it)")
    p.add_argument("--kv-cache-memory", default="1GiB")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from conveyor.engine.llm import LLM
    from conveyor.sampling.params import SamplingParams

    llm = LLM(args.model, enable_prefix_caching=args.prefix_caching == "on", kv_cache_memory=args.kv_cache_memory)
    text = Path(argparse.__file__).read_text()
    pieces = [f"# {i}\n{text[i * 3000:(i + 1) * 3000]}" for i in range(args.requests)]
    tokens = sum(len(llm.get_tokenizer().encode(piece)) for piece in pieces)
    before = resident_mib()
    for piece in pieces:
        llm.generate([piece], SamplingParams(max_tokens=16, temperature=0))
    print(f"{args.model}, KV pool {args.kv_cache_memory}, prefix caching {args.prefix_caching}: resident {before:.0f} MiB "
          f"once loaded, {resident_mib():.0f} MiB after {len(pieces)} requests ({tokens} prompt tokens) one at a time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
