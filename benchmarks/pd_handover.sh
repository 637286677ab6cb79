#!/usr/bin/env bash
# Prefill/decode disaggregation on the `prefix` workload: how much KV the handovers move, how much
# they leave out because the decode worker's prefix cache held it, and the decode worker's peak KV
# usage (sampled from /metrics every 0.5 s), beside the usual serving metrics.
#
#   benchmarks/pd_handover.sh                      # 8 groups x 8 requests, 512-token prefix, 2 req/s
#   benchmarks/pd_handover.sh --num-prompts 128 --num-groups 16 --prefix-len 1024
#   CONVEYOR_SRC=/tmp/old benchmarks/pd_handover.sh   # another revision's tree (git worktree add /tmp/old REV)
#
# Arguments go to `conveyor bench serve` after the defaults (a later one wins). Output: out/pd_handover/.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py="$root/.venv/bin/python"
src=${CONVEYOR_SRC:-$root}
port=${PORT:-8711}
out="$root/out/pd_handover"
mkdir -p "$out"
export PYTHONPATH="$src"

"$py" -m conveyor.cli serve --port "$port" --prefill-workers 1 --decode-workers 1 --num-threads 1 \
  --max-num-batched-tokens 256 > "$out/server.log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
echo "waiting for the server (Ray and two workers: a few minutes the first time)"
until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
  kill -0 $server 2>/dev/null || { echo "the server exited: $out/server.log"; exit 1; }
  sleep 1
done
(while kill -0 $server 2>/dev/null; do
   curl -s "http://127.0.0.1:$port/metrics" | awk '/^conveyor:worker_kv_cache_usage_perc.*role="decode"/ {print $2}'
   sleep 0.5
 done) > "$out/decode_kv_usage.txt" &
sampler=$!
"$py" -m conveyor.cli bench serve --base-url "http://127.0.0.1:$port" --model smollm2-135m --dataset prefix \
  --num-prompts 64 --num-groups 8 --prefix-len 512 --input-len 32 --output-len 32 --request-rate 2 --seed 0 \
  --disable-tqdm --save-result "$out/bench.json" "$@"
curl -s "http://127.0.0.1:$port/metrics" | grep -E '^conveyor:(kv_transfer|worker_prompt_tokens|worker_prefix_cache_hits)[a-z_]*_total'
kill $sampler
echo "peak decode KV usage: $(sort -g "$out/decode_kv_usage.txt" | tail -1)"
