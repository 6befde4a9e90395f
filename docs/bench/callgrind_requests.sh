#!/usr/bin/env bash
# The server's instructions per request on the real path (sockets, the
# event loop, the clock, the state file), by callgrind: starts BINARY
# under callgrind with the given `kunci serve` flags, zeroes its counters
# once it answers, drives `pairs` C=CONNS P=PIPELINE from LOAD for
# DURATION s, dumps, and divides the dump's instructions by the requests
# the server answered meanwhile (grants + timeouts + released in its I
# line). The count is exact for C=1 (one request per wake-up); at C>1 it
# depends on how many requests each wake-up finds, which the simulation's
# slowness raises (±1 % between runs).
#
#   LOAD=path/to/kunci docs/bench/callgrind_requests.sh BINARY [serve flags...]
#
# Environment: LOAD (default BINARY), CONNS (1), PIPELINE (1), DURATION
# (5), PORT (17990), KEEP (a file to copy the dump to, for
# callgrind_annotate). A BINARY with a state directory runs under
# valgrind only if its boot-clock read does not go through rustix's vDSO
# lookup (docs/BENCHMARKS.md, "The P=1 path").
set -euo pipefail
bin=$1
shift
LOAD=${LOAD:-$bin}
CONNS=${CONNS:-1}
PIPELINE=${PIPELINE:-1}
DURATION=${DURATION:-5}
PORT=${PORT:-17990}
addr=127.0.0.1:$PORT
out=$(mktemp -d /tmp/callgrind-requests.XXXXXX)
pid=
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$out"' EXIT

valgrind --tool=callgrind --callgrind-out-file="$out/cg" "$bin" serve --listen "$addr" "$@" \
    2>"$out/log" &
pid=$!
for _ in $(seq 300); do
    "$LOAD" ping --server "$addr" >/dev/null 2>&1 && break
    kill -0 "$pid" 2>/dev/null || { cat "$out/log" >&2; exit 1; }
    sleep 0.1
done
served() { "$LOAD" info --server "$addr" | tr ' ' '\n' |
    awk -F= '$1 == "grants" || $1 == "timeouts" || $1 == "released" {n += $2} END {print n}'; }
before=$(served)
callgrind_control -z "$pid" >/dev/null 2>&1
"$LOAD" bench pairs --server "$addr" --connections "$CONNS" --pipeline "$PIPELINE" \
    --duration "$DURATION" --warmup 1 >/dev/null
callgrind_control -d "$pid" >/dev/null 2>&1
after=$(served)
kill -TERM "$pid"
wait "$pid" || true
pid=
dump=$(ls "$out"/cg.* | head -1)
[ -n "${KEEP:-}" ] && cp "$dump" "$KEEP"
ir=$(sed -n 's/^summary: //p' "$dump")
awk -v n=$((after - before)) -v ir="$ir" \
    'BEGIN {printf "requests %d instructions %d per request %.1f\n", n, ir, ir / n}'
