#!/usr/bin/env bash
# What a full listing costs the other clients: `kunci bench pairs` alone,
# then `pairs` again while docs/bench/list_keys.py lists every key of the
# table with `L` pages of COUNT, over and over, on one more connection. The
# table holds KEYS locks (`kunci bench hold`). Reports the throughput of
# `pairs` and its acquire p99 in both runs, and each full listing's time and
# slowest page, and one listing with no other load. Loopback only; everything is stopped by pid.
#
# Environment: KUNCI (target/release/kunci), KEYS (4000000), COUNT (1000),
# DURATION seconds per run (10), PIPELINE (32), PORT (17880).
set -euo pipefail

KEYS=${KEYS:-4000000}
COUNT=${COUNT:-1000}
DURATION=${DURATION:-10}
PIPELINE=${PIPELINE:-32}
PORT=${PORT:-17880}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
KUNCI=${KUNCI:-$ROOT/target/release/kunci}
ADDR=127.0.0.1:$PORT
if [ ! -x "$KUNCI" ]; then
    (cd "$ROOT" && cargo build --release)
fi

PIDS=()
stop_all() {
    for pid in "${PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
}
trap stop_all EXIT

"$KUNCI" serve --no-state-dir --listen "$ADDR" --max-keys 8000000 2>/dev/null &
PIDS+=($!)
for _ in $(seq 100); do
    "$KUNCI" ping --server "$ADDR" >/dev/null 2>&1 && break
    sleep 0.1
done
info() { "$KUNCI" info --server "$ADDR" | tr ' ' '\n' | awk -F= -v k="$1" '$1 == k {print $2}'; }
summary() { python3 -c 'import json, sys
r = json.loads(sys.stdin.read())
print("%.0f req/s, acquire p50 %s us p99 %s us" % (r["requests_per_s"],
      r["latency_us"]["acquire"]["p50"], r["latency_us"]["acquire"]["p99"]))'; }

"$KUNCI" bench hold "$KEYS" --server "$ADDR" --lease 255 >/dev/null &
PIDS+=($!)
started=$(date +%s)
for _ in $(seq 6000); do
    [ "$(info held)" -ge "$KEYS" ] && break
    sleep 0.1
done
echo "machine: $(nproc) cores, $(uname -sr); $(info held) keys held after" \
    "$(($(date +%s) - started)) s; pairs C=50 P=$PIPELINE, $DURATION s per run;" \
    "L count $COUNT; $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "server RSS with the table: $(awk '/VmRSS/ {print $2, $3}' "/proc/${PIDS[0]}/status")"

echo "full listings alone (no other load):"
python3 "$ROOT/docs/bench/list_keys.py" "$ADDR" "$COUNT" 1 | sed 's/^/  /'
alone=$("$KUNCI" bench pairs --server "$ADDR" --pipeline "$PIPELINE" --duration "$DURATION" \
    --warmup 1 --json)
echo "pairs alone:          $(summary <<<"$alone")"
python3 "$ROOT/docs/bench/list_keys.py" "$ADDR" "$COUNT" "$((DURATION + 1))" >"${TMPDIR:-/tmp}/kunci-list.$$" &
LISTER=$!
PIDS+=($LISTER)
during=$("$KUNCI" bench pairs --server "$ADDR" --pipeline "$PIPELINE" --duration "$DURATION" \
    --warmup 1 --json)
wait "$LISTER" || true
echo "pairs while listing:  $(summary <<<"$during")"
echo "full listings during that run:"
sed 's/^/  /' "${TMPDIR:-/tmp}/kunci-list.$$"
rm -f "${TMPDIR:-/tmp}/kunci-list.$$"
