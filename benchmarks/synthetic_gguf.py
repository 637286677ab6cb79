"""A random-weight GGUF with the shape of a larger Qwen2.5 model, for measuring memory, start-up and
speed where no real file of that size can be had (no model hub here): the architecture, tensor names,
shapes and quantisation recipe of the real file, the 0.5B's vocabulary, merges and chat template, and
random weights. Written as F16, then quantised by llama.cpp's own `llama-quantize` (from
benchmarks/peers/llama_cpp.sh --setup-only), so the types per tensor are the ones a Q4_K_M (or any)
file of that model gets. Outputs are noise: only bytes, shapes and time mean anything.

    .venv/bin/python benchmarks/synthetic_gguf.py --shape qwen2.5-1.5b --type Q4_K_M out/qwen2.5-1.5b-random-q4_k_m.gguf
    .venv/bin/python benchmarks/synthetic_gguf.py --shape qwen2.5-7b --type Q4_K_M out/qwen2.5-7b-random-q4_k_m.gguf
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

ROOT = Path(__file__).resolve().parent.parent
LLAMA_QUANTIZE = ROOT / "benchmarks/peers/.llama-cpp/build/bin/llama-quantize"


@dataclass(frozen=True)
class Shape:
    """A Qwen2.5 model's dimensions, from its config.json."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    tied: bool


SHAPES = {
    "qwen2.5-1.5b": Shape(layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2, tied=True),
    "qwen2.5-3b": Shape(layers=36, hidden=2048, intermediate=11008, heads=16, kv_heads=2, tied=True),
    "qwen2.5-7b": Shape(layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4, tied=False),
}
SHAPE_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
              "attention.head_count_kv")


def tensors(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF tensor names and (rows, columns) shapes of a qwen2 model, in llama.cpp's order."""
    head = shape.hidden // shape.heads
    kv = shape.kv_heads * head
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, shape.hidden))]
    for i in range(shape.layers):
        b = f"blk.{i}"
        out += [(f"{b}.attn_norm.weight", (shape.hidden,)),
                (f"{b}.attn_q.weight", (shape.hidden, shape.hidden)), (f"{b}.attn_q.bias", (shape.hidden,)),
                (f"{b}.attn_k.weight", (kv, shape.hidden)), (f"{b}.attn_k.bias", (kv,)),
                (f"{b}.attn_v.weight", (kv, shape.hidden)), (f"{b}.attn_v.bias", (kv,)),
                (f"{b}.attn_output.weight", (shape.hidden, shape.hidden)),
                (f"{b}.ffn_norm.weight", (shape.hidden,)),
                (f"{b}.ffn_gate.weight", (shape.intermediate, shape.hidden)),
                (f"{b}.ffn_up.weight", (shape.intermediate, shape.hidden)),
                (f"{b}.ffn_down.weight", (shape.hidden, shape.intermediate))]
    out.append(("output_norm.weight", (shape.hidden,)))
    if not shape.tied:
        out.append(("output.weight", (vocab, shape.hidden)))
    return out


def random_tensor(rng: np.random.Generator, name: str, dims: tuple[int, ...], hidden: int) -> np.ndarray:
    """Norms 1, biases 0, matrices N(0, 1/fan_in): activations stay in range through every layer."""
    if name.endswith("norm.weight"):
        return np.ones(dims, dtype=np.float32)
    if name.endswith(".bias"):
        return np.zeros(dims, dtype=np.float32)
    out = np.empty(dims, dtype=np.float16)
    step = max(1, (1 << 24) // dims[1])
    scale = 1.0 / np.sqrt(dims[1] if name != "token_embd.weight" else hidden)
    for start in range(0, dims[0], step):
        rows = out[start:start + step]
        rows[...] = rng.standard_normal(rows.shape, dtype=np.float32) * scale
    return out


def copy_metadata(writer: GGUFWriter, source: GGUFReader, arch: str) -> None:
    """The source file's keys (vocabulary, merges, chat template, RoPE, norms) but the shape's."""
    for name, field in source.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in (f"{arch}.{k}" for k in SHAPE_KEYS):
            continue
        if name.startswith("general.") and name not in ("general.alignment",):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)


def write_f16(path: Path, shape: Shape, source_path: Path, seed: int) -> None:
    source = GGUFReader(source_path)
    arch = "qwen2"
    if bytes(source.fields["general.architecture"].parts[-1]).decode() != arch:
        raise SystemExit(f"{source_path} is not a qwen2 GGUF")
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"random-weight {path.stem}")
    writer.add_file_type(1)  # mostly F16
    for key, value in zip(SHAPE_KEYS, (shape.layers, shape.hidden, shape.intermediate, shape.heads, shape.kv_heads)):
        writer.add_uint32(f"{arch}.{key}", value)
    copy_metadata(writer, source, arch)
    plan = tensors(shape, vocab)
    for name, dims in plan:
        f16 = len(dims) == 2
        itemsize = 2 if f16 else 4
        writer.add_tensor_info(name, dims, np.dtype(np.float16 if f16 else np.float32), int(np.prod(dims)) * itemsize,
                               raw_dtype=GGMLQuantizationType.F16 if f16 else GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims in plan:
        writer.write_tensor_data(random_tensor(rng, name, dims, shape.hidden))
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--type", default="Q4_K_M", help="llama-quantize's file type (F16 keeps the written file)")
    ap.add_argument("--vocabulary-from", default="qwen2.5-coder-0.5b",
                    help="a qwen2 GGUF (a model name or path) whose tokenizer and template are copied")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from conveyor.model.loader import resolve_model_path

    source = resolve_model_path(args.vocabulary_from)
    if source.is_dir():
        source = next(source.glob("*.gguf"))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    f16 = args.output if args.type == "F16" else args.output.with_suffix(".f16.gguf")
    started = time.monotonic()
    print(f"writing {args.shape} with random F16 weights to {f16} (vocabulary from {source})", flush=True)
    write_f16(f16, SHAPES[args.shape], source, args.seed)
    print(f"  {f16.stat().st_size / 2**30:.2f} GiB in {time.monotonic() - started:.0f} s", flush=True)
    if args.type == "F16":
        return
    if not LLAMA_QUANTIZE.exists():
        raise SystemExit(f"{LLAMA_QUANTIZE} is missing: run benchmarks/peers/llama_cpp.sh --setup-only")
    print(f"quantizing to {args.type} with llama-quantize", flush=True)
    subprocess.run([str(LLAMA_QUANTIZE), str(f16), str(args.output), args.type], check=True,
                   stdout=subprocess.DEVNULL)
    f16.unlink()
    print(f"  {args.output}: {args.output.stat().st_size / 2**30:.2f} GiB, {time.monotonic() - started:.0f} s in all")


if __name__ == "__main__":
    sys.exit(main())
