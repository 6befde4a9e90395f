#!/usr/bin/env bash
# kunci's own figures: memory per held lock / queued waiter / idle
# connection and idle RSS (server RSS deltas from /proc/PID/status),
# throughput with and without 1,000,000 locks held, timer lateness with
# 1,000,000 leases armed, wake-ups while idle, and the binary's size.
#
# Every server is started here on loopback and stopped by its pid. Installs
# nothing. Environment: RUNS (3), DURATION seconds per throughput run (10),
# KUNCI (the binary; built with cargo if absent), PORT (17864).
set -euo pipefail

RUNS=${RUNS:-3}
DURATION=${DURATION:-10}
PORT=${PORT:-17864}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
KUNCI=${KUNCI:-$ROOT/target/release/kunci}
ADDR=127.0.0.1:$PORT
if [ ! -x "$KUNCI" ]; then
    (cd "$ROOT" && cargo build --release)
fi

SERVER_PID=
LOAD_PID=
stop_load() {
    if [ -n "$LOAD_PID" ]; then
        kill -INT "$LOAD_PID" 2>/dev/null || true
        wait "$LOAD_PID" 2>/dev/null || true
        LOAD_PID=
    fi
}
stop_server() {
    stop_load
    if [ -n "$SERVER_PID" ]; then
        kill "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
        SERVER_PID=
    fi
}
trap stop_server EXIT

start_server() {
    "$KUNCI" serve --no-state-dir --listen "$ADDR" "$@" 2>/dev/null &
    SERVER_PID=$!
    for _ in $(seq 100); do
        "$KUNCI" ping --server "$ADDR" >/dev/null 2>&1 && return
        sleep 0.1
    done
    echo "kunci.sh: the server did not start" >&2
    exit 1
}

# Starts `kunci bench ARGS` in the background (stdout discarded).
start_load() {
    "$KUNCI" bench --server "$ADDR" "$@" >/dev/null &
    LOAD_PID=$!
}

status() { awk -v k="$1:" '$1 == k {print $2}' "/proc/$SERVER_PID/status"; }
info() { "$KUNCI" info --server "$ADDR" | tr ' ' '\n' | awk -F= -v k="$1" '$1 == k {print $2}'; }
# Waits until the server's gauge NAME reaches at least VALUE.
wait_gauge() {
    for _ in $(seq 1200); do
        [ "$(info "$1")" -ge "$2" ] && return
        sleep 0.1
    done
    echo "kunci.sh: $1 never reached $2" >&2
    exit 1
}
json_field() { grep -o "\"$2\":[0-9.]*" <<<"$1" | head -1 | cut -d: -f2; }
median() { tr ' ' '\n' | grep . | sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
range() { tr ' ' '\n' | grep . | sort -g | awk 'NR==1{lo=$1} {hi=$1} END {print lo "-" hi}'; }
check() {
    if [ "$(json_field "$1" errors)" != 0 ]; then
        echo "kunci.sh: kunci bench reported errors: $1" >&2
        exit 1
    fi
}

echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -sr)"
echo "binary: $(stat -c %s "$KUNCI") bytes ($KUNCI)"

# Memory: one fresh server per figure; RSS before and after the load.
start_server
sleep 0.5
idle_kib=$(status VmRSS)
echo "idle RSS at start: $idle_kib KiB"
before=$(status voluntary_ctxt_switches)
before_n=$(status nonvoluntary_ctxt_switches)
sleep 10
echo "wake-ups in 10 s with nothing armed: voluntary $(($(status voluntary_ctxt_switches) - before))," \
    "involuntary $(($(status nonvoluntary_ctxt_switches) - before_n))"
stop_server

measure() { # NAME COUNT GAUGE BENCH-ARGS...
    local name=$1 count=$2 gauge=$3
    shift 3
    start_server "${SERVER_ARGS[@]}"
    sleep 0.3
    local rss0 rss1
    rss0=$(status VmRSS)
    start_load "$@"
    wait_gauge "$gauge" "$count"
    sleep 1
    rss1=$(status VmRSS)
    echo "$name: RSS $rss0 -> $rss1 KiB: $(((rss1 - rss0) * 1024 / count)) B each ($count)"
    stop_server
}
SERVER_ARGS=()
measure "held lock (17-byte keys)" 1000000 held hold 1000000
measure "queued waiter" 100000 waiters waiters 100000
SERVER_ARGS=(--max-connections 20000)
# The `I` connection that asks is one of the connections counted.
measure "idle connection" 10001 connections idle 10000
SERVER_ARGS=()

# Throughput with an empty table and with 1,000,000 locks held by another
# process, alternating on one server.
start_server
empty= full= ratios=
for _ in $(seq "$RUNS"); do
    e=$("$KUNCI" bench pairs --server "$ADDR" --duration "$DURATION" --json)
    check "$e"
    start_load hold 1000000
    wait_gauge held 1000000
    f=$("$KUNCI" bench pairs --server "$ADDR" --duration "$DURATION" --json)
    check "$f"
    stop_load
    while [ "$(info held)" != 0 ]; do sleep 0.1; done
    er=$(json_field "$e" requests_per_s) fr=$(json_field "$f" requests_per_s)
    empty+=" $er" full+=" $fr"
    ratios+=" $(awk -v f="$fr" -v e="$er" 'BEGIN {printf "%.3f", f/e}')"
    echo "  run: pairs C=50 P=32 empty $er req/s, with 1,000,000 held $fr req/s" >&2
done
echo "pairs C=50 P=32, empty table: $(median <<<"$empty") req/s ($(range <<<"$empty"))"
echo "pairs C=50 P=32, 1,000,000 held: $(median <<<"$full") req/s ($(range <<<"$full"))"
echo "ratio held/empty (per run, median): $(median <<<"$ratios")"

# Timer lateness (upper bounds, see `kunci bench --help`): alone, then with
# 1,000,000 leases armed and renewed by another process.
timers() {
    local t
    t=$("$KUNCI" bench timers --server "$ADDR" --duration 30 --json)
    check "$t"
    for series in timeout_late expiry_late; do
        grep -o "\"$series\":{[^}]*}" <<<"$t"
    done | tr '\n' ' '
    echo
}
echo "timers, nothing else armed (µs): $(timers)"
start_load hold 1000000
wait_gauge held 1000000
echo "timers, 1,000,000 leases armed (µs): $(timers)"
stop_load
stop_server
