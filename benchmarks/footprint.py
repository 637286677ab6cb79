"""Memory and start-up of a serving process, conveyor's next to llama-server's, on the same GGUF file
with the same context capacity: resident memory while serving (VmRSS after a few requests), the
peak (VmHWM, loading included), both again after SLOTS prompts of ~80% of a slot sent at once (a
full-budget prefill, whose working set a server keeps for the next), and seconds from the command
to a ready /health; and the bytes a conveyor decode step streams
(conveyor.bench.roofline.model_costs) against the file's tensor bytes.

    .venv/bin/python benchmarks/footprint.py --model qwen2.5-coder-0.5b
    .venv/bin/python benchmarks/footprint.py --model gemma3-270m --slots 4 --ctx-per-slot 1024 --repeats 3
    .venv/bin/python benchmarks/footprint.py --model out/qwen-bf16 --also-dequantized --repeats 3
    .venv/bin/python benchmarks/footprint.py --model out/qwen2.5-1.5b-random-q4_k_m.gguf --also-no-mmap --repeats 3

Both servers get room for SLOTS x CTX tokens: llama-server `-c SLOTS*CTX --parallel SLOTS` (its f16
KV cache), conveyor `--num-kv-blocks SLOTS*CTX/16 --max-num-seqs SLOTS` (its default float16 KV cache). The servers run
one after the other, each alone on the machine. llama-server comes from benchmarks/peers/llama_cpp.sh
(`--setup-only` builds it); without it, or for an HF folder, only conveyor is measured.
The table splits resident memory into anonymous memory and mapped file pages (code, and a mapped
file's pages: llama-server's weights by default; an untied embedding's rows looked up, conveyor's).
`--also-no-mmap` adds llama-server with `--load-mode none` (its `--no-mmap`). `--also-defaults` adds
both servers as a user first starts them, with the model and threads only (conveyor's 1 GiB KV pool,
llama-server's default context). `--also-whole-context-kv`
adds conveyor with `--no-window-kv-pool` (a model's sliding-window layers keeping the whole context's
KV, as before). `--also-dequantized` adds conveyor serving the same file with `--dequantize-weights`
(fp32 copies of every weight: how a GGUF's blocks and an HF folder's bf16 / f16 matrices were held
before they stayed in their own form). `--no-long-prompts` skips the long prompts (minutes of
prefill at tens of thousands of tokens a slot).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA_SERVER = ROOT / "benchmarks/peers/.llama-cpp/build/bin/llama-server"
PROMPT_UNIT = "def quicksort(items):\n    "
SHORT_PROMPT = PROMPT_UNIT * 40  # a few hundred tokens of prefill, then decode


def llama_server_cmd(model: Path, port: int, threads: int, slots: int, tokens: int) -> list[str]:
    """llama-server with room for `tokens` of context over `slots` slots, as conveyor gets it."""
    return [str(LLAMA_SERVER), "-m", str(model), "--port", str(port), "--host", "127.0.0.1", "-t", str(threads),
            "-tb", str(threads), "--parallel", str(slots), "-c", str(tokens), "--cont-batching"]


def status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:", "RssAnon:", "RssFile:")):
            out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def post(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError("server not ready")


@contextmanager
def serving(cmd: list[str], port: int, log: Path) -> Iterator[tuple[subprocess.Popen, float]]:
    """A server started from `cmd` (its output to `log`), once it answers on `port`: (the process,
    seconds from start to ready); stopped with its process group when the block ends."""
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(port, proc, 600)
        yield proc, time.monotonic() - started
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def long_prompt(model: str, ctx_per_slot: int) -> str:
    """A prompt filling ~80% of a slot: SLOTS of them at once are a full-budget prefill."""
    sys.path.insert(0, str(ROOT))
    from conveyor.model.loader import load_tokenizer

    return PROMPT_UNIT * int(0.8 * ctx_per_slot / len(load_tokenizer(model).encode(PROMPT_UNIT * 10)) * 10)


def measure(cmd: list[str], port: int, log: Path, long_prompt: str | None = None, slots: int = 4) -> dict[str, float]:
    """Ready time and memory once ready (idle), then after three short requests; with `long_prompt`,
    again after `slots` of them sent at once (a full-budget prefill's working set, which the process
    then keeps)."""
    with serving(cmd, port, log) as (proc, ready):
        idle = status(proc.pid)["VmRSS"] / 2**30
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
            model = json.loads(r.read())["data"][0]["id"]
        for _ in range(3):
            post(port, {"model": model, "prompt": SHORT_PROMPT, "max_tokens": 64, "temperature": 0})
        mem = status(proc.pid)
        result = {"ready_s": ready, "idle_gib": idle, "rss_gib": mem["VmRSS"] / 2**30, "peak_gib": mem["VmHWM"] / 2**30,
                  "anon_gib": mem["RssAnon"] / 2**30, "file_gib": mem["RssFile"] / 2**30}
        if long_prompt is not None:
            bodies = [{"model": model, "prompt": f"# {i}\n{long_prompt}", "max_tokens": 16, "temperature": 0}
                      for i in range(slots)]
            with ThreadPoolExecutor(slots) as pool:
                list(pool.map(lambda body: post(port, body), bodies))
            mem = status(proc.pid)
            result |= {"loaded_rss_gib": mem["VmRSS"] / 2**30, "loaded_peak_gib": mem["VmHWM"] / 2**30}
        return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="a conveyor model name, a .gguf path or an HF folder")
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--ctx-per-slot", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out-dir", default="out/footprint")
    p.add_argument("--also-dequantized", action="store_true", help="conveyor with --dequantize-weights too")
    p.add_argument("--no-long-prompts", action="store_true",
                   help="skip the SLOTS long prompts (their prefill takes minutes at tens of thousands of tokens)")
    p.add_argument("--also-whole-context-kv", action="store_true",
                   help="conveyor with --no-window-kv-pool too (sliding-window layers keep the whole context's KV)")
    p.add_argument("--also-no-mmap", action="store_true",
                   help="llama-server with --load-mode none too (weights read into its own memory, no file pages)")
    p.add_argument("--also-defaults", action="store_true",
                   help="both servers as a user first starts them too: the model and threads only, every other "
                        "setting its default (conveyor's 1 GiB KV pool, llama-server's context)")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from conveyor.model.loader import resolve_model_path

    model_path = resolve_model_path(args.model)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokens = args.slots * args.ctx_per_slot
    servers = {
        "conveyor": [sys.executable, "-m", "conveyor.cli", "serve", "--model", str(model_path), "--port", "8131",
                     "--num-kv-blocks", str(tokens // 16), "--max-num-seqs", str(args.slots),
                     "--num-threads", str(args.threads)],
    }
    if args.also_dequantized:
        servers["conveyor fp32"] = [*servers["conveyor"], "--dequantize-weights"]
    if args.also_whole_context_kv:
        servers["conveyor whole KV"] = [*servers["conveyor"], "--no-window-kv-pool"]
    if args.also_defaults:
        servers["conveyor defaults"] = [sys.executable, "-m", "conveyor.cli", "serve", "--model", str(model_path),
                                        "--port", "8131", "--num-threads", str(args.threads)]
    if LLAMA_SERVER.is_file() and model_path.is_file():
        servers["llama.cpp"] = llama_server_cmd(model_path, 8132, args.threads, args.slots, tokens)
        if args.also_no_mmap:
            servers["llama.cpp no-mmap"] = [*servers["llama.cpp"], "--load-mode", "none"]
        if args.also_defaults:
            servers["llama.cpp defaults"] = [str(LLAMA_SERVER), "-m", str(model_path), "--port", "8132",
                                             "-t", str(args.threads), "-tb", str(args.threads)]
    ports = {name: 8132 if name.startswith("llama.cpp") else 8131 for name in servers}
    prompt = None if args.no_long_prompts else long_prompt(str(model_path), args.ctx_per_slot)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
    for _ in range(args.repeats):
        for name, cmd in servers.items():
            results[name].append(measure(cmd, ports[name], out_dir / f"{name}.log", prompt, args.slots))
    print(f"{model_path.name}: {args.slots} x {args.ctx_per_slot} tokens of context, {args.threads} threads, "
          f"medians of {args.repeats}")
    print(f"{'server':<18} {'idle GiB':>9} {'resident GiB':>13} {'anon GiB':>9} {'file GiB':>9} {'peak GiB':>9} "
          f"{'ready s':>8} {'after long prompts: resident / peak GiB':>40}")
    medians = {}
    for name, runs in results.items():
        medians[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        m = medians[name]
        print(f"{name:<18} {m['idle_gib']:>9.3f} {m['rss_gib']:>13.3f} {m['anon_gib']:>9.3f} {m['file_gib']:>9.3f} "
              f"{m['peak_gib']:>9.3f} {m['ready_s']:>8.1f} " + (f"{m['loaded_rss_gib']:>31.3f} / {m['loaded_peak_gib']:.3f}"
                                            if "loaded_rss_gib" in m else f"{'-':>31}"))
    from conveyor.bench.roofline import model_costs
    from conveyor.config import EngineConfig
    from conveyor.model.gguf_loader import read_gguf
    from conveyor.runner.model_runner import load_model

    file_bytes = (sum(t.nbytes for t in read_gguf(model_path).tensors.values()) if model_path.is_file()
                  else sum(f.stat().st_size for f in model_path.glob("*.safetensors")))
    streamed, _ = model_costs(load_model(EngineConfig(model=str(model_path))).model)
    print(f"a conveyor decode step streams {streamed / 2**20:.0f} MiB: {streamed / file_bytes:.3f}x the file's "
          f"{file_bytes / 2**20:.0f} MiB of tensors (an untied embedding is read by rows)")
    if "conveyor whole KV" in medians:
        c, w = medians["conveyor"], medians["conveyor whole KV"]
        print(f"conveyor / with --no-window-kv-pool: resident {c['rss_gib'] / w['rss_gib']:.2f}x, "
              f"peak {c['peak_gib'] / w['peak_gib']:.2f}x, ready {c['ready_s'] / w['ready_s']:.2f}x")
    if "conveyor fp32" in medians:
        c, d = medians["conveyor"], medians["conveyor fp32"]
        print(f"conveyor / with --dequantize-weights: resident {c['rss_gib'] / d['rss_gib']:.2f}x, "
              f"peak {c['peak_gib'] / d['peak_gib']:.2f}x, ready {c['ready_s'] / d['ready_s']:.2f}x")
    for ours, peer in (("conveyor", "llama.cpp"), ("conveyor", "llama.cpp no-mmap"),
                       ("conveyor defaults", "llama.cpp defaults")):
        if ours in medians and peer in medians:
            c, ll = medians[ours], medians[peer]
            print(f"{ours} / {peer}: idle {c['idle_gib'] / ll['idle_gib']:.2f}x, resident {c['rss_gib'] / ll['rss_gib']:.2f}x, "
                  f"peak {c['peak_gib'] / ll['rss_gib']:.2f}x of {peer}'s resident, "
                  f"conveyor's peak / its resident {c['peak_gib'] / c['rss_gib']:.2f}x; "
                  + (f"after long prompts: resident {c['loaded_rss_gib'] / ll['loaded_rss_gib']:.2f}x"
                     if "loaded_rss_gib" in c else ""))
    (out_dir / "footprint.json").write_text(json.dumps({"model": str(model_path), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
