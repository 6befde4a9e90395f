#!/bin/bash
# The memory of the --auth file's quotas (issue 27): RSS per held lock
# when the holder's identity has no quota and when it has max-keys= and
# max-grants= (QUOTA= sets the quota words), alternating, 2 runs each,
# a fresh server per run.
#
#     N=1000000 docs/bench/quota_memory.sh BINARY
#     QUOTA=max-grants=1000000 N=1000000 docs/bench/quota_memory.sh BINARY
set -euo pipefail
KUNCI=$1
N=${N:-200000}
PORT=${PORT:-17991}
ADDR=127.0.0.1:$PORT
D=$(mktemp -d)
for who in free quota info; do
    printf '%s-secret-0123456789abcdef-0123456789' $who >"$D/$who"
done
h() { sha256sum "$D/$1" | cut -d' ' -f1; }
cat >"$D/auth" <<A
free $(h free) lock:*
quota $(h quota) lock:* ${QUOTA:-max-keys=1000000 max-grants=1000000}
info $(h info) info
A
SERVER=
LOAD=
cleanup() {
    [ -n "$LOAD" ] && kill -INT "$LOAD" 2>/dev/null
    [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null
    wait 2>/dev/null
    rm -rf "$D"
}
trap cleanup EXIT
rss() { awk '$1 == "VmRSS:" {print $2}' "/proc/$SERVER/status"; }
held() {
    "$KUNCI" info --server "$ADDR" --secret-file "$D/info" | tr ' ' '\n' |
        awk -F= '$1 == "held" {print $2}'
}
echo "quota line: ${QUOTA:-max-keys=1000000 max-grants=1000000}"
for run in 1 2; do
    for who in free quota; do
        "$KUNCI" serve --no-state-dir --listen "$ADDR" --auth "$D/auth" 2>/dev/null &
        SERVER=$!
        for _ in $(seq 100); do
            "$KUNCI" info --server "$ADDR" --secret-file "$D/info" >/dev/null 2>&1 && break
            sleep 0.1
        done
        sleep 0.3
        r0=$(rss)
        "$KUNCI" bench hold "$N" --server "$ADDR" --secret-file "$D/$who" >/dev/null 2>&1 &
        LOAD=$!
        for _ in $(seq 1200); do
            [ "$(held)" -ge "$N" ] && break
            sleep 0.1
        done
        sleep 1
        r1=$(rss)
        echo "run $run $who: held $(held) RSS $r0 -> $r1 KiB: $(((r1 - r0) * 1024 / N)) B each"
        kill -INT "$LOAD"
        wait "$LOAD" 2>/dev/null || true
        LOAD=
        kill "$SERVER"
        wait "$SERVER" 2>/dev/null || true
        SERVER=
    done
done
