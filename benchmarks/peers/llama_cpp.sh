#!/usr/bin/env bash
# llama.cpp's own C++ server (`llama-server`: slots, continuous batching, a per-slot prompt cache on
# by default) against conveyor's server, on the same GGUF file, both driven by exactly the same
# `conveyor bench serve` command (same seeded requests: token-id prompts, output lengths, EOS
# ignored, greedy, same arrivals). Optional: nothing in the package or the tests depends on it.
#
#   benchmarks/peers/llama_cpp.sh                                   # chat, 32 prompts, 32 slots
#   benchmarks/peers/llama_cpp.sh --dataset prefix --num-prompts 64 --request-rate 2 --slots 32
#   benchmarks/peers/llama_cpp.sh --model gemma3-270m --slots 1 --num-prompts 8
#   benchmarks/peers/llama_cpp.sh --model gemma3-270m --slots 1 --num-prompts 8 --max-concurrency 1 --rounds 5
#   benchmarks/peers/llama_cpp.sh --model qwen2.5-coder-0.5b --quality
#
# By default (one round) llama-server is started, warmed up, benchmarked and stopped, then conveyor's
# server likewise, so the two measurements are a minute or more apart. With --rounds N (N > 1) both
# servers are started once (llama-server first, then conveyor, each waited for and warmed up) and
# stay up for N rounds of the same benchmark, back to back, the order alternating (round 1
# llama.cpp then conveyor, round 2 conveyor then llama.cpp, ...) so that the machine's drift hits
# both alike; it then prints each round's output tok/s and conveyor/llama.cpp ratio, their
# min/median/max, and the full table for the median round (the lower middle one for even N).
# While one server is benchmarked the other sits idle: it holds its memory (both must fit at once)
# but takes no CPU, since neither server does background work while it has no request.
# Round I draws its requests with seed SEED + I - 1 (both servers get the same ones within a round),
# so no round finds an earlier round's prompts in either server's cache.
#
# Options (or the environment variable in brackets):
#   --model M              [MODEL=smollm2-135m] a conveyor model name or a .gguf path; both servers
#                          read the same file
#   --dataset D            [DATASET=chat] any `conveyor bench serve` dataset
#   --num-prompts N        [NUM_PROMPTS=32]
#   --request-rate R       [REQUEST_RATE=inf] requests/s (Poisson), inf = all at once
#   --max-concurrency C    [MAX_CONCURRENCY=] most requests in flight (default: no cap)
#   --slots S              [SLOTS=32] llama-server --parallel, and conveyor's --max-num-seqs
#   --ctx-per-slot T       [CTX_PER_SLOT=2048] llama-server gets -c SLOTS*T; a request longer than T
#                          is cut short by llama-server without an error, so size T from the
#                          workload (the table below checks every request's output length)
#   --seed S               [SEED=0]
#   --out-dir DIR          [OUT_DIR=out/peers/llama_cpp] result JSON and text files, server logs
#   --only llama|conveyor  [ONLY=] run one side (the table needs both result files in OUT_DIR); not
#                          with --rounds above 1
#   --rounds N             [ROUNDS=1] N > 1: both servers up at once, N rounds alternating which goes
#                          first (above); results in OUT_DIR/llama-I.json, conveyor-I.json and the
#                          same .txt for round I (one round: llama.json, conveyor.json, .txt)
#   --quality              no servers: what each one's fast arithmetic costs in accuracy, on the same
#                          file and texts. conveyor: `conveyor bench quality` (int8 activations and a
#                          float16 KV cache against fp32 activations with an fp32 cache; 4,096
#                          positions of each text, windows of 512). llama.cpp: llama-perplexity
#                          --kl-divergence, its default path (int8 activations, Q8_0/Q8_1/Q8_K as
#                          the weight's block type asks, a float16 cache) against the same weights
#                          dequantized to F32 (llama-quantize --allow-requantize ... F32: fp32
#                          products) with an F32 cache; 16 windows of 512, the second half of each
#                          scored (4,096 positions). Both texts come from conveyor.bench.quality.
#                          Prints each side's perplexity ratio and top-1 agreement ("Same top p").
#                          Needs free disk for the F32 copy and the logits (~2 GB for a 262k vocabulary)
#   --setup-only           build llama.cpp's tools, then stop
#   -- ARGS...             passed to both `conveyor bench serve` runs
# Also: LLAMA_DIR (default benchmarks/peers/.llama-cpp: the source and the build, ~20 min on two
# cores the first time, reused after), CONVEYOR_PY (default .venv/bin/python), LLAMA_PORT=8111,
# CONVEYOR_PORT=8112, THREADS=2, KV_CACHE_GIB=1 (conveyor), CONVEYOR_EXTRA_ARGS, LLAMA_EXTRA_ARGS.
#
# Where llama.cpp comes from: the PyPI source distribution of llama-cpp-python 0.3.36 vendors
# llama.cpp (commit 0c1e57098) under vendor/llama.cpp; only llama-server, llama-bench,
# llama-perplexity and llama-quantize are built, with the web UI and network features off (the
# build would otherwise try to download the UI).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)

