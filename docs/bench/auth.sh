#!/usr/bin/env bash
# What `--auth` costs once a session has authenticated: `pairs` at C=50
# against two servers of the same binary side by side, one plain and one
# with `--auth` (an identity whose scope is `lock:pair-`, the prefix of
# pairs' keys, so every request pays the scope check of a real prefix),
# alternating run by run (plain, auth, plain, auth, ...) so a noisy
# neighbour hits both alike. Prints medians, ranges and per-run ratios of
# throughput and of the server's CPU time per request. Loopback only;
# everything is stopped by pid.
#
# Environment: KUNCI (target/release/kunci), PIPELINES ("32 1"), RUNS (5),
# DURATION seconds per run (4), PORT (17876; the auth server uses PORT+1).
set -euo pipefail

RUNS=${RUNS:-5}
DURATION=${DURATION:-4}
PORT=${PORT:-17876}
PIPELINES=${PIPELINES:-"32 1"}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
KUNCI=${KUNCI:-$ROOT/target/release/kunci}
if [ ! -x "$KUNCI" ]; then
    (cd "$ROOT" && cargo build --release)
fi

DIR=$(mktemp -d)
PIDS=()
stop_all() {
    for pid in "${PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$DIR"
}
trap stop_all EXIT

"$KUNCI" secret bench lock:pair- >"$DIR/secret.out"
head -1 "$DIR/secret.out" >"$DIR/secret"
tail -1 "$DIR/secret.out" >"$DIR/auth"

start_server() { # ADDR [ARGS...]
    local addr=$1
    shift
    "$KUNCI" serve --no-state-dir --listen "$addr" "$@" 2>/dev/null &
    PIDS+=($!)
    for _ in $(seq 100); do
        # A ping without a secret is refused by the auth server: any answer
        # means it is up.
        "$KUNCI" ping --server "$addr" --secret-file "$DIR/secret" >/dev/null 2>&1 && return
        "$KUNCI" ping --server "$addr" >/dev/null 2>&1 && return
        sleep 0.1
    done
    echo "auth.sh: the server at $addr did not start" >&2
    exit 1
}
json_field() { grep -o "\"$2\":[0-9.]*" <<<"$1" | head -1 | cut -d: -f2; }
median() { tr ' ' '\n' | grep . | sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
range() { tr ' ' '\n' | grep . | sort -g | awk 'NR==1{lo=$1} {hi=$1} END {print lo "-" hi}'; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# One run: prints "req/s cpu-ns-per-request" (the server's CPU time over
# the run divided by the requests bench counted in it (no warm-up, so
# both cover the same span: connecting is a sliver of the run).
pairs() { # ADDR PID PIPELINE [ARGS...]
    local addr=$1 pid=$2 pipeline=$3 out c0 c1 total
    shift 3
    c0=$(cpu_ticks "$pid")
    out=$("$KUNCI" bench pairs --server "$addr" --pipeline "$pipeline" \
        --duration "$DURATION" --warmup 0 --json "$@")
    c1=$(cpu_ticks "$pid")
    if [ "$(json_field "$out" errors)" != 0 ]; then
        echo "auth.sh: kunci bench reported errors: $out" >&2
        exit 1
    fi
    total=$(json_field "$out" requests)
    echo "$(json_field "$out" requests_per_s) $(awk -v c=$((c1 - c0)) -v n="$total" \
        -v hz="$(getconf CLK_TCK)" 'BEGIN {printf "%.0f", c / hz * 1e9 / n}')"
}

PLAIN=127.0.0.1:$PORT
AUTH=127.0.0.1:$((PORT + 1))
start_server "$PLAIN"
start_server "$AUTH" --auth "$DIR/auth"

echo "machine: $(nproc) cores, $(uname -sr); pairs C=50, ${DURATION} s per run, $RUNS runs"
for pipeline in $PIPELINES; do
    p_rates= a_rates= ratios= p_cpus= a_cpus= cpu_ratios=
    for _ in $(seq "$RUNS"); do
        read -r p pc < <(pairs "$PLAIN" "${PIDS[0]}" "$pipeline")
        read -r a ac < <(pairs "$AUTH" "${PIDS[1]}" "$pipeline" --secret-file "$DIR/secret")
        p_rates+=" $p" a_rates+=" $a" p_cpus+=" $pc" a_cpus+=" $ac"
        ratios+=" $(awk -v a="$a" -v p="$p" 'BEGIN {printf "%.3f", a/p}')"
        cpu_ratios+=" $(awk -v a="$ac" -v p="$pc" 'BEGIN {printf "%.3f", a/p}')"
        echo "  run: P=$pipeline plain $p req/s ${pc} ns CPU/req, auth $a req/s ${ac} ns CPU/req" >&2
    done
    echo "P=$pipeline: req/s plain $(median <<<"$p_rates") ($(range <<<"$p_rates")), auth" \
        "$(median <<<"$a_rates") ($(range <<<"$a_rates")); auth/plain per run:$ratios" \
        "(median $(median <<<"$ratios"))"
    echo "P=$pipeline: server CPU ns/request plain $(median <<<"$p_cpus") ($(range <<<"$p_cpus")), auth" \
        "$(median <<<"$a_cpus") ($(range <<<"$a_cpus")); auth/plain per run:$cpu_ratios" \
        "(median $(median <<<"$cpu_ratios"))"
done
