"""What structured outputs cost a decode step, and what a grammar costs to compile.

Two engines share the model's weights and hold the same `--batch` chat requests (same prompts,
EOS ignored, so both decode at the same contexts): in engine A none is constrained, in engine B
every other one follows a JSON schema (an array of person objects with `minItems` high enough that
the grammar stays open for the whole run). Once both are past prefill their decode steps are timed
in alternating pairs (A then B, then B then A), so the machine's drift hits both alike; the figure
is the ratio of the medians. Then every schema of the test table is compiled on a cold compiler
(no cache) and the compile times are summarised.

    python benchmarks/structured_cost.py --batch 32 --steps 40
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conveyor.config import EngineConfig  # noqa: E402
from conveyor.engine.llm_engine import LLMEngine  # noqa: E402
from conveyor.runner.model_runner import load_model  # noqa: E402
import numpy as np  # noqa: E402

from conveyor.sampling import SamplingParams  # noqa: E402
from conveyor.structured.masking import apply_token_masks  # noqa: E402
from conveyor.structured.spec import GrammarSpec  # noqa: E402
from conveyor.structured.grammar import GrammarCompiler  # noqa: E402

PEOPLE = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                     "city": {"enum": ["Paris", "Oslo", "Lima", "Pune"]}},
    "required": ["name", "age", "city"], "additionalProperties": False}}
TOPICS = ["trains", "the sea", "a city at night", "mountains", "bread", "rain", "a library", "winter"]


def build(loaded, batch: int, constrained: bool, max_tokens: int) -> LLMEngine:  # noqa: ANN001
    engine = LLMEngine.from_config(EngineConfig.from_kwargs(max_num_seqs=batch, max_num_batched_tokens=8192), loaded)
    spec = GrammarSpec.json_schema(PEOPLE)
    for i in range(batch):
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"List people who like {TOPICS[i % len(TOPICS)]}, as JSON."}])
        structured = spec if constrained and i % 2 == 1 else None
        # A constrained request ends with its grammar (ignore_eos cannot hold it past that); the others run on.
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=structured is None,
                                structured=structured)
        engine.add_request(prompt, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()  # prefill (and the first token)
    return engine


def timed_step(engine: LLMEngine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def step_cost(loaded, batch: int, steps: int) -> None:  # noqa: ANN001
    plain, mixed = build(loaded, batch, False, steps * 2 + 8), build(loaded, batch, True, steps * 2 + 8)
    assert len(mixed.grammars) == batch // 2 and len(plain.grammars) == 0
    timed_step(plain), timed_step(mixed)  # warm-up
    a, b = [], []
    for i in range(steps):
        order = [(plain, a), (mixed, b)] if i % 2 == 0 else [(mixed, b), (plain, a)]
        for engine, times in order:
            times.append(timed_step(engine))
    # The work B does that A does not, timed alone (robust where whole steps are noisy).
    requests = list(mixed.scheduler.requests.values())
    start = time.perf_counter()
    for _ in range(20):
        masks = mixed.grammars.masks(requests)
    mask_ms = (time.perf_counter() - start) / 20 * 1e3
    logits = np.random.default_rng(0).standard_normal((batch, loaded.model.cfg.vocab_size), dtype=np.float32)
    start = time.perf_counter()
    for _ in range(20):
        apply_token_masks(logits, masks)
    apply_ms = (time.perf_counter() - start) / 20 * 1e3
    ma, mb = statistics.median(a), statistics.median(b)
    context = max(r.num_tokens for r in plain.scheduler.requests.values())
    print(f"batch {batch}, {steps} step pairs, contexts up to {context} tokens")
    print(f"  A unconstrained:          median {ma * 1e3:7.1f} ms  (min {min(a) * 1e3:.1f}, max {max(a) * 1e3:.1f})")
    print(f"  B half JSON-constrained:  median {mb * 1e3:7.1f} ms  (min {min(b) * 1e3:.1f}, max {max(b) * 1e3:.1f})")
    print(f"  B / A = {mb / ma:.3f} (medians), {min(b) / min(a):.3f} (minima)")
    print(f"  added work alone: masks of the {batch // 2} constrained rows {mask_ms:.2f} ms, applying them "
          f"{apply_ms:.2f} ms: {(mask_ms + apply_ms) / (min(a) * 1e3) * 100:.1f}% of the fastest A step")


def compile_cost(tokenizer) -> None:  # noqa: ANN001
    from tests.api.test_structured_outputs import SCHEMAS

    compiler = GrammarCompiler(tokenizer)
    start = time.perf_counter()
    compiler.ll_tokenizer  # noqa: B018 - built once per tokenizer, before the first grammar
    tokenizer_s = time.perf_counter() - start
    times = [compiler.compile(GrammarSpec.json_schema(schema, strict=True)).compile_s for _, schema in SCHEMAS]
    start = time.perf_counter()
    for _, schema in SCHEMAS:
        compiler.compile(GrammarSpec.json_schema(schema, strict=True))
    cached = (time.perf_counter() - start) / len(SCHEMAS)
    print(f"compile: tokenizer description {tokenizer_s * 1e3:.0f} ms once; {len(times)} schemas: median "
          f"{statistics.median(times) * 1e3:.2f} ms, max {max(times) * 1e3:.2f} ms; cached {cached * 1e6:.0f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40, help="step pairs timed")
    args = parser.parse_args()
    # On a worker thread, as the server steps its engine (an OpenMP team per stepping thread).
    with ThreadPoolExecutor(1) as pool:
        loaded = pool.submit(load_model, EngineConfig()).result()
        pool.submit(step_cost, loaded, args.batch, args.steps).result()
        pool.submit(compile_cost, loaded.tokenizer).result()


if __name__ == "__main__":
    main()