MODEL=${MODEL:-smollm2-135m}
DATASET=${DATASET:-chat}
NUM_PROMPTS=${NUM_PROMPTS:-32}
REQUEST_RATE=${REQUEST_RATE:-inf}
MAX_CONCURRENCY=${MAX_CONCURRENCY:-}
SLOTS=${SLOTS:-32}
CTX_PER_SLOT=${CTX_PER_SLOT:-2048}
SEED=${SEED:-0}
OUT_DIR=${OUT_DIR:-$ROOT/out/peers/llama_cpp}
ONLY=${ONLY:-}
ROUNDS=${ROUNDS:-1}
SETUP_ONLY=0
QUALITY=0
BENCH_EXTRA=()

LLAMA_CPP_PYTHON_VERSION=0.3.36
LLAMA_COMMIT=0c1e57098
LLAMA_DIR=${LLAMA_DIR:-$HERE/.llama-cpp}
CONVEYOR_PY=${CONVEYOR_PY:-$ROOT/.venv/bin/python}
LLAMA_PORT=${LLAMA_PORT:-8111}
CONVEYOR_PORT=${CONVEYOR_PORT:-8112}
THREADS=${THREADS:-2}
KV_CACHE_GIB=${KV_CACHE_GIB:-1}
CONVEYOR_EXTRA_ARGS=${CONVEYOR_EXTRA_ARGS:-}
LLAMA_EXTRA_ARGS=${LLAMA_EXTRA_ARGS:-}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --model) MODEL=$2; shift 2 ;;
        --dataset) DATASET=$2; shift 2 ;;
        --num-prompts) NUM_PROMPTS=$2; shift 2 ;;
        --request-rate) REQUEST_RATE=$2; shift 2 ;;
        --max-concurrency) MAX_CONCURRENCY=$2; shift 2 ;;
        --slots) SLOTS=$2; shift 2 ;;
        --ctx-per-slot) CTX_PER_SLOT=$2; shift 2 ;;
        --seed) SEED=$2; shift 2 ;;
        --out-dir) OUT_DIR=$2; shift 2 ;;
        --only) ONLY=$2; shift 2 ;;
        --rounds) ROUNDS=$2; shift 2 ;;
        --setup-only) SETUP_ONLY=1; shift ;;
        --quality) QUALITY=1; shift ;;
        --) shift; BENCH_EXTRA=("$@"); break ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
if [[ ! $ROUNDS =~ ^[1-9][0-9]*$ ]]; then
    echo "--rounds (ROUNDS) must be a whole number of at least 1, not '$ROUNDS'" >&2
    exit 2
fi
if ((QUALITY == 1)) && { ((ROUNDS > 1)) || [[ -n $ONLY ]]; }; then
    echo "--quality runs no servers: --rounds and --only do not apply to it" >&2
    exit 2
fi
if ((ROUNDS > 1)) && [[ -n $ONLY ]]; then
    echo "--only $ONLY runs one server, --rounds $ROUNDS alternates both: use one or the other" >&2
    exit 2
fi

