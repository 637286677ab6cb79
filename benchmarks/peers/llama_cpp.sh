#!/usr/bin/env bash
# llama.cpp's own C++ server (`llama-server`: slots, continuous batching, a per-slot prompt cache on
# by default) against conveyor's server, on the same GGUF file, both driven by exactly the same
# `conveyor bench serve` command (same seeded requests: token-id prompts, output lengths, EOS
# ignored, greedy, same arrivals). Optional: nothing in the package or the tests depends on it.
#
#   benchmarks/peers/llama_cpp.sh                                   # chat, 32 prompts, 32 slots
#   benchmarks/peers/llama_cpp.sh --dataset prefix --num-prompts 64 --request-rate 2 --slots 32
#   benchmarks/peers/llama_cpp.sh --model gemma3-270m --slots 1 --num-prompts 8
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
#   --out-dir DIR          [OUT_DIR=out/peers/llama_cpp] result JSON files and server logs
#   --only llama|conveyor  [ONLY=] run one side (the table needs both result files in OUT_DIR)
#   --setup-only           build llama-server, then stop
#   -- ARGS...             passed to both `conveyor bench serve` runs
# Also: LLAMA_DIR (default benchmarks/peers/.llama-cpp: the source and the build, ~20 min on two
# cores the first time, reused after), CONVEYOR_PY (default .venv/bin/python), LLAMA_PORT=8111,
# CONVEYOR_PORT=8112, THREADS=2, KV_CACHE_GIB=1 (conveyor), CONVEYOR_EXTRA_ARGS, LLAMA_EXTRA_ARGS.
#
# Where llama.cpp comes from: the PyPI source distribution of llama-cpp-python 0.3.36 vendors
# llama.cpp (commit 0c1e57098) under vendor/llama.cpp; only the server is built, with its web UI
# and network features off (the build would otherwise try to download the UI).
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
SETUP_ONLY=0
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
        --setup-only) SETUP_ONLY=1; shift ;;
        --) shift; BENCH_EXTRA=("$@"); break ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done

log() { printf '[llama_cpp.sh %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
# shellcheck source=common.sh
source "$HERE/common.sh"

SERVER_BIN=$LLAMA_DIR/build/bin/llama-server
SERVER_PGIDS=()

cleanup() {
    local pgid
    for pgid in "${SERVER_PGIDS[@]}"; do stop_server "$pgid"; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- 1. llama-server from the vendored source (idempotent) ---------------------------------------
build_server() {
    if [[ -x $SERVER_BIN ]]; then
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
    log "building llama-server (commit $LLAMA_COMMIT; ~20 min on two cores, once)"
    cmake -S "$src" -B "$LLAMA_DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_COMMIT="$LLAMA_COMMIT" >/dev/null
    cmake --build "$LLAMA_DIR/build" -j"$(nproc)" --target llama-server
    log "built $SERVER_BIN"
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
                --vocab-size "$VOCAB")
    [[ -n $MAX_CONCURRENCY ]] && args+=(--max-concurrency "$MAX_CONCURRENCY")
    "$CONVEYOR_PY" -m conveyor.cli bench serve "${args[@]}" "$@" --save-result "$result"
}

warm_up() {  # a few short requests, so one-off first-call costs stay out of the measurement
    "$CONVEYOR_PY" -m conveyor.cli bench serve --base-url "$1" --model "$NAME" --dataset random \
        --input-len 64 --output-len 16 --num-prompts 4 --disable-tqdm --vocab-size "$VOCAB" >/dev/null
}

run_llama() {
    local logfile=$OUT_DIR/llama-server.log url=http://127.0.0.1:$LLAMA_PORT pgid
    local args=(-m "$GGUF" --alias "$NAME" --host 127.0.0.1 --port "$LLAMA_PORT" -t "$THREADS" -tb "$THREADS"
                --parallel "$SLOTS" -c $((SLOTS * CTX_PER_SLOT)) --cont-batching -b 2048 -ub 512)
    # shellcheck disable=SC2206
    args+=($LLAMA_EXTRA_ARGS)
    log "starting llama.cpp: llama-server ${args[*]}"
    setsid "$SERVER_BIN" "${args[@]}" >"$logfile" 2>&1 &
    pgid=$!
    SERVER_PGIDS+=("$pgid")
    wait_healthy "$url" "$pgid" 300 "$logfile"
    warm_up "$url"
    log "benchmarking llama.cpp (load average $(cut -d' ' -f1-3 /proc/loadavg))"
    local own=()
    # A conversation's next turn carries the tokens generated: llama-server returns them per chunk
    # (as __verbose.tokens) only when asked with these two request fields.
    [[ $DATASET == multi-turn ]] && own=(--extra-body '{"return_tokens": true, "verbose": true}')
    bench "$url" llama-cpp "$OUT_DIR/llama.json" "${own[@]}" "${BENCH_EXTRA[@]}" | tee "$OUT_DIR/llama.txt"
    stop_server "$pgid"
    log "llama.cpp stopped"
}

run_conveyor() {
    local logfile=$OUT_DIR/conveyor-server.log url=http://127.0.0.1:$CONVEYOR_PORT pgid
    local args=(serve --model "$GGUF" --served-model-name "$NAME" --host 127.0.0.1 --port "$CONVEYOR_PORT"
                --max-num-seqs "$SLOTS" --kv-cache-memory "${KV_CACHE_GIB}GiB" --num-threads "$THREADS"
                --max-waiting-requests 100000 --log-level warning)
    # shellcheck disable=SC2206
    args+=($CONVEYOR_EXTRA_ARGS)
    log "starting conveyor: conveyor ${args[*]}"
    setsid "$CONVEYOR_PY" -m conveyor.cli "${args[@]}" >"$logfile" 2>&1 &
    pgid=$!
    SERVER_PGIDS+=("$pgid")
    wait_healthy "$url" "$pgid" 600 "$logfile"
    warm_up "$url"
    log "benchmarking conveyor (load average $(cut -d' ' -f1-3 /proc/loadavg))"
    bench "$url" conveyor "$OUT_DIR/conveyor.json" "${BENCH_EXTRA[@]}" | tee "$OUT_DIR/conveyor.txt"
    stop_server "$pgid"
    log "conveyor stopped"
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
VOCAB=$("$CONVEYOR_PY" -c "import sys, gguf; r = gguf.GGUFReader(sys.argv[1]); \
f = r.fields['tokenizer.ggml.tokens']; print(len(f.data))" "$GGUF")
log "model $GGUF ($VOCAB tokens); workload: $DATASET, $NUM_PROMPTS prompts, rate $REQUEST_RATE, $SLOTS slots," \
    "$CTX_PER_SLOT tokens a slot, $THREADS threads"
[[ -z $ONLY || $ONLY == llama ]] && run_llama
[[ -z $ONLY || $ONLY == conveyor ]] && run_conveyor
echo
echo "===== llama.cpp ($LLAMA_COMMIT) ====="
cat "$OUT_DIR/llama.txt"
echo "===== conveyor ====="
cat "$OUT_DIR/conveyor.txt"
ratio_table "$CONVEYOR_PY" "$OUT_DIR/conveyor.json" "$OUT_DIR/llama.json" "llama.cpp"
