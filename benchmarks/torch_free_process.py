"""One process through conveyor.engine on SmolLM2-135M (footprint.py's 4 x 1,024 tokens of KV, 2
threads): whether torch was imported, VmRSS after the load and after 3 short greedy requests, their
tokens, and single-stream decode tokens/s (one request alone, its steps after the first token). Runs
on any tree, so two can be compared one after the other:

    PYTHONPATH=<tree> python benchmarks/torch_free_process.py [--decode-tokens 256]
    ACT=float32 PYTHONPATH=<tree> python benchmarks/torch_free_process.py   # exact activations
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path


def vmrss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--decode-tokens", type=int, default=256)
    args = p.parse_args()
    out: dict = {"start_mib": vmrss_mib()}
    from conveyor.config import EngineConfig
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.model.loader import resolve_model_path
    from conveyor.sampling.params import SamplingParams

    path = resolve_model_path("smollm2-135m")
    # benchmarks/footprint.py's settings: 4 slots x 1,024 tokens of context, 2 threads
    engine = LLMEngine.from_config(EngineConfig.from_kwargs(model=str(path), num_kv_blocks=256, max_num_seqs=4,
                                                            num_threads=2, activation_dtype=os.environ.get("ACT", "int8")))
    out["after_load_mib"] = vmrss_mib()
    tok = engine.tokenizer
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

    def run(prompt: str, params: SamplingParams) -> tuple[list[int], float]:
        rid = engine.add_request(tok.encode(prompt), params)
        tokens: list[int] = []
        first = None
        while engine.has_unfinished_requests:
            for o in engine.step():
                if o.request_id == rid:
                    tokens += o.new_token_ids
                    if first is None and tokens:
                        first = time.perf_counter()
        return tokens, (time.perf_counter() - first) if first else 0.0

    short = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    out["greedy_tokens"] = {}
    for prompt in short:
        tokens, _ = run(prompt, greedy)
        out["greedy_tokens"][prompt] = tokens
    out["after_3_requests_mib"] = vmrss_mib()
    out["torch_imported"] = "torch" in sys.modules
    # single-stream decode: one request alone, its decode steps after the first token
    n = args.decode_tokens
    tokens, seconds = run("Write a long story about a lighthouse keeper.",
                          SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    out["decode_tokens"] = len(tokens)
    out["decode_tok_s"] = (len(tokens) - 1) / seconds
    out["torch_imported_at_end"] = "torch" in sys.modules
    print(json.dumps(out))


if __name__ == "__main__":
    main()
