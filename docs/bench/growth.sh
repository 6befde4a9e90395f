#!/usr/bin/env bash
# How cost grows, kunci and Redis side by side in one run:
#
#   1. `pairs` at C=50 P=32 and C=50 P=1 with 0 / 10 k / 100 k / 1 M / 4 M
#      other locks held, and each server's RSS at each size;
#   2. `pairs` at C=1,000 and C=10,000 connections, P=1;
#   3. kunci's contended workload: 1 hot key, 50 and 1,000 waiters, each
#      grant held 0 and 1 ms (Redis has no waiting acquire to compare).
#
# Redis is used as in compare.sh: `SET key val NX PX 30000` and the Lua
# compare-and-delete, each run by redis-benchmark on `key:__rand_int__`
# (-r 1000000); its pair rate is 2 / (1/set + 1/eval) and its p99 the worse
# of the two. Locks held: kunci `bench hold` (17-byte keys, 255 s leases,
# renewed every 85 s), Redis `SET held:NNNNNNNNNNNN <16 bytes> PX 3600000`
# sent with `redis-cli --pipe` (17-byte keys). Runs alternate kunci, Redis,
# kunci, Redis... and the ratio is taken within each run.
#
# Loopback only; servers and loads are stopped by pid. Raises the soft fd
# limit of this shell (so of both servers and load generators) to NOFILE
# or the hard limit, whichever is lower (C=10,000 needs ~10,050).
# Writes the raw medians to OUT (docs/bench/growth.tsv) and draws
# docs/bench/growth.svg from it with plot_growth.py.
#
# Environment: RUNS (3), DURATION seconds per kunci run (3), HELD (sizes),
# CONNS ("1000 10000"), SKIP (any of "held conns contended"), KUNCI,
# KUNCI_PORT (17866), REDIS_PORT (17867), NOFILE (65536), OUT.
set -euo pipefail

RUNS=${RUNS:-3}
DURATION=${DURATION:-3}
HELD=${HELD:-"0 10000 100000 1000000 4000000"}
CONNS=${CONNS:-"1000 10000"}
SKIP=${SKIP:-}
KUNCI_PORT=${KUNCI_PORT:-17866}
REDIS_PORT=${REDIS_PORT:-17867}
NOFILE=${NOFILE:-65536}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
KUNCI=${KUNCI:-$ROOT/target/release/kunci}
OUT=${OUT:-$HERE/growth.tsv}
KADDR=127.0.0.1:$KUNCI_PORT
RELEASE_LUA="if redis.call('get',KEYS[1])==ARGV[1] then return redis.call('del',KEYS[1]) else return 0 end"

for tool in redis-server redis-benchmark redis-cli python3; do
    if ! command -v "$tool" >/dev/null; then
        echo "growth.sh: $tool not found (apt-get install redis-server python3)" >&2
        exit 2
    fi
done
if [ ! -x "$KUNCI" ]; then
    (cd "$ROOT" && cargo build --release)
fi
# Raise the soft fd limit towards NOFILE, as far as the hard limit allows.
hard=$(ulimit -Hn)
if [ "$hard" = unlimited ] || [ "$hard" -ge "$NOFILE" ]; then
    ulimit -n "$NOFILE"
else
    ulimit -n "$hard"
fi

LOGS=$(mktemp -d)
KUNCI_PID=
REDIS_PID=
HOLD_PIDS=()
stop() {
    for pid in "${HOLD_PIDS[@]}"; do kill -INT "$pid" 2>/dev/null || true; done
    [ -n "$KUNCI_PID" ] && kill "$KUNCI_PID" 2>/dev/null
    [ -n "$REDIS_PID" ] && kill "$REDIS_PID" 2>/dev/null
    wait 2>/dev/null || true
    rm -rf "$LOGS"
}
trap stop EXIT

"$KUNCI" serve --no-state-dir --listen "$KADDR" --max-keys 8000000 --max-connections 20000 \
    2>"$LOGS/kunci.log" &
