#!/usr/bin/env bash
# kunci over TLS: `kunci bench pairs` over tls:// against Redis 7 over TLS
# (the same method as compare.sh), the same load over kunci's plaintext
# listener for the cost of TLS, the TLS connection set-up rate of both
# servers (openssl s_time, full handshakes), memory per idle TLS
# connection, and the binary's size with and without the `tls` feature.
#
# Makes a private CA and a certificate for localhost/127.0.0.1 with
# openssl in a temporary directory. Installs nothing: it needs
# redis-server, redis-benchmark, redis-cli (Debian 12's redis 7.0 has TLS)
# and openssl on PATH. Every server is started here on loopback and stopped
# by its pid.
#
# Environment: RUNS (3), DURATION seconds per kunci run (10), KUNCI (the
# binary, built if absent), PORT (17880: plaintext,
# +1 TLS, +2 Redis TLS).
set -euo pipefail

RUNS=${RUNS:-3}
DURATION=${DURATION:-10}
PORT=${PORT:-17880}
TLS_PORT=$((PORT + 1))
REDIS_PORT=$((PORT + 2))
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
KUNCI=${KUNCI:-$ROOT/target/release/kunci}
# "C P redis-requests-per-command", as in compare.sh.
CASES=${CASES:-"50 32 4000000
50 1 400000"}
RELEASE_LUA="if redis.call('get',KEYS[1])==ARGV[1] then return redis.call('del',KEYS[1]) else return 0 end"

for tool in redis-server redis-benchmark redis-cli openssl; do
    if ! command -v "$tool" >/dev/null; then
        echo "tls.sh: $tool not found (apt-get install redis-server redis-tools openssl)" >&2
        exit 2
    fi
done
if [ ! -x "$KUNCI" ]; then
    (cd "$ROOT" && cargo build --release)
fi

DIR=$(mktemp -d)
KUNCI_PID=
REDIS_PID=
LOAD_PID=
stop() {
    [ -n "$LOAD_PID" ] && kill -INT "$LOAD_PID" 2>/dev/null && wait "$LOAD_PID" 2>/dev/null
    [ -n "$KUNCI_PID" ] && kill "$KUNCI_PID" 2>/dev/null && wait "$KUNCI_PID" 2>/dev/null
    [ -n "$REDIS_PID" ] && kill "$REDIS_PID" 2>/dev/null && wait "$REDIS_PID" 2>/dev/null
    rm -rf "$DIR"
}
trap stop EXIT

# A P-256 CA and a server certificate for localhost and 127.0.0.1.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$DIR/ca.key" -out "$DIR/ca.pem" -days 2 -subj "/CN=bench CA" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$DIR/server.key" -out "$DIR/server.csr" -subj "/CN=localhost" 2>/dev/null
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' >"$DIR/ext"
openssl x509 -req -in "$DIR/server.csr" -CA "$DIR/ca.pem" -CAkey "$DIR/ca.key" \
    -CAcreateserial -out "$DIR/server.pem" -days 2 -extfile "$DIR/ext" 2>/dev/null
TLS_ARGS=(--tls-ca "$DIR/ca.pem")

start_kunci() {
    "$KUNCI" serve --no-state-dir --listen "127.0.0.1:$PORT" --listen "tls://127.0.0.1:$TLS_PORT" \
        --tls-cert "$DIR/server.pem" --tls-key "$DIR/server.key" "$@" 2>"$DIR/kunci.log" &
    KUNCI_PID=$!
    for _ in $(seq 100); do
        "$KUNCI" ping --server "tls://localhost:$TLS_PORT" "${TLS_ARGS[@]}" >/dev/null 2>&1 && return
        sleep 0.1
    done
    echo "tls.sh: kunci did not start: $(cat "$DIR/kunci.log")" >&2
    exit 1
}
stop_kunci() {
    kill "$KUNCI_PID" 2>/dev/null || true
    wait "$KUNCI_PID" 2>/dev/null || true
    KUNCI_PID=
}

json_field() { grep -o "\"$2\":[0-9.]*" <<<"$1" | head -1 | cut -d: -f2; }
csv_field() { tail -1 <<<"$1" | awk -F'","' -v n="$2" '{gsub(/"/, "", $n); print $n}'; }
median() { tr ' ' '\n' | grep . | sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
range() { tr ' ' '\n' | grep . | sort -g | awk 'NR==1{lo=$1} {hi=$1} END {print lo "-" hi}'; }
status() { awk -v k="$1:" '$1 == k {print $2}' "/proc/$KUNCI_PID/status"; }

echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -sr)"
echo "kunci $("$KUNCI" --version | cut -d' ' -f2) ($(stat -c %s "$KUNCI") bytes), $(redis-server --version | cut -d' ' -f3), $(openssl version)"

start_kunci
redis-server --port 0 --tls-port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
    --tls-cert-file "$DIR/server.pem" --tls-key-file "$DIR/server.key" \
    --tls-ca-cert-file "$DIR/ca.pem" --tls-auth-clients no >"$DIR/redis.log" 2>&1 &
REDIS_PID=$!
REDIS_TLS=(--tls --cacert "$DIR/ca.pem" -h 127.0.0.1 -p "$REDIS_PORT")
for _ in $(seq 100); do
    redis-cli "${REDIS_TLS[@]}" ping >/dev/null 2>&1 && break
    sleep 0.1
done
redis-cli "${REDIS_TLS[@]}" ping >/dev/null

echo "runs per case: $RUNS (median, min-max); requests/s counts every request of a pair"
printf '%-6s %-26s %-26s %-26s %-8s %-8s\n' "C P" "kunci TLS req/s" "kunci plain req/s" \
    "Redis TLS pair req/s" "TLS/Redis" "TLS/plain"
while read -r C P N; do
    t_rates= p_rates= r_rates= ratios= costs=
    for _ in $(seq "$RUNS"); do
        t=$("$KUNCI" bench pairs --server "tls://localhost:$TLS_PORT" "${TLS_ARGS[@]}" \
            --connections "$C" --pipeline "$P" --duration "$DURATION" --warmup 2 --json)
        p=$("$KUNCI" bench pairs --server "127.0.0.1:$PORT" \
            --connections "$C" --pipeline "$P" --duration "$DURATION" --warmup 2 --json)
        for j in "$t" "$p"; do
            if [ "$(json_field "$j" errors)" != 0 ]; then
                echo "tls.sh: kunci bench reported errors: $j" >&2
                exit 1
            fi
        done
        set_csv=$(redis-benchmark "${REDIS_TLS[@]}" -c "$C" -P "$P" -n "$N" \
            -r 1000000 --csv SET key:__rand_int__ val NX PX 30000)
        eval_csv=$(redis-benchmark "${REDIS_TLS[@]}" -c "$C" -P "$P" -n "$N" \
            -r 1000000 --csv EVAL "$RELEASE_LUA" 1 key:__rand_int__ val)
        t_rate=$(json_field "$t" requests_per_s) p_rate=$(json_field "$p" requests_per_s)
        set_rate=$(csv_field "$set_csv" 2) eval_rate=$(csv_field "$eval_csv" 2)
        r_rate=$(awk -v s="$set_rate" -v e="$eval_rate" 'BEGIN {printf "%.1f", 2/(1/s + 1/e)}')
        t_rates+=" $t_rate" p_rates+=" $p_rate" r_rates+=" $r_rate"
        ratios+=" $(awk -v k="$t_rate" -v r="$r_rate" 'BEGIN {printf "%.2f", k/r}')"
        costs+=" $(awk -v t="$t_rate" -v p="$p_rate" 'BEGIN {printf "%.2f", t/p}')"
        echo "  run: C=$C P=$P kunci TLS $t_rate plain $p_rate;" \
            "Redis TLS SET $set_rate EVAL $eval_rate -> $r_rate req/s" >&2
    done
    printf '%-6s %-26s %-26s %-26s %-8s %-8s\n' "$C $P" \
        "$(median <<<"$t_rates") ($(range <<<"$t_rates"))" \
        "$(median <<<"$p_rates") ($(range <<<"$p_rates"))" \
        "$(median <<<"$r_rates") ($(range <<<"$r_rates"))" \
        "$(median <<<"$ratios")x" "$(median <<<"$costs")x"
done <<<"$CASES"

# TLS connection set-up: full handshakes (no resumption) per second for
# 10 s, openssl s_time as the client of both servers.
k_setups= r_setups=
for _ in $(seq "$RUNS"); do
    k=$(openssl s_time -connect "127.0.0.1:$TLS_PORT" -new -time 10 -CAfile "$DIR/ca.pem" 2>/dev/null |
        awk '/connections in .* real seconds/ {print $1 / $4}')
    r=$(openssl s_time -connect "127.0.0.1:$REDIS_PORT" -new -time 10 -CAfile "$DIR/ca.pem" 2>/dev/null |
        awk '/connections in .* real seconds/ {print $1 / $4}')
    k_setups+=" $k" r_setups+=" $r"
done
echo "TLS connections set up per second (openssl s_time -new, 10 s):" \
    "kunci $(median <<<"$k_setups") ($(range <<<"$k_setups")), Redis $(median <<<"$r_setups") ($(range <<<"$r_setups"))"
kill "$REDIS_PID" 2>/dev/null || true
wait "$REDIS_PID" 2>/dev/null || true
REDIS_PID=
stop_kunci

# Memory per idle TLS connection (after the handshake and one ping each),
# on a fresh server: RSS before and after.
COUNT=${COUNT:-10000}
start_kunci --max-connections $((COUNT + 100))
sleep 0.3
rss0=$(status VmRSS)
"$KUNCI" bench idle "$COUNT" --server "tls://localhost:$TLS_PORT" "${TLS_ARGS[@]}" >/dev/null &
LOAD_PID=$!
sleep $((5 + COUNT / 1000))
rss1=$(status VmRSS)
echo "idle TLS connection: RSS $rss0 -> $rss1 KiB: $(((rss1 - rss0) * 1024 / COUNT)) B each ($COUNT)"
kill -INT "$LOAD_PID" 2>/dev/null || true
wait "$LOAD_PID" 2>/dev/null || true
LOAD_PID=
stop_kunci
