#!/usr/bin/env bash
# What a large table costs: `pairs` on an empty server against `pairs` on a
# server where another process holds N other locks, for each N in HELD.
# Two servers of the same binary run side by side and the runs alternate
# (empty, held, empty, held, ...), so the ratio held/empty is taken within
# each run; both throughput and the server's CPU time per request are
# reported (the latter is far less disturbed by other processes on the
# machine). Loopback only; everything is stopped by pid.
#
# Environment: KUNCI (target/release/kunci), HELD ("1000000 4000000"),
# PIPELINE (32), RUNS (3), DURATION seconds per run (4), PORT (17874; the
# held server uses PORT+1).
set -euo pipefail

RUNS=${RUNS:-3}
DURATION=${DURATION:-4}
PORT=${PORT:-17874}
HELD=${HELD:-"1000000 4000000"}
PIPELINE=${PIPELINE:-32}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
KUNCI=${KUNCI:-$ROOT/target/release/kunci}
if [ ! -x "$KUNCI" ]; then
    (cd "$ROOT" && cargo build --release)
fi

PIDS=()
LOAD=
stop_load() {
    if [ -n "$LOAD" ]; then
        kill -INT "$LOAD" 2>/dev/null || true
        wait "$LOAD" 2>/dev/null || true
        LOAD=
    fi
}
stop_all() {
    stop_load
    for pid in "${PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
}
trap stop_all EXIT

start_server() { # ADDR
    "$KUNCI" serve --no-state-dir --listen "$1" --max-keys 8000000 2>/dev/null &
    PIDS+=($!)
    for _ in $(seq 100); do
        "$KUNCI" ping --server "$1" >/dev/null 2>&1 && return
        sleep 0.1
    done
    echo "held.sh: the server at $1 did not start" >&2
    exit 1
}
info() { "$KUNCI" info --server "$1" | tr ' ' '\n' | awk -F= -v k="$2" '$1 == k {print $2}'; }
json_field() { grep -o "\"$2\":[0-9.]*" <<<"$1" | head -1 | cut -d: -f2; }
median() { tr ' ' '\n' | grep . | sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
range() { tr ' ' '\n' | grep . | sort -g | awk 'NR==1{lo=$1} {hi=$1} END {print lo "-" hi}'; }
served() { "$KUNCI" info --server "$1" | tr ' ' '\n' |
    awk -F= '$1 == "grants" || $1 == "timeouts" || $1 == "released" {n += $2} END {print n}'; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# One run against ADDR (server PID): prints "req/s cpu-ns-per-request".
pairs() { # ADDR PID
    local out n0 c0 n1 c1
    n0=$(served "$1") c0=$(cpu_ticks "$2")
    out=$("$KUNCI" bench pairs --server "$1" --pipeline "$PIPELINE" --duration "$DURATION" \
        --warmup 1 --json)
    n1=$(served "$1") c1=$(cpu_ticks "$2")
    if [ "$(json_field "$out" errors)" != 0 ]; then
        echo "held.sh: kunci bench reported errors: $out" >&2
        exit 1
    fi
    echo "$(json_field "$out" requests_per_s) $(awk -v c=$((c1 - c0)) -v n=$((n1 - n0)) \
        -v hz="$(getconf CLK_TCK)" 'BEGIN {printf "%.0f", c / hz * 1e9 / n}')"
}

EMPTY_ADDR=127.0.0.1:$PORT
HELD_ADDR=127.0.0.1:$((PORT + 1))
start_server "$EMPTY_ADDR"
start_server "$HELD_ADDR"
echo "machine: $(nproc) cores, $(uname -sr); pairs C=50 P=$PIPELINE, $DURATION s per run," \
    "$RUNS runs; $(date -u '+%Y-%m-%d %H:%M UTC')"
for held in $HELD; do
    stop_load
    while [ "$(info "$HELD_ADDR" held)" != 0 ]; do sleep 0.2; done
    "$KUNCI" bench hold "$held" --server "$HELD_ADDR" --lease 255 >/dev/null &
    LOAD=$!
    for _ in $(seq 3000); do
        [ "$(info "$HELD_ADDR" held)" -ge "$held" ] && break
        sleep 0.1
    done
    e_rates= h_rates= e_cpus= h_cpus= ratios= cpu_ratios=
    for _ in $(seq "$RUNS"); do
        read -r e ec < <(pairs "$EMPTY_ADDR" "${PIDS[0]}")
        read -r h hc < <(pairs "$HELD_ADDR" "${PIDS[1]}")
        e_rates+=" $e" h_rates+=" $h" e_cpus+=" $ec" h_cpus+=" $hc"
        ratios+=" $(awk -v h="$h" -v e="$e" 'BEGIN {printf "%.2f", h/e}')"
        cpu_ratios+=" $(awk -v h="$hc" -v e="$ec" 'BEGIN {printf "%.2f", e/h}')"
        echo "  run: empty $e req/s ${ec} ns CPU/req; $held held $h req/s ${hc} ns CPU/req" >&2
    done
    echo "$held held: req/s empty $(median <<<"$e_rates") ($(range <<<"$e_rates")), held" \
        "$(median <<<"$h_rates") ($(range <<<"$h_rates")); held/empty per run:$ratios" \
        "(median $(median <<<"$ratios"))"
    echo "$held held: server CPU ns/request empty $(median <<<"$e_cpus") ($(range <<<"$e_cpus")), held" \
        "$(median <<<"$h_cpus") ($(range <<<"$h_cpus")); empty/held per run:$cpu_ratios" \
        "(median $(median <<<"$cpu_ratios"))"
done