KUNCI_PID=$!
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
    --maxclients 20000 >"$LOGS/redis.log" 2>&1 &
REDIS_PID=$!
for _ in $(seq 100); do
    if "$KUNCI" ping --server "$KADDR" >/dev/null 2>&1 &&
        redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1; then
        break
    fi
    sleep 0.1
done
"$KUNCI" ping --server "$KADDR" >/dev/null
redis-cli -p "$REDIS_PORT" ping >/dev/null

json_field() { grep -o "\"$2\":[0-9.]*" <<<"$1" | head -1 | cut -d: -f2; }
# The object "NAME":{...} of a JSON line, then FIELD in it.
json_sub() { grep -o "\"$2\":{[^}]*}" <<<"$1" | head -1 | grep -o "\"$3\":[0-9.]*" | cut -d: -f2; }
csv_field() { tail -1 <<<"$1" | awk -F'","' -v n="$2" '{gsub(/"/, "", $n); print $n}'; }
median() { tr ' ' '\n' | grep . | sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
range() { tr ' ' '\n' | grep . | sort -g | awk 'NR==1{lo=$1} {hi=$1} END {print lo "-" hi}'; }
rss_kib() { awk '$1 == "VmRSS:" {print $2}' "/proc/$1/status"; }
kinfo() { "$KUNCI" info --server "$KADDR" | tr ' ' '\n' | awk -F= -v k="$1" '$1 == k {print $2}'; }
skip() { [[ " $SKIP " == *" $1 "* ]]; }

# kunci pairs: prints "req/s p99-ms" (p99 the worse of acquire and release).
kunci_pairs() { # C P [extra bench args]
    local out
    out=$("$KUNCI" bench pairs --server "$KADDR" --connections "$1" --pipeline "$2" \
        --duration "$DURATION" "${@:3}" --json)
    if [ "$(json_field "$out" errors)" != 0 ]; then
        echo "growth.sh: kunci bench reported errors: $out" >&2
        exit 1
    fi
    local p99
    p99=$(grep -o '"p99":[0-9]*' <<<"$out" | cut -d: -f2 | sort -n | tail -1 |
        awk '{printf "%.3f", $1/1000}')
    echo "$(json_field "$out" requests_per_s) $p99"
}
# Redis pairs: prints "req/s p99-ms" for N requests of each command.
redis_pairs() { # C P N
    local set_csv eval_csv
    set_csv=$(redis-benchmark -h 127.0.0.1 -p "$REDIS_PORT" -c "$1" -P "$2" -n "$3" \
        -r 1000000 --csv SET key:__rand_int__ val NX PX 30000)
    eval_csv=$(redis-benchmark -h 127.0.0.1 -p "$REDIS_PORT" -c "$1" -P "$2" -n "$3" \
        -r 1000000 --csv EVAL "$RELEASE_LUA" 1 key:__rand_int__ val)
    awk -v s="$(csv_field "$set_csv" 2)" -v e="$(csv_field "$eval_csv" 2)" \
        -v sp="$(csv_field "$set_csv" 7)" -v ep="$(csv_field "$eval_csv" 7)" \
        'BEGIN {printf "%.1f %.3f\n", 2/(1/s + 1/e), (sp > ep ? sp : ep)}'
}
# Runs RUNS alternating kunci/Redis pairs and prints one table row; appends
# "label kunci-rate kunci-p99 redis-rate redis-p99 ratio" to OUT.
compare_row() { # LABEL C P REDIS-N [extra kunci args]
    local label=$1 c=$2 p=$3 n=$4
    local k_rates= k_p99s= r_rates= r_p99s= ratios= k r
    for _ in $(seq "$RUNS"); do
        read -r k_rate k_p99 < <(kunci_pairs "$c" "$p" "${@:5}")
        read -r r_rate r_p99 < <(redis_pairs "$c" "$p" "$n")
        k_rates+=" $k_rate" k_p99s+=" $k_p99" r_rates+=" $r_rate" r_p99s+=" $r_p99"
        ratios+=" $(awk -v k="$k_rate" -v r="$r_rate" 'BEGIN {printf "%.2f", k/r}')"
        echo "  run: $label C=$c P=$p: kunci $k_rate req/s p99 $k_p99 ms;" \
            "Redis $r_rate req/s p99 $r_p99 ms" >&2
    done
    k=$(median <<<"$k_rates") r=$(median <<<"$r_rates")
    printf '| %s | %s | %s (%s) | %s (%s) | %s | %s (%s) | %s (%s) |\n' "$label" "$c/$p" \
        "$k" "$(range <<<"$k_rates")" "$r" "$(range <<<"$r_rates")" \
        "$(median <<<"$ratios")× ($(tr ' ' '\n' <<<"$ratios" | grep . | paste -sd/))" \
        "$(median <<<"$k_p99s")" "$(range <<<"$k_p99s")" \
        "$(median <<<"$r_p99s")" "$(range <<<"$r_p99s")"
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$label" "$c" "$p" "$k" "$(median <<<"$k_p99s")" \
        "$r" "$(median <<<"$r_p99s")" "$(median <<<"$ratios")" >>"$OUT"
}

echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)," \
    "$(uname -sr); $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "kunci $("$KUNCI" --version | cut -d' ' -f2), $(redis-server --version | cut -d' ' -f3)"
