#!/usr/bin/env bash
# The cost of the key hash: foldhash (the default build) against std's
# SipHash-1-3 (`--features sip-hash`), on `pairs` C=50 P=32 with an empty
# table and with 1,000,000 other locks held.
#
# Builds both binaries (the SipHash one under target/sip-hash), starts one
# server of each on loopback, and alternates them run by run (foldhash,
# SipHash, foldhash, ...) so that a noisy neighbour hits both alike. Stops
# everything by pid. Environment: RUNS (3), DURATION seconds per run (4),
# PORT (17870; the SipHash server uses PORT+1).
set -euo pipefail

RUNS=${RUNS:-3}
DURATION=${DURATION:-4}
PORT=${PORT:-17870}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
FOLD=$ROOT/target/release/kunci
SIP=$ROOT/target/sip-hash/release/kunci
(cd "$ROOT" && cargo build --release -q &&
    cargo build --release -q --features sip-hash --target-dir target/sip-hash)

PIDS=()
LOADS=()
stop_loads() {
    for pid in "${LOADS[@]}"; do
        kill -INT "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    LOADS=()
}
stop_all() {
    stop_loads
    for pid in "${PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
}
trap stop_all EXIT

start_server() { # BINARY ADDR
    "$1" serve --listen "$2" 2>/dev/null &
    PIDS+=($!)
    for _ in $(seq 100); do
        "$1" ping --server "$2" >/dev/null 2>&1 && return
        sleep 0.1
    done
    echo "hash.sh: the server at $2 did not start" >&2
    exit 1
}
info() { "$FOLD" info --server "$1" | tr ' ' '\n' | awk -F= -v k="$2" '$1 == k {print $2}'; }
wait_held() { # ADDR COUNT
    for _ in $(seq 1200); do
        [ "$(info "$1" held)" -ge "$2" ] && return
        sleep 0.1
    done
    echo "hash.sh: $1 never held $2" >&2
    exit 1
}
json_field() { grep -o "\"$2\":[0-9.]*" <<<"$1" | head -1 | cut -d: -f2; }
median() { tr ' ' '\n' | grep . | sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
range() { tr ' ' '\n' | grep . | sort -g | awk 'NR==1{lo=$1} {hi=$1} END {print lo "-" hi}'; }
pairs() { # ADDR -> req/s
    local out
    out=$("$FOLD" bench pairs --server "$1" --duration "$DURATION" --warmup 1 --json)
    if [ "$(json_field "$out" errors)" != 0 ]; then
        echo "hash.sh: kunci bench reported errors: $out" >&2
        exit 1
    fi
    json_field "$out" requests_per_s
}

FOLD_ADDR=127.0.0.1:$PORT
SIP_ADDR=127.0.0.1:$((PORT + 1))
start_server "$FOLD" "$FOLD_ADDR"
start_server "$SIP" "$SIP_ADDR"

echo "machine: $(nproc) cores, $(uname -sr); pairs C=50 P=32, ${DURATION} s per run, $RUNS runs"
for held in 0 1000000; do
    if [ "$held" != 0 ]; then
        for addr in "$FOLD_ADDR" "$SIP_ADDR"; do
            "$FOLD" bench hold "$held" --server "$addr" >/dev/null &
            LOADS+=($!)
            wait_held "$addr" "$held"
        done
    fi
    f_rates= s_rates= ratios=
    for _ in $(seq "$RUNS"); do
        f=$(pairs "$FOLD_ADDR")
        s=$(pairs "$SIP_ADDR")
        f_rates+=" $f" s_rates+=" $s"
        ratios+=" $(awk -v s="$s" -v f="$f" 'BEGIN {printf "%.3f", s/f}')"
        echo "  run: $held held: foldhash $f req/s, SipHash-1-3 $s req/s" >&2
    done
    echo "$held held: foldhash $(median <<<"$f_rates") ($(range <<<"$f_rates")) req/s;" \
        "SipHash-1-3 $(median <<<"$s_rates") ($(range <<<"$s_rates")) req/s;" \
        "SipHash/foldhash per run: $ratios (median $(median <<<"$ratios"))"
    stop_loads
done
