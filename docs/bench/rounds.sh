#!/usr/bin/env bash
# Several servers side by side, all running at once, each measured in turn
# with `pairs` C=CONNS P=PIPELINE from one client binary (LOAD); ROUNDS
# rounds, each starting one server later than the last (A B C, B C A,
# C A B, ...) so that a noisy neighbour or a slow spell hits all alike.
# Prints every run (req/s, the server's CPU time per request, the load
# average) and then the medians and, per server, the median of its
# per-round ratios to the first server's. Stops every server by pid.
#
#   LOAD=path/to/kunci docs/bench/rounds.sh 'NAME=BINARY [serve flags]'...
#
# Environment: LOAD (required: keep it fixed when comparing builds),
# ROUNDS (10), CONNS (50), PIPELINE (1), DURATION (4), WARMUP (1), PORT
# (17811; the next servers use the next ports).
set -euo pipefail
ROUNDS=${ROUNDS:-10}
CONNS=${CONNS:-50}
PIPELINE=${PIPELINE:-1}
DURATION=${DURATION:-4}
WARMUP=${WARMUP:-1}
PORT=${PORT:-17811}
names=()
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT
for spec in "$@"; do
    name=${spec%%=*}
    read -r -a command <<<"${spec#*=}"
    "${command[0]}" serve --listen "127.0.0.1:$((PORT + ${#names[@]}))" "${command[@]:1}" \
        2>"/tmp/rounds-$name.log" &
    pids+=($!)
    names+=("$name")
done
n=${#names[@]}
for i in $(seq 0 $((n - 1))); do
    for _ in $(seq 100); do
        "$LOAD" ping --server "127.0.0.1:$((PORT + i))" >/dev/null 2>&1 && break
        sleep 0.1
    done
done
ticks=$(getconf CLK_TCK)
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
results=$(mktemp /tmp/rounds.XXXXXX)
echo "round server req/s cpu_ns_per_request load1"
for round in $(seq 0 $((ROUNDS - 1))); do
    for k in $(seq 0 $((n - 1))); do
        i=$(((round + k) % n))
        before=$(cpu "${pids[$i]}")
        json=$("$LOAD" bench pairs --server "127.0.0.1:$((PORT + i))" --connections "$CONNS" \
            --pipeline "$PIPELINE" --duration "$DURATION" --warmup "$WARMUP" --json)
        after=$(cpu "${pids[$i]}")
        rate=$(sed -n 's/.*"requests_per_s":\([0-9.]*\).*/\1/p' <<<"$json")
        # The CPU time covers the warm-up too: requests scaled to match.
        ns=$(awk -v c=$((after - before)) -v t="$ticks" -v r="$rate" -v s=$((DURATION + WARMUP)) \
            'BEGIN {printf "%.0f", c / t * 1e9 / (r * s)}')
        echo "$round ${names[$i]} $rate $ns $(cut -d' ' -f1 /proc/loadavg)" | tee -a "$results"
    done
done
python3 - "$results" "${names[0]}" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(dict)
for line in open(sys.argv[1]):
    r, name, rate, ns, _ = line.split()
    runs[r][name] = (float(rate), int(ns))
first = sys.argv[2]
for name in runs["0"]:
    rates = [runs[r][name][0] for r in runs]
    cpus = [runs[r][name][1] for r in runs]
    line = (f"{name}: req/s median {statistics.median(rates):,.0f} "
            f"({min(rates):,.0f}-{max(rates):,.0f}), CPU/request median {statistics.median(cpus)} ns")
    if name != first:
        rr = statistics.median(runs[r][name][0] / runs[r][first][0] for r in runs)
        cr = statistics.median(runs[r][name][1] / runs[r][first][1] for r in runs)
        line += f"; per round / {first}: req/s {rr:.3f}, CPU/request {cr:.3f}"
    print(line)
PY
rm -f "$results"