echo "runs: $RUNS, kunci $DURATION s each after a 2 s warm-up; medians (min-max); ratio = kunci/Redis per run"
printf 'section\tC\tP\tkunci_rps\tkunci_p99_ms\tredis_rps\tredis_p99_ms\tratio\n' >"$OUT"

if ! skip held; then
    echo
    echo "## pairs with other locks held"
    echo
    echo "| held | C/P | kunci req/s | Redis req/s | kunci ÷ Redis (per run) | kunci p99 ms | Redis p99 ms |"
    echo "|---|---|---|---|---|---|---|"
    filled=0 part=0 rss_lines=
    for held in $HELD; do
        # The previous level's Redis runs left up to ~1,000,000 `key:*`
        # locks (SET runs ahead of the EVAL runs); remove them so that
        # each level starts with only the held keys.
        redis-cli -p "$REDIS_PORT" --scan --pattern 'key:*' |
            awk '{printf "*2\r\n$6\r\nUNLINK\r\n$%d\r\n%s\r\n", length($0), $0}' |
            redis-cli -p "$REDIS_PORT" --pipe >/dev/null
        if [ "$held" -gt "$filled" ]; then
            part=$((part + 1))
            # kunci: another process holds the keys (its own 4 connections).
            "$KUNCI" bench hold $((held - filled)) --server "$KADDR" --key-prefix "hld$part-" \
                --lease 255 >/dev/null &
            HOLD_PIDS+=($!)
            # Redis: the same number of 17-byte keys with a value and a TTL.
            awk -v from="$filled" -v to="$held" 'BEGIN {
                for (i = from; i < to; i++)
                    printf "*5\r\n$3\r\nSET\r\n$17\r\nheld:%012d\r\n$16\r\n%016d\r\n$2\r\nPX\r\n$7\r\n3600000\r\n", i, i
            }' | redis-cli -p "$REDIS_PORT" --pipe >/dev/null
            for _ in $(seq 3000); do
                [ "$(kinfo held)" -ge "$held" ] && break
                sleep 0.1
            done
            filled=$held
        fi
        k_rss=$(rss_kib "$KUNCI_PID") r_rss=$(rss_kib "$REDIS_PID")
        r_used=$(redis-cli -p "$REDIS_PORT" info memory | tr -d '\r' |
            awk -F: '$1 == "used_memory" {printf "%d", $2 / 1024}')
        rss_lines+="| $held | $k_rss | $r_rss | $r_used |"$'\n'
        printf 'rss\t%s\t-\t%s\t-\t%s\t%s\t-\n' "$held" "$k_rss" "$r_rss" "$r_used" >>"$OUT"
        compare_row "$held" 50 32 1500000 --warmup 1
        compare_row "$held" 50 1 300000 --warmup 1
    done
    echo
    echo "Server RSS after the locks were taken (before the runs):"
    echo
    echo "| held | kunci RSS KiB | Redis RSS KiB | Redis used_memory KiB |"
    echo "|---|---|---|---|"
    printf '%s' "$rss_lines"
    for pid in "${HOLD_PIDS[@]}"; do kill -INT "$pid" 2>/dev/null || true; done
    for pid in "${HOLD_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    HOLD_PIDS=()
    redis-cli -p "$REDIS_PORT" flushall >/dev/null