log() { printf '[llama_cpp.sh %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
# shellcheck source=common.sh
source "$HERE/common.sh"

SERVER_BIN=$LLAMA_DIR/build/bin/llama-server
TOOLS=(llama-server llama-bench llama-perplexity llama-quantize)
SERVER_PGIDS=()

QUALITY_SCRATCH=()  # --quality's F32 copy and logits, gigabytes: removed however the script ends

cleanup() {
    local pgid
    for pgid in "${SERVER_PGIDS[@]}"; do stop_server "$pgid"; done
    ((${#QUALITY_SCRATCH[@]} == 0)) || rm -f "${QUALITY_SCRATCH[@]}"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- 1. llama-server from the vendored source (idempotent) ---------------------------------------
build_server() {
    local tool missing=0
    for tool in "${TOOLS[@]}"; do [[ -x $LLAMA_DIR/build/bin/$tool ]] || missing=1; done
    if ((missing == 0)); then
        log "reusing $SERVER_BIN"
        return
    fi
    mkdir -p "$LLAMA_DIR"
    local src=$LLAMA_DIR/src
    if [[ ! -f $src/CMakeLists.txt ]]; then
        log "fetching the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION source distribution from PyPI"
        local dl
        dl=$(mktemp -d)
        "$CONVEYOR_PY" -m pip download --quiet --no-deps --no-binary :all: -d "$dl" \
            "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
        tar -xzf "$dl"/llama_cpp_python-*.tar.gz -C "$dl"
        rm -rf "$src"
        mv "$dl"/llama_cpp_python-*/vendor/llama.cpp "$src"
        rm -rf "$dl"
    fi
    command -v cmake >/dev/null || { echo "cmake is needed (apt-get install cmake)" >&2; exit 1; }
    # On CPUs with Intel's AMX tiles, this tree's AMX matmul (ggml-cpu/amx/mmq.cpp) dies at its first
    # tile load with SIGILL (seen on a 2-vCPU Xeon VM, 2026-12-05: `trap invalid opcode` in
    # tinygemm_kernel_amx, one thread or two), so it is built without AMX and everything else the CPU
    # has (GCC keeps an explicit -mno-* over a later -march=native); --repack 0 at run time also avoids
    # it, but gives up the repacked AVX-512 layouts, which are faster.
    local isa_flags=""
    grep -qw amx_tile /proc/cpuinfo && isa_flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    log "building ${TOOLS[*]} (commit $LLAMA_COMMIT; 7-20 min on two cores, once)${isa_flags:+, without AMX}"
    cmake -S "$src" -B "$LLAMA_DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DCMAKE_C_FLAGS="$isa_flags" -DCMAKE_CXX_FLAGS="$isa_flags" \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_COMMIT="$LLAMA_COMMIT" >/dev/null
    cmake --build "$LLAMA_DIR/build" -j"$(nproc)" --target "${TOOLS[@]}"
    log "built ${TOOLS[*]} in $LLAMA_DIR/build/bin (prompt and generation speed: llama-bench -m FILE -t 2 -p 512 -n 64)"
}

model_file() {  # the GGUF both servers read
    if [[ -f $MODEL ]]; then
        echo "$MODEL"
    else
        "$CONVEYOR_PY" -c "import sys; from conveyor.model.loader import resolve_model_path; \
print(resolve_model_path(None if sys.argv[1] == 'smollm2-135m' else sys.argv[1]))" "$MODEL"
    fi
}

bench() {  # bench URL LABEL RESULT_JSON [extra args]: the one command both servers get
    local url=$1 label=$2 result=$3
    shift 3
    local args=(--base-url "$url" --model "$NAME" --dataset "$DATASET" --num-prompts "$NUM_PROMPTS"
                --request-rate "$REQUEST_RATE" --seed "$SEED" --label "$label" --disable-tqdm
                --vocab-size "$VOCAB" --tokenizer "$GGUF")
    [[ -n $MAX_CONCURRENCY ]] && args+=(--max-concurrency "$MAX_CONCURRENCY")
    "$CONVEYOR_PY" -m conveyor.cli bench serve "${args[@]}" "$@" --save-result "$result"
}

warm_up() {  # a few short requests, so one-off first-call costs stay out of the measurement
    "$CONVEYOR_PY" -m conveyor.cli bench serve --base-url "$1" --model "$NAME" --dataset random \
        --input-len 64 --output-len 16 --num-prompts 4 --disable-tqdm --vocab-size "$VOCAB" >/dev/null
}

start_llama() {  # start llama-server, wait until healthy, warm it up; sets LLAMA_URL, LLAMA_PGID
    local logfile=$OUT_DIR/llama-server.log
    local args=(-m "$GGUF" --alias "$NAME" --host 127.0.0.1 --port "$LLAMA_PORT" -t "$THREADS" -tb "$THREADS"
                --parallel "$SLOTS" -c $((SLOTS * CTX_PER_SLOT)) --cont-batching -b 2048 -ub 512)
    # shellcheck disable=SC2206
    args+=($LLAMA_EXTRA_ARGS)
    LLAMA_URL=http://127.0.0.1:$LLAMA_PORT
    log "starting llama.cpp: llama-server ${args[*]}"
    setsid "$SERVER_BIN" "${args[@]}" >"$logfile" 2>&1 &
    LLAMA_PGID=$!
    SERVER_PGIDS+=("$LLAMA_PGID")
    wait_healthy "$LLAMA_URL" "$LLAMA_PGID" 300 "$logfile"
    warm_up "$LLAMA_URL"
}

bench_llama() {  # bench_llama NAME: results in $OUT_DIR/NAME.json and NAME.txt
    log "benchmarking llama.cpp into $1.json (load average $(cut -d' ' -f1-3 /proc/loadavg))"
    local own=()
    # A conversation's next turn carries the tokens generated: llama-server returns them per chunk
    # (as __verbose.tokens) only when asked with these two request fields.
    [[ $DATASET == multi-turn ]] && own=(--extra-body '{"return_tokens": true, "verbose": true}')
    bench "$LLAMA_URL" llama-cpp "$OUT_DIR/$1.json" "${own[@]}" "${BENCH_EXTRA[@]}" | tee "$OUT_DIR/$1.txt"
}

stop_llama() {
    stop_server "$LLAMA_PGID"
    log "llama.cpp stopped"
}

start_conveyor() {  # start conveyor, wait until healthy, warm it up; sets CONVEYOR_URL, CONVEYOR_PGID
    local logfile=$OUT_DIR/conveyor-server.log
    local args=(serve --model "$GGUF" --served-model-name "$NAME" --host 127.0.0.1 --port "$CONVEYOR_PORT"
                --max-num-seqs "$SLOTS" --kv-cache-memory "${KV_CACHE_GIB}GiB" --num-threads "$THREADS"
                --max-waiting-requests 100000 --log-level warning)
    # shellcheck disable=SC2206
    args+=($CONVEYOR_EXTRA_ARGS)
    CONVEYOR_URL=http://127.0.0.1:$CONVEYOR_PORT
    log "starting conveyor: conveyor ${args[*]}"
    setsid "$CONVEYOR_PY" -m conveyor.cli "${args[@]}" >"$logfile" 2>&1 &
    CONVEYOR_PGID=$!
    SERVER_PGIDS+=("$CONVEYOR_PGID")
    wait_healthy "$CONVEYOR_URL" "$CONVEYOR_PGID" 600 "$logfile"
    warm_up "$CONVEYOR_URL"
}

bench_conveyor() {  # bench_conveyor NAME: results in $OUT_DIR/NAME.json and NAME.txt
    log "benchmarking conveyor into $1.json (load average $(cut -d' ' -f1-3 /proc/loadavg))"
    bench "$CONVEYOR_URL" conveyor "$OUT_DIR/$1.json" "${BENCH_EXTRA[@]}" | tee "$OUT_DIR/$1.txt"
}

stop_conveyor() {
    stop_server "$CONVEYOR_PGID"
    log "conveyor stopped"
}

quality() {  # both sides' fast path against their own fp32 path, on the same texts (--quality above)
    local dir=$OUT_DIR/quality bin=$LLAMA_DIR/build/bin text
    mkdir -p "$dir"
    QUALITY_SCRATCH=("$dir/f32.gguf" "$dir/code.kld" "$dir/prose.kld")
    "$CONVEYOR_PY" -c "import sys; from conveyor.bench.quality import code_text, prose_text; \
open(sys.argv[1], 'w').write(code_text()); open(sys.argv[2], 'w').write(prose_text())" "$dir/code.txt" "$dir/prose.txt"
    log "llama.cpp's fp32 path: $GGUF dequantized to F32 ($dir/f32.gguf, removed afterwards)"
    "$bin/llama-quantize" --allow-requantize "$GGUF" "$dir/f32.gguf" F32 >"$dir/quantize.log" 2>&1
    for text in code prose; do
        log "llama.cpp, $text: the F32 copy's logits, then the file's own path against them"
        "$bin/llama-perplexity" -m "$dir/f32.gguf" -f "$dir/$text.txt" -c 512 --chunks 16 -t "$THREADS" \
            -ctk f32 -ctv f32 --kl-divergence-base "$dir/$text.kld" >"$dir/llama-base-$text.log" 2>&1
        "$bin/llama-perplexity" -m "$GGUF" -f "$dir/$text.txt" -t "$THREADS" \
            --kl-divergence-base "$dir/$text.kld" --kl-divergence >"$dir/llama-$text.log" 2>&1
        rm -f "$dir/$text.kld"
    done
    rm -f "${QUALITY_SCRATCH[@]}"
    log "conveyor: conveyor bench quality --model $GGUF"
    "$CONVEYOR_PY" -m conveyor.cli bench quality --model "$GGUF" --num-threads "$THREADS" | tee "$dir/conveyor.txt"
    "$CONVEYOR_PY" - "$dir" <<'PYEOF'
import re, sys
from pathlib import Path
d = Path(sys.argv[1])
ours = [line.split() for line in (d / "conveyor.txt").read_text().splitlines()
        if line.startswith(("code", "prose"))]
print(f"\n{'text':<6} {'conveyor ppl ratio':>18} {'top-1':>7}   {'llama.cpp ppl ratio':>19} {'top-1':>16}")
for text, row in zip(("code", "prose"), ours):
    log = (d / f"llama-{text}.log").read_text()
    ratio = re.search(r"Mean PPL\(Q\)/PPL\(base\)\s*:\s*([\d.]+)", log).group(1)
    same = re.search(r"Same top p:\s*([\d.]+ ± [\d.]+)", log).group(1)
    print(f"{text:<6} {float(row[-2]):>18.4f} {100 * float(row[-1]):>6.2f}%   {float(ratio):>19.4f} {same + ' %':>16}")
PYEOF
}

build_server
if [[ $SETUP_ONLY == 1 ]]; then
    log "setup done"
    exit 0
fi
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
GGUF=$(model_file)
NAME=$(basename "$GGUF" .gguf)
[[ $MODEL == smollm2-135m ]] && NAME=smollm2-135m
if [[ $QUALITY == 1 ]]; then
    quality
    exit 0
fi
VOCAB=$("$CONVEYOR_PY" -c "import sys; from conveyor.model.gguf_loader import read_gguf; \
print(len(read_gguf(sys.argv[1]).metadata['tokenizer.ggml.tokens']))" "$GGUF")
log "model $GGUF ($VOCAB tokens); workload: $DATASET, $NUM_PROMPTS prompts, rate $REQUEST_RATE, $SLOTS slots," \
    "$CTX_PER_SLOT tokens a slot, $THREADS threads"
if ((ROUNDS == 1)); then  # one server at a time, as always
    if [[ -z $ONLY || $ONLY == llama ]]; then
        start_llama
        bench_llama llama
        stop_llama
    fi
    if [[ -z $ONLY || $ONLY == conveyor ]]; then
        start_conveyor
        bench_conveyor conveyor
        stop_conveyor
    fi
    echo
    echo "===== llama.cpp ($LLAMA_COMMIT) ====="
    cat "$OUT_DIR/llama.txt"
    echo "===== conveyor ====="
    cat "$OUT_DIR/conveyor.txt"
    ratio_table "$CONVEYOR_PY" "$OUT_DIR/conveyor.json" "$OUT_DIR/llama.json" "llama.cpp"
    exit 0
fi

# --rounds N > 1: both servers up, the order alternating from round to round
start_llama
start_conveyor
alternate_rounds bench_llama llama llama.cpp
stop_conveyor
stop_llama
print_rounds llama "llama.cpp" "llama.cpp $LLAMA_COMMIT"
