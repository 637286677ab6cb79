# Shared by the peer scripts (vllm_cpu.sh, llama_cpp.sh): sourced, never run. They define `log`
# and SERVER_PGIDS before sourcing it.

stop_server() {  # stop_server PGID: SIGTERM the whole process group, SIGKILL after 30 s
    local pgid=$1 i
    kill -0 -- "-$pgid" 2>/dev/null || return 0
    kill -TERM -- "-$pgid" 2>/dev/null || true
    for ((i = 0; i < 60; i++)); do
        kill -0 -- "-$pgid" 2>/dev/null || return 0
        sleep 0.5
    done
    log "process group $pgid ignored SIGTERM; killing it"
    kill -KILL -- "-$pgid" 2>/dev/null || true
}

wait_healthy() {  # wait_healthy URL PGID TIMEOUT LOG
    local url=$1 pgid=$2 timeout=$3 logfile=$4 start=$SECONDS
    until curl -sf -o /dev/null "$url/health"; do
        if ! kill -0 -- "-$pgid" 2>/dev/null; then
            log "server died while starting; last lines of $logfile:"
            tail -n 40 "$logfile" >&2
            return 1
        fi
        if ((SECONDS - start > timeout)); then
            log "server not healthy after ${timeout}s; last lines of $logfile:"
            tail -n 40 "$logfile" >&2
            return 1
        fi
        sleep 1
    done
    log "healthy after $((SECONDS - start)) s: $url"
}

ratio_table() {  # ratio_table PY OURS_JSON THEIRS_JSON PEER_LABEL: the two `bench serve` results side by side
    "$1" - "$2" "$3" "$4" <<'PYEOF'
import json, sys
ours, theirs = (json.load(open(p)) for p in sys.argv[1:3])
peer = sys.argv[3]
rows = [  # key, label, higher is better
    ("output_throughput", "output tok/s", True),
    ("request_throughput", "requests/s", True),
    ("mean_ttft_ms", "mean TTFT ms", False),
    ("p99_ttft_ms", "P99 TTFT ms", False),
    ("mean_tpot_ms", "mean TPOT ms", False),
    ("p99_tpot_ms", "P99 TPOT ms", False),
    ("p99_itl_ms", "P99 ITL ms", False),
    ("ttft_mean_first_turns_ms", "TTFT turn 1 ms", False),  # multi-turn only
    ("ttft_mean_later_turns_ms", "TTFT turns 2+", False),
    ("cached_prompt_share", "cached share", True),  # where the server's usage reports it
]
print(f"\n{ours['dataset']}, {ours['num_prompts']} prompts, rate {ours['request_rate']}, "
      f"completed conveyor {ours['completed']} / {peer} {theirs['completed']}")
# Same seeded requests, EOS ignored: every output must be as long on both sides (llama-server cuts a
# request that overflows its slot short without an error).
short = sum(b < a for a, b in zip(ours.get("output_lens", []), theirs.get("output_lens", [])))
if short:
    print(f"WARNING: {peer} returned {short} outputs shorter than conveyor's (llama.cpp: raise --ctx-per-slot)")
label = f"conveyor/{peer}"
print(f"{'metric':<14} {'conveyor':>10} {peer:>10} {label:>{max(14, len(label))}}  better")
for key, name, higher in rows:
    a, b = ours.get(key), theirs.get(key)
    if a is None or b is None:
        continue
    better = "conveyor" if (a > b) == higher and a != b else ("same" if a == b else peer)
    digits = 3 if key == "cached_prompt_share" else 1
    ratio = f"{a / b:.2f}x" if b else ("-" if a == b else "inf")  # 0 / 0: no ratio
    print(f"{name:<14} {a:>10.{digits}f} {b:>10.{digits}f} {ratio:>{max(14, len(label))}}  {better}")
PYEOF
}

rounds_summary() {  # rounds_summary PY DIR N PREFIX PEER: per-round output tok/s and ratios (conveyor-I.json
    # against PREFIX-I.json; odd rounds ran the peer first); last line: the median round
    "$1" - "$2" "$3" "$4" "$5" <<'PYEOF'
import json, os, sys
out_dir, n, prefix, peer = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
def tok_s(name):
    return json.load(open(os.path.join(out_dir, name)))["output_throughput"]
rows = []
for i in range(1, n + 1):
    ours, theirs = tok_s(f"conveyor-{i}.json"), tok_s(f"{prefix}-{i}.json")
    rows.append((i, ours, theirs, ours / theirs if theirs else float("inf")))
print(f"output tok/s, {n} rounds (odd rounds {peer} first, even rounds conveyor first)")
label = f"conveyor/{peer}"
print(f"{'round':>5} {'first':>9} {'conveyor':>10} {peer:>10} {label:>19}")
for i, ours, theirs, ratio in rows:
    first = peer if i % 2 else "conveyor"
    print(f"{i:>5} {first:>9} {ours:>10.1f} {theirs:>10.1f} {ratio:>18.2f}x")
ranked = sorted(rows, key=lambda row: row[3])
median = ranked[(n - 1) // 2]  # the lower middle one for an even count
print(f"{label} over {n} rounds: min {ranked[0][3]:.2f}x, median {median[3]:.2f}x "
      f"(round {median[0]}), max {ranked[-1][3]:.2f}x")
print(median[0])
PYEOF
}

# --rounds N > 1 in both peer scripts, once their two servers are up. Reads ROUNDS, SEED, OUT_DIR,
# CONVEYOR_PY and the script's bench_conveyor.
alternate_rounds() {  # alternate_rounds PEER_BENCH PREFIX PEER: round I benchmarks both into
    # OUT_DIR/PREFIX-I and conveyor-I, the peer first in odd rounds; requests drawn with seed SEED + I - 1
    local peer_bench=$1 prefix=$2 peer=$3 first_seed=$SEED round
    for ((round = 1; round <= ROUNDS; round++)); do
        SEED=$((first_seed + round - 1))  # bench reads it
        if ((round % 2)); then
            log "round $round of $ROUNDS: $peer, then conveyor"
            "$peer_bench" "$prefix-$round"
            bench_conveyor "conveyor-$round"
        else
            log "round $round of $ROUNDS: conveyor, then $peer"
            bench_conveyor "conveyor-$round"
            "$peer_bench" "$prefix-$round"
        fi
    done
    SEED=$first_seed
}

print_rounds() {  # print_rounds PREFIX PEER TITLE: each round's ratio, then the median round's table
    local summary median
    summary=$(rounds_summary "$CONVEYOR_PY" "$OUT_DIR" "$ROUNDS" "$1" "$2")
    median=${summary##*$'\n'}
    echo
    printf '%s\n' "${summary%$'\n'*}"
    echo
    echo "===== round $median, the median ratio ($3) ====="
    ratio_table "$CONVEYOR_PY" "$OUT_DIR/conveyor-$median.json" "$OUT_DIR/$1-$median.json" "$2"
}
