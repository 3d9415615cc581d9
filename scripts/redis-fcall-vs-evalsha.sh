#!/usr/bin/env bash
# Server instructions per call of oncely's Redis claim script, sent as a
# script (EVALSHA) and as a Redis 7 function (FUNCTION LOAD + FCALL) with
# the same body: each runs N1 and then N2 calls on a fresh redis-server under
# callgrind, and the difference of the two totals over N2 - N1 calls is the
# cost of one call (startup and shutdown cancel out). Instruction counts do
# not depend on what else the machine is doing. Needs valgrind,
# redis-server, redis-cli and redis-benchmark; uses port 6399.
#
#   scripts/redis-fcall-vs-evalsha.sh [N1 N2]     (default 5000 25000)
#
# The calls claim random keys among N/2 (about half fresh, half duplicates
# of a record in progress), eight connections.
set -euo pipefail
cd "$(dirname "$0")/.."
N1=${1:-5000}
N2=${2:-25000}
PORT=6399
LUA=crates/oncely-redis/src/lua
work=$(mktemp -d)
trap 'redis-cli -p $PORT SHUTDOWN NOSAVE >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
cat "$LUA/prelude.lua" "$LUA/claim.lua" >"$work/script.lua"
{
    echo '#!lua name=oncely_measure'
    echo "redis.register_function('oncely_claim', function(KEYS, ARGV)"
    cat "$work/script.lua"
    echo 'end)'
} >"$work/lib.lua"

run() { # kind calls: prints callgrind's instruction total
    local kind=$1 n=$2 out="$work/cg.$1.$2"
    valgrind --tool=callgrind --callgrind-out-file="$out" \
        redis-server --port $PORT --save "" --appendonly no >/dev/null 2>&1 &
    local vp=$!
    for _ in $(seq 120); do redis-cli -p $PORT PING >/dev/null 2>&1 && break; sleep 0.5; done
    redis-cli -p $PORT FUNCTION LOAD "$(cat "$work/lib.lua")" >/dev/null
    local sha
    sha=$(redis-cli -p $PORT SCRIPT LOAD "$(cat "$work/script.lua")")
    local head
    if [[ $kind == evalsha ]]; then head=(EVALSHA "$sha"); else head=(FCALL oncely_claim); fi
    # ARGV: n, lease, retention, fingerprint, at-most-once, sent_at, waiter,
    # touch, then the record's effect key, horizon index and floor.
    redis-benchmark -p $PORT -q -n "$n" -c 8 -r $((n / 2)) "${head[@]}" 1 'k:__rand_int__' \
        1 30000000 86400000000 '' 0 '' '' '' 't/k/__rand_int__' '' '' >/dev/null 2>&1
    redis-cli -p $PORT SHUTDOWN NOSAVE >/dev/null 2>&1 || true
    wait "$vp" || true
    grep -m1 '^summary:' "$out" | awk '{print $2}'
}

for kind in evalsha fcall; do
    a=$(run "$kind" "$N1")
    b=$(run "$kind" "$N2")
    echo "$kind: $(((b - a) / (N2 - N1))) instructions per claim call"
done
