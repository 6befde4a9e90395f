#!/usr/bin/env bash
# `kunci bench pairs` (the Rust load generator: one thread, one mio loop)
# beside the Go client's pairs loop (bench/pairs), against one server on
# loopback, alternating run by run: C=50 connections with P=1 and P=32
# requests in flight each (for Go: 50 clients of P goroutines, pipelined
# over each client's one connection). Prints each run, then the medians.
# RUNS (3), DURATION (10 s measured), WARMUP (2 s).
set -euo pipefail
cd "$(dirname "$0")/../../.."
RUNS=${RUNS:-3}
DURATION=${DURATION:-10}
WARMUP=${WARMUP:-2}
bin=target/release/kunci
work=$(mktemp -d)
pid=""
cleanup() {
    if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT
(cd clients/go && go build -o "$work/gopairs" ./bench/pairs)
"$bin" serve --listen 127.0.0.1:0 --state-dir "$work/state" 2>"$work/log" &
pid=$!
for _ in $(seq 100); do
    grep -q 'listening on' "$work/log" && break
    sleep 0.05
done
addr=$(grep -o 'listening on [^;]*' "$work/log" | awk '{print $3}')
echo "server $addr; $(nproc) CPUs; load average $(cut -d' ' -f1-3 /proc/loadavg)"
for run in $(seq "$RUNS"); do
    for p in 1 32; do
        "$bin" bench pairs --server "$addr" --connections 50 --pipeline "$p" \
            --duration "$DURATION" --warmup "$WARMUP" --json |
            python3 -c 'import json,sys; r=json.load(sys.stdin); l=r["latency_us"]
print("rust pairs C=50 P=%d: %.0f req/s; latency µs p99 %d" % (r["pipeline"], r["requests_per_s"], max(l["acquire"]["p99"], l["release"]["p99"])))'
        "$work/gopairs" -server "$addr" -c 50 -p "$p" -duration "${DURATION}s" -warmup "${WARMUP}s"
    done
done | tee "$work/runs"
echo "medians of $RUNS runs (req/s):"
for who in rust go; do
    for p in 1 32; do
        grep "^$who pairs C=50 P=$p:" "$work/runs" | sed 's/.*: \([0-9]*\) req.*/\1/' | sort -n |
            awk -v w="$who" -v p="$p" '{v[NR]=$1} END {printf "  %s P=%d: %d (%d–%d)\n", w, p, v[int((NR+1)/2)], v[1], v[NR]}'
    done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