fi

if ! skip conns; then
    echo
    echo "## many connections, P=1 (empty table)"
    echo
    echo "| case | C/P | kunci req/s | Redis req/s | kunci ÷ Redis (per run) | kunci p99 ms | Redis p99 ms |"
    echo "|---|---|---|---|---|---|---|"
    for c in $CONNS; do
        # Opening thousands of connections at once overflows the listen
        # backlogs (kunci 128 via mio, Redis 511), and dropped SYNs are
        # retried after 1 s and 3 s: establishing 10,000 takes seconds.
        # kunci's warm-up must cover that (2 s + 0.6 s per 1,000), and
        # redis-benchmark, which counts it, gets more requests to amortize.
        compare_row "conns" "$c" 1 $((150000 + c * 40)) --warmup $((2 + c * 6 / 10000))
    done
fi

if ! skip contended; then
    echo
    echo "## contended: one hot key (kunci)"
    echo
    echo "| waiters | hold ms | grants/s (min-max) | wait p50 ms | wait p99 ms (min-max) | grants per connection min / max |"
    echo "|---|---|---|---|---|---|"
    for c in 50 1000; do
        for hold in 0 1; do
            rates= p99s= p50s= fair=
            for _ in $(seq "$RUNS"); do
                out=$("$KUNCI" bench contended --server "$KADDR" --connections "$c" --keys 1 \
                    --hold "$hold" --duration "$DURATION" --warmup 1 --json)
                if [ "$(json_field "$out" errors)" != 0 ]; then
                    echo "growth.sh: kunci bench reported errors: $out" >&2
                    exit 1
                fi
                rate=$(json_sub "$out" counters grants_per_s)
                p99=$(json_sub "$out" acquire p99 | awk '{printf "%.3f", $1/1000}')
                p50=$(json_sub "$out" acquire p50 | awk '{printf "%.3f", $1/1000}')
                min=$(json_sub "$out" counters grants_per_conn_min)
                max=$(json_sub "$out" counters grants_per_conn_max)
                rates+=" $rate" p99s+=" $p99" p50s+=" $p50" fair+=" $min/$max"
                echo "  run: contended C=$c hold=$hold: $rate grants/s, wait p99 $p99 ms," \
                    "per connection $min..$max" >&2
            done
            printf '| %s | %s | %s (%s) | %s | %s (%s) | %s |\n' "$c" "$hold" \
                "$(median <<<"$rates")" "$(range <<<"$rates")" "$(median <<<"$p50s")" \
                "$(median <<<"$p99s")" "$(range <<<"$p99s")" "${fair# }"
            printf 'contended\t%s\t%s\t%s\t%s\t-\t-\t-\n' "$c" "$hold" "$(median <<<"$rates")" \
                "$(median <<<"$p99s")" >>"$OUT"
        done
    done
fi

if ! skip held; then
    python3 "$HERE/plot_growth.py" "$OUT" "$HERE/growth.svg"
    echo
    echo "plot: $HERE/growth.svg"
fi
