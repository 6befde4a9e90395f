#!/usr/bin/env bash
# Clean restart with many held locks: stop time, restore time and RSS.
#
#   docs/bench/restart.sh [LOCKS] [PORT]     (defaults: 1000000, 5899)
#
# Starts `kunci serve --state-dir` on a fresh directory, holds LOCKS locks
# with `kunci bench hold`, kills the bench (grants outlive connections),
# sends SIGTERM and times the stop, then starts again and times the start
# until the listening line (the grants are restored before it).
set -euo pipefail
locks=${1:-1000000}
port=${2:-5899}
kunci=${KUNCI:-target/release/kunci}
dir=$(mktemp -d)
addr=127.0.0.1:$port
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$dir"' EXIT

rss() { awk '/VmRSS/ {print $2 " KiB"}' "/proc/$1/status"; }
# CPU time (user + system) a process has used so far, ms: on a busy host
# the wall-clock figures below include waiting for a core.
cpu_ms() { awk -v hz="$(getconf CLK_TCK)" '{print ($14 + $15) * 1000 / hz}' "/proc/$1/stat"; }
now_ms() { date +%s%3N; }
held() { "$kunci" info --server "$addr" | tr ' ' '\n' | sed -n 's/^held=//p'; }

RUST_LOG=info "$kunci" serve --listen "$addr" --state-dir "$dir/state" 2>"$dir/log1" &
server=$!
sleep 0.5
"$kunci" bench hold "$locks" --server "$addr" --duration 0 >/dev/null 2>&1 &
bench=$!
until [ "$(held)" = "$locks" ]; do sleep 0.2; done
kill -9 "$bench"
echo "held: $(held) locks; server RSS $(rss "$server")"

start=$(now_ms)
kill -TERM "$server"
wait "$server" || true
stop=$(( $(now_ms) - start ))
echo "stop (SIGTERM to exit): $stop ms; file $(stat -c %s "$dir/state/kunci.state") bytes"
grep -o 'saved.*' "$dir/log1" || true

start=$(now_ms)
RUST_LOG=info "$kunci" serve --listen "$addr" --state-dir "$dir/state" 2>"$dir/log2" &
server=$!
until grep -q 'listening on' "$dir/log2"; do sleep 0.005; done
restore=$(( $(now_ms) - start ))
echo "start (spawn to listening): $restore ms, $(cpu_ms "$server") ms CPU; server RSS $(rss "$server")"
grep -o 'restored.*' "$dir/log2" || true
echo "held after the restart: $(held)"
kill -TERM "$server"
wait "$server" || true
