#!/usr/bin/env bash
# Memory of permits (spec §10): the server's RSS (VmRSS) per held exclusive
# lock and per extra shared holder, on fresh servers.
#
#   exclusive: `kunci bench hold N` (N plain `A` locks, 17-byte keys), RSS
#              before → after, divided by N (kunci.sh's method).
#   shared:    K keys held shared (limit 65535, take 1) by one holder each,
#              then H more holders on each: (RSS after − RSS between) /
#              (K × H). Raw `S` frames, pipelined from one connection.
#
# Environment: KUNCI (target/release/kunci), N (1000000), K (10000),
# H (100), PORT (17890). Loopback only; the servers are stopped by pid.
set -euo pipefail

N=${N:-1000000}
K=${K:-10000}
H=${H:-100}
PORT=${PORT:-17890}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
KUNCI=${KUNCI:-$ROOT/target/release/kunci}
[ -x "$KUNCI" ] || (cd "$ROOT" && cargo build --release)

PID=
LOAD=
stop() {
    [ -n "$LOAD" ] && kill -INT "$LOAD" 2>/dev/null && wait "$LOAD" 2>/dev/null
    [ -n "$PID" ] && kill "$PID" 2>/dev/null && wait "$PID" 2>/dev/null
    LOAD= PID=
    return 0
}
trap stop EXIT
rss() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }
info() { "$KUNCI" info --server "$1" | tr ' ' '\n' | awk -F= -v k="$2" '$1 == k {print $2}'; }
start() { # ADDR
    "$KUNCI" serve --no-state-dir --listen "$1" --max-keys 4000000 --max-grants 4000000 2>/dev/null &
    PID=$!
    for _ in $(seq 100); do
        "$KUNCI" ping --server "$1" >/dev/null 2>&1 && return
        sleep 0.1
    done
    echo "permits.sh: no server at $1" >&2
    exit 1
}

echo "machine: $(nproc) cores, $(uname -sr); $(date -u '+%Y-%m-%d %H:%M UTC')"
ADDR=127.0.0.1:$PORT
start "$ADDR"
before=$(rss "$PID")
"$KUNCI" bench hold "$N" --server "$ADDR" --lease 255 >/dev/null &
LOAD=$!
until [ "$(info "$ADDR" held)" -ge "$N" ]; do sleep 0.2; done
after=$(rss "$PID")
echo "exclusive: $N held, RSS $before → $after KiB:" \
    "$(awk -v b="$before" -v a="$after" -v n="$N" 'BEGIN {printf "%.1f", (a - b) * 1024 / n}') B per held lock"
stop

start "$ADDR"
python3 - "$PORT" "$K" "$H" "$PID" <<'PY'
import socket, struct, sys
port, keys, holders, pid = (int(a) for a in sys.argv[1:])

def rss():
    with open(f"/proc/{pid}/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS"))

sock = socket.create_connection(("127.0.0.1", port))
owner = 0

def hold(rounds):
    """Each key gets `rounds` more shared holders; every answer must be A."""
    global owner
    batch = bytearray()
    count = 0
    for _ in range(rounds):
        for k in range(keys):
            owner += 1
            key = b"hold-%012d" % k
            batch += b"S" + struct.pack(">BBQHHB", 0, 255, owner, 65535, 1, len(key)) + key + b"\n"
            count += 1
    sock.sendall(batch)
    want = count * 18  # A owner:u64 token:u64 \n
    got = bytearray()
    while len(got) < want:
        chunk = sock.recv(1 << 20)
        if not chunk:
            sys.exit("permits.sh: connection closed")
        got += chunk
    assert all(got[i] == ord("A") for i in range(0, want, 18)), "not every S was granted"

start = rss()
hold(1)
between = rss()
hold(holders)
after = rss()
print(f"shared: {keys} keys, 1 holder each: RSS {start} → {between} KiB; "
      f"{holders} more each: → {after} KiB: "
      f"{(after - between) * 1024 / (keys * holders):.1f} B per extra holder")
PY
