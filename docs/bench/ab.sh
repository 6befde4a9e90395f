#!/usr/bin/env bash
# Two server binaries, A and B, side by side: `pairs` at C=50 P=PIPELINE
# with each number of other locks held in HELD. Starts one server of each
# on loopback and alternates them run by run (A, B, A, B, ...) so that a
# noisy neighbour hits both alike; prints medians, min-max and the per-run
# ratios B/A. Stops everything by pid. hash.sh and the index comparison in
# docs/BENCHMARKS.md use it.
#
#   A=path/to/kunci B=path/to/other/kunci docs/bench/ab.sh
#
# Environment: A, B (binaries; NAME_A, NAME_B label them), HELD ("0
# 1000000"), PIPELINE (32), RUNS (3), DURATION seconds per run (4), PORT
# (17870; B uses PORT+1), LOAD (the binary whose `kunci bench` makes the
# load and reads the counters; default A: keep it fixed when comparing
# builds of different code), ARGS_A and ARGS_B (more `kunci serve` flags
# for each, split on spaces; default --no-state-dir: compare one build with
# and without a state directory with A=B=kunci ARGS_B="--state-dir DIR").
set -euo pipefail

RUNS=${RUNS:-3}
DURATION=${DURATION:-4}
PORT=${PORT:-17870}
HELD=${HELD:-"0 1000000"}
PIPELINE=${PIPELINE:-32}
NAME_A=${NAME_A:-A}
NAME_B=${NAME_B:-B}
LOAD=${LOAD:-$A}
ARGS_A=${ARGS_A:---no-state-dir}
ARGS_B=${ARGS_B:---no-state-dir}

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

start_server() { # BINARY ADDR ARGS
    # shellcheck disable=SC2086 # ARGS are several flags
    "$1" serve --listen "$2" --max-keys 8000000 $3 2>/dev/null &
    PIDS+=($!)
    for _ in $(seq 100); do
        "$1" ping --server "$2" >/dev/null 2>&1 && return
        sleep 0.1
    done
    echo "ab.sh: the server at $2 did not start" >&2
    exit 1
}
info() { "$LOAD" info --server "$1" | tr ' ' '\n' | awk -F= -v k="$2" '$1 == k {print $2}'; }
wait_held() { # ADDR COUNT
    for _ in $(seq 1200); do
        [ "$(info "$1" held)" -ge "$2" ] && return
        sleep 0.1
    done
    echo "ab.sh: $1 never held $2" >&2
    exit 1
}
json_field() { grep -o "\"$2\":[0-9.]*" <<<"$1" | head -1 | cut -d: -f2; }
median() { tr ' ' '\n' | grep . | sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
range() { tr ' ' '\n' | grep . | sort -g | awk 'NR==1{lo=$1} {hi=$1} END {print lo "-" hi}'; }
# Requests the server has answered: grants, timeouts and releases.
served() { "$LOAD" info --server "$1" | tr ' ' '\n' |
    awk -F= '$1 == "grants" || $1 == "timeouts" || $1 == "released" {n += $2} END {print n}'; }
# The server's CPU time (user + system) in clock ticks.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# One run against ADDR (server PID): prints "req/s cpu-ns-per-request". The
# CPU figure is the server's CPU time over the whole run (warm-up included)
# divided by the requests it answered: it is much less disturbed than
# wall-clock throughput when other processes take the CPUs.
pairs() { # ADDR PID
    local out n0 c0 n1 c1
    n0=$(served "$1") c0=$(cpu_ticks "$2")
    out=$("$LOAD" bench pairs --server "$1" --pipeline "$PIPELINE" --duration "$DURATION" --warmup 1 --json)
    n1=$(served "$1") c1=$(cpu_ticks "$2")
    if [ "$(json_field "$out" errors)" != 0 ]; then
        echo "ab.sh: kunci bench reported errors: $out" >&2
        exit 1
    fi
    echo "$(json_field "$out" requests_per_s) $(awk -v c=$((c1 - c0)) -v n=$((n1 - n0)) -v hz="$(getconf CLK_TCK)" \
        'BEGIN {printf "%.0f", c / hz * 1e9 / n}')"
}

A_ADDR=127.0.0.1:$PORT
B_ADDR=127.0.0.1:$((PORT + 1))
start_server "$A" "$A_ADDR" "$ARGS_A"
start_server "$B" "$B_ADDR" "$ARGS_B"

echo "machine: $(nproc) cores, $(uname -sr); pairs C=50 P=$PIPELINE, ${DURATION} s per run, $RUNS runs"
echo "A = $NAME_A ($A $ARGS_A), B = $NAME_B ($B $ARGS_B); load from $LOAD"
for held in $HELD; do
    if [ "$held" != 0 ]; then
        for addr in "$A_ADDR" "$B_ADDR"; do
            "$LOAD" bench hold "$held" --server "$addr" --lease 255 >/dev/null &
            LOADS+=($!)
            wait_held "$addr" "$held"
        done
    fi
    a_rates= b_rates= ratios= a_cpus= b_cpus= cpu_ratios=
    for _ in $(seq "$RUNS"); do
        read -r f fc < <(pairs "$A_ADDR" "${PIDS[0]}")
        read -r s sc < <(pairs "$B_ADDR" "${PIDS[1]}")
        a_rates+=" $f" b_rates+=" $s" a_cpus+=" $fc" b_cpus+=" $sc"
        ratios+=" $(awk -v s="$s" -v f="$f" 'BEGIN {printf "%.3f", s/f}')"
        cpu_ratios+=" $(awk -v s="$sc" -v f="$fc" 'BEGIN {printf "%.3f", s/f}')"
        echo "  run: $held held: $NAME_A $f req/s ${fc} ns CPU/req, $NAME_B $s req/s ${sc} ns CPU/req" >&2
    done
    echo "$held held: req/s $NAME_A $(median <<<"$a_rates") ($(range <<<"$a_rates"))," \
        "$NAME_B $(median <<<"$b_rates") ($(range <<<"$b_rates")); $NAME_B/$NAME_A per run:$ratios" \
        "(median $(median <<<"$ratios"))"
    echo "$held held: server CPU ns/request $NAME_A $(median <<<"$a_cpus") ($(range <<<"$a_cpus"))," \
        "$NAME_B $(median <<<"$b_cpus") ($(range <<<"$b_cpus")); $NAME_B/$NAME_A per run:$cpu_ratios" \
        "(median $(median <<<"$cpu_ratios"))"
    stop_loads
done
