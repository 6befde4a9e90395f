#!/usr/bin/env bash
# Where a server build spends its cycles when the PMU is not available
# (this VM: `perf stat -e instructions true` says <not supported>): runs
# each BINARY under cachegrind with cache and branch simulation, drives it
# with `pairs` C=50 P=PIPELINE from one fixed load generator (LOAD), and
# prints per request: instructions, I1 misses, D1 misses, LL misses,
# conditional branches, mispredicted conditional and indirect branches.
# The simulation is deterministic for a given stream of reads, so builds
# compare far more steadily than by wall-clock on a shared machine.
#
#   LOAD=path/to/kunci docs/bench/cachegrind_server.sh NAME=BINARY...
#
# Environment: LOAD (default: the first BINARY), PIPELINE (32), DURATION
# seconds of load (6), PORT (17890), KEEP (a directory to copy the
# cachegrind.out files into, for cg_annotate). Stops every server by pid.
set -euo pipefail
PIPELINE=${PIPELINE:-32}
DURATION=${DURATION:-6}
PORT=${PORT:-17890}
first=${1#*=}
LOAD=${LOAD:-$first}
out=$(mktemp -d /tmp/cachegrind-server.XXXXXX)
pid=
KEEP=${KEEP:-}
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; [ -n "$KEEP" ] && cp "$out"/*.cg "$KEEP"/; rm -rf "$out"' EXIT

served() { "$LOAD" info --server "$1" | tr ' ' '\n' |
    awk -F= '$1 == "grants" || $1 == "timeouts" || $1 == "released" {n += $2} END {print n}'; }

printf '%-12s %9s %8s %8s %8s %8s %8s %8s %9s\n' build requests Ir/req I1mr/req D1mr/req LLm/req Bc/req Bcm/req Bim/req
for spec in "$@"; do
    name=${spec%%=*} bin=${spec#*=}
    [ -x "$bin" ] || { echo "cachegrind_server.sh: $bin is not a program" >&2; exit 1; }
    addr=127.0.0.1:$PORT
    valgrind --tool=cachegrind --cache-sim=yes --branch-sim=yes \
        --cachegrind-out-file="$out/$name.cg" "$bin" serve --no-state-dir --listen "$addr" 2>"$out/$name.log" &
    pid=$!
    for _ in $(seq 300); do
        "$LOAD" ping --server "$addr" >/dev/null 2>&1 && break
        kill -0 "$pid" 2>/dev/null || { cat "$out/$name.log" >&2; exit 1; }
        sleep 0.1
    done
    "$LOAD" bench pairs --server "$addr" --pipeline "$PIPELINE" --duration "$DURATION" --warmup 1 >/dev/null
    n=$(served "$addr")
    kill -TERM "$pid"
    wait "$pid" || true
    pid=
    # events: Ir I1mr ILmr Dr D1mr DLmr Dw D1mw DLmw Bc Bcm Bi Bim
    read -r ir i1 il dr d1r dlr dw d1w dlw bc bcm bi bim < <(sed -n 's/^summary: //p' "$out/$name.cg")
    awk -v name="$name" -v n="$n" -v ir="$ir" -v i1="$i1" -v d1="$((d1r + d1w))" \
        -v ll="$((il + dlr + dlw))" -v bc="$bc" -v bcm="$bcm" -v bim="$bim" \
        'BEGIN {printf "%-12s %9d %8.1f %8.3f %8.3f %8.4f %8.1f %8.3f %9.4f\n",
            name, n, ir/n, i1/n, d1/n, ll/n, bc/n, bcm/n, bim/n}'
    PORT=$((PORT + 1))
done
