#!/usr/bin/env bash
# kunci vs Redis as a lock server, side by side on this machine.
#
# Starts `kunci serve` and `redis-server` on loopback, runs the same
# connection count C and pipeline depth P against each, stops both by pid
# and prints medians and ratios. Installs nothing: it needs redis-server,
# redis-benchmark and redis-cli on PATH (e.g. `apt-get install redis-server`).
#
#   kunci:  kunci bench pairs           (A wait=0 on a random key, then R
#                                        with its token; 1,000,000 keys)
#   Redis:  SET key val NX PX 30000     (acquire)
#           EVAL compare-and-delete     (release)
#           on key:__rand_int__ with -r 1000000
#
# redis-benchmark runs one command per invocation, so a Redis "pair" rate
# is the harmonic combination of the two: 2 / (1/set + 1/eval) requests/s.
#
# Environment: RUNS (3), DURATION seconds per kunci run (10), KUNCI (the
# binary; built with cargo if absent), KUNCI_PORT (17862), REDIS_PORT (17863).
set -euo pipefail

RUNS=${RUNS:-3}
DURATION=${DURATION:-10}
KUNCI_PORT=${KUNCI_PORT:-17862}
REDIS_PORT=${REDIS_PORT:-17863}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
KUNCI=${KUNCI:-$ROOT/target/release/kunci}
# "C P redis-requests-per-command CPUS": requests sized for roughly 5-15 s
# per Redis run; CPUS "-" leaves placement to the scheduler, "S/C" pins the
# servers to CPU S and the load generators to CPU C (taskset). At C=1 P=1 a
# round trip is mostly the cost of waking the other process, which on a VM
# is far cheaper on the same core than across cores, so both are shown.
CASES=${CASES:-"50 32 4000000 -
50 1 400000 -
1 1 150000 -
1 1 1000000 0/0"}
RELEASE_LUA="if redis.call('get',KEYS[1])==ARGV[1] then return redis.call('del',KEYS[1]) else return 0 end"

for tool in redis-server redis-benchmark redis-cli taskset; do
    if ! command -v "$tool" >/dev/null; then
        echo "compare.sh: $tool not found; install Redis 7 (e.g. apt-get install redis-server)" >&2
        exit 2
    fi
done
if [ ! -x "$KUNCI" ]; then
    (cd "$ROOT" && cargo build --release)
fi

LOGS=$(mktemp -d)
KUNCI_PID=
REDIS_PID=
stop() {
    [ -n "$KUNCI_PID" ] && kill "$KUNCI_PID" 2>/dev/null && wait "$KUNCI_PID" 2>/dev/null
    [ -n "$REDIS_PID" ] && kill "$REDIS_PID" 2>/dev/null && wait "$REDIS_PID" 2>/dev/null
    rm -rf "$LOGS"
}
trap stop EXIT

"$KUNCI" serve --no-state-dir --listen "127.0.0.1:$KUNCI_PORT" 2>"$LOGS/kunci.log" &
KUNCI_PID=$!
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
    >"$LOGS/redis.log" 2>&1 &
REDIS_PID=$!

for _ in $(seq 100); do
    if "$KUNCI" ping --server "127.0.0.1:$KUNCI_PORT" >/dev/null 2>&1 &&
        redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1; then
        break
    fi
    sleep 0.1
done
"$KUNCI" ping --server "127.0.0.1:$KUNCI_PORT" >/dev/null
redis-cli -p "$REDIS_PORT" ping >/dev/null

# The number after "name": in a JSON line (first occurrence).
json_field() { grep -o "\"$2\":[0-9.]*" <<<"$1" | head -1 | cut -d: -f2; }
# Column N of redis-benchmark's CSV data line, unquoted.
csv_field() { tail -1 <<<"$1" | awk -F'","' -v n="$2" '{gsub(/"/, "", $n); print $n}'; }
median() { tr ' ' '\n' | grep . | sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
range() { tr ' ' '\n' | grep . | sort -g | awk 'NR==1{lo=$1} {hi=$1} END {print lo "-" hi}'; }

echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -sr)"
echo "kunci $("$KUNCI" --version | cut -d' ' -f2), $(redis-server --version | cut -d' ' -f3)"
echo "runs per case: $RUNS (median, min-max); requests/s counts every request of a pair"
echo
printf '%-9s %-28s %-28s %-8s %-16s %-16s\n' "C P cpus" "kunci req/s" "Redis pair req/s" "ratio" "kunci p99 ms" "Redis p99 ms"
ALL_CPUS="0-$(($(nproc) - 1))"
while read -r C P N CPUS; do
    k_rates= r_rates= k_p99s= r_p99s= ratios=
    if [ "${CPUS:--}" = - ]; then
        server_cpus=$ALL_CPUS client=()
    else
        server_cpus=${CPUS%/*} client=(taskset -c "${CPUS#*/}")
    fi
    taskset -pc "$server_cpus" "$KUNCI_PID" >/dev/null
    taskset -pc "$server_cpus" "$REDIS_PID" >/dev/null
    for _ in $(seq "$RUNS"); do
        k=$("${client[@]}" "$KUNCI" bench pairs --server "127.0.0.1:$KUNCI_PORT" --connections "$C" \
            --pipeline "$P" --duration "$DURATION" --warmup 2 --json)
        if [ "$(json_field "$k" errors)" != 0 ]; then
            echo "compare.sh: kunci bench reported errors: $k" >&2
            exit 1
        fi
        k_rate=$(json_field "$k" requests_per_s)
        # The worse of acquire and release p99, in ms.
        k_p99=$(grep -o '"p99":[0-9]*' <<<"$k" | cut -d: -f2 | sort -n | tail -1 |
            awk '{printf "%.3f", $1/1000}')
        set_csv=$("${client[@]}" redis-benchmark -h 127.0.0.1 -p "$REDIS_PORT" -c "$C" -P "$P" -n "$N" \
            -r 1000000 --csv SET key:__rand_int__ val NX PX 30000)
        eval_csv=$("${client[@]}" redis-benchmark -h 127.0.0.1 -p "$REDIS_PORT" -c "$C" -P "$P" -n "$N" \
            -r 1000000 --csv EVAL "$RELEASE_LUA" 1 key:__rand_int__ val)
        set_rate=$(csv_field "$set_csv" 2)
        eval_rate=$(csv_field "$eval_csv" 2)
        r_rate=$(awk -v s="$set_rate" -v e="$eval_rate" 'BEGIN {printf "%.1f", 2/(1/s + 1/e)}')
        r_p99=$(printf '%s\n%s\n' "$(csv_field "$set_csv" 7)" "$(csv_field "$eval_csv" 7)" |
            sort -g | tail -1)
        k_rates+=" $k_rate" r_rates+=" $r_rate" k_p99s+=" $k_p99" r_p99s+=" $r_p99"
        ratios+=" $(awk -v k="$k_rate" -v r="$r_rate" 'BEGIN {printf "%.2f", k/r}')"
        echo "  run: C=$C P=$P kunci $k_rate req/s p99 $k_p99 ms;" \
            "Redis SET $set_rate EVAL $eval_rate -> $r_rate req/s p99 $r_p99 ms" >&2
    done
    printf '%-9s %-28s %-28s %-8s %-16s %-16s\n' "$C $P $CPUS" \
        "$(median <<<"$k_rates") ($(range <<<"$k_rates"))" \
        "$(median <<<"$r_rates") ($(range <<<"$r_rates"))" \
        "$(median <<<"$ratios")x" \
        "$(median <<<"$k_p99s")" "$(median <<<"$r_p99s")"
done <<<"$CASES"
