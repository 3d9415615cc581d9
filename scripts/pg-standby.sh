#!/usr/bin/env bash
# A PostgreSQL primary with a streaming standby on loopback, for the
# oncely-postgres failover tests and benchmarks.
#
#   scripts/pg-standby.sh up [sync|async]     start the pair (idempotent; the default
#                                             mode is sync) and print its URL
#   scripts/pg-standby.sh reset [sync|async]  throw the pair away and make a fresh one
#   scripts/pg-standby.sh down                stop both servers and remove their data
#   scripts/pg-standby.sh down-all            `down` for every pair under /tmp
#   scripts/pg-standby.sh kill-primary        SIGKILL the primary's every process (a crash)
#   scripts/pg-standby.sh freeze-primary      SIGSTOP them (a primary that stops answering)
#   scripts/pg-standby.sh promote             promote the standby and wait until it writes
#   scripts/pg-standby.sh url                 print the two-host URL
#   scripts/pg-standby.sh status              print each server's pid and role, or "down"
#
# The primary listens on $ONCELY_PG_STANDBY_PORT (default 5440: tests/failover.rs;
# tests/lost_claim.rs uses its own pair on 5442), the standby on the next port; both on 127.0.0.1 only, trust authentication, a database
# `test`. sync: `synchronous_standby_names = '*'` and `synchronous_commit =
# on` (a commit returns once the standby has flushed it); async: no
# synchronous standby. The standby is made with `pg_basebackup -R` and runs
# with no synchronous standby of its own, so it accepts commits once
# promoted. The data lives in /tmp/oncely-pg-<port> (owned by the postgres
# user: initdb refuses root); every command holds an flock on it, so parallel
# test binaries can call `up`.
set -euo pipefail

BIN=${ONCELY_PG_BIN:-/usr/lib/postgresql/15/bin}
PRIMARY_PORT=${ONCELY_PG_STANDBY_PORT:-5440}
STANDBY_PORT=$((PRIMARY_PORT + 1))
DIR=/tmp/oncely-pg-$PRIMARY_PORT
LOCK=$DIR.lock
WAIT_SECS=${ONCELY_PG_STANDBY_WAIT:-60}

url() {
    echo "postgres://postgres@127.0.0.1:$PRIMARY_PORT,127.0.0.1:$STANDBY_PORT/test?target_session_attrs=read-write"
}

# Runs a command as the postgres user (the servers refuse to run as root).
as_pg() {
    if [[ $(id -un) == postgres ]]; then
        "$@"
    else
        runuser -u postgres -- "$@"
    fi
}

psql_at() { # port sql
    PGCONNECT_TIMEOUT=2 "$BIN/psql" -X -q -h 127.0.0.1 -p "$1" -U postgres -d postgres -Atc "$2" 2>/dev/null
}

# The postmaster's pid of data directory $1 if it is alive.
postmaster() {
    local f="$DIR/$1/postmaster.pid" pid
    [[ -f $f ]] || return 1
    pid=$(head -n1 "$f" 2>/dev/null) || return 1
    [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 1
    grep -q postgres "/proc/$pid/cmdline" 2>/dev/null || return 1
    echo "$pid"
}

# The postmaster of $1 and its children: the whole server, as a machine
# failure takes it (killing the postmaster alone leaves its backends serving).
server_pids() {
    local pid
    pid=$(postmaster "$1") || return 1
    echo "$pid" $(pgrep -P "$pid" || true)
}

signal_server() { # signal name
    local pids
    pids=$(server_pids "$2") || { echo "the $2 is not running" >&2; return 1; }
    # shellcheck disable=SC2086
    kill "-$1" $pids
}

stop_server() { # name
    local pids
    pids=$(server_pids "$1") || return 0
    # SIGKILL works on a frozen (stopped) server too.
    # shellcheck disable=SC2086
    kill -9 $pids 2>/dev/null || true
    for _ in $(seq 1 100); do
        postmaster "$1" >/dev/null || return 0
        sleep 0.1
    done
    echo "the $1 (pids $pids) did not exit" >&2
    return 1
}

start_server() { # name
    # 9>&-: the server must not inherit (and so hold) the lock.
    as_pg "$BIN/pg_ctl" -D "$DIR/$1" -l "$DIR/$1.log" -w -t "$WAIT_SECS" start >/dev/null 9>&-
}

common_conf() { # port
    cat <<EOF
port = $1
listen_addresses = '127.0.0.1'
unix_socket_directories = '$DIR'
max_connections = 300
shared_buffers = 64MB
wal_level = replica
max_wal_senders = 5
wal_keep_size = 16MB
max_wal_size = 64MB
min_wal_size = 4MB
hot_standby = on
wal_receiver_status_interval = 1s
EOF
}

make_pair() { # mode
    local mode=$1 names="''"
    [[ $mode == sync ]] && names="'*'"
    rm -rf "$DIR"
    mkdir -p "$DIR"
    chown postgres: "$DIR" 2>/dev/null || true
    as_pg "$BIN/initdb" -D "$DIR/primary" -U postgres --auth=trust --no-sync --wal-segsize=1 -E UTF8 --locale=C >"$DIR/initdb.log"
    {
        common_conf "$PRIMARY_PORT"
        echo "synchronous_commit = on"
    } | as_pg tee -a "$DIR/primary/postgresql.conf" >/dev/null
    start_server primary
    as_pg "$BIN/createdb" -h 127.0.0.1 -p "$PRIMARY_PORT" -U postgres test
    as_pg "$BIN/pg_basebackup" -h 127.0.0.1 -p "$PRIMARY_PORT" -U postgres -D "$DIR/standby" \
        -R -X stream -c fast --no-sync
    {
        common_conf "$STANDBY_PORT"
        # Once promoted it has no standby: it must not wait for one.
        echo "synchronous_standby_names = ''"
    } | as_pg tee -a "$DIR/standby/postgresql.conf" >/dev/null
    echo "$mode" >"$DIR/mode"
    start_server standby
    # Only now: with no standby yet, every commit (CREATE DATABASE's too)
    # would wait for one.
    psql_at "$PRIMARY_PORT" "ALTER SYSTEM SET synchronous_standby_names = $names" >/dev/null
    psql_at "$PRIMARY_PORT" "SELECT pg_reload_conf()" >/dev/null
    wait_replicating "$mode"
}

# Waits until the primary streams to the standby, as a synchronous standby in
# sync mode.
wait_replicating() { # mode
    local want=async deadline=$((SECONDS + WAIT_SECS)) got
    [[ $1 == sync ]] && want=sync
    while ((SECONDS < deadline)); do
        got=$(psql_at "$PRIMARY_PORT" "SELECT sync_state FROM pg_stat_replication WHERE state = 'streaming'" || true)
        [[ $got == "$want" ]] && return 0
        sleep 0.1
    done
    echo "the standby is not streaming ($want) after ${WAIT_SECS}s; logs in $DIR" >&2
    return 1
}

# Whether the pair is as `up` leaves it: the primary writable, the standby
# in recovery and replicating in the wanted mode.
healthy() { # mode
    [[ -f $DIR/mode && $(cat "$DIR/mode") == "$1" ]] || return 1
    postmaster primary >/dev/null && postmaster standby >/dev/null || return 1
    [[ $(psql_at "$PRIMARY_PORT" "SELECT pg_is_in_recovery()") == f ]] || return 1
    [[ $(psql_at "$STANDBY_PORT" "SELECT pg_is_in_recovery()") == t ]] || return 1
    wait_replicating "$1" 2>/dev/null
}

role() { # port
    case $(psql_at "$1" "SELECT pg_is_in_recovery()" || true) in
        f) echo primary ;;
        t) echo standby ;;
        *) echo "not answering" ;;
    esac
}

cmd=${1:-}
mode=${2:-sync}
case $cmd in
    up | reset | down | down-all | kill-primary | freeze-primary | promote | status) ;;
    url) url; exit 0 ;;
    *) echo "usage: $0 up|reset [sync|async] | down|down-all|kill-primary|freeze-primary|promote|url|status" >&2; exit 2 ;;
esac
if [[ $mode != sync && $mode != async ]]; then
    echo "the mode is sync or async" >&2
    exit 2
fi

if [[ $cmd == down-all ]]; then
    for lock in /tmp/oncely-pg-*.lock; do
        [[ -e $lock ]] || continue
        port=${lock#/tmp/oncely-pg-}
        port=${port%.lock}
        [[ $port =~ ^[0-9]+$ ]] && ONCELY_PG_STANDBY_PORT=$port "$0" down
    done
    exit 0
fi

exec 9>"$LOCK"
flock 9

case $cmd in
    up)
        healthy "$mode" || { stop_server primary; stop_server standby; make_pair "$mode"; }
        url
        ;;
    reset)
        stop_server primary
        stop_server standby
        make_pair "$mode"
        url
        ;;
    down)
        stop_server primary
        stop_server standby
        rm -rf "$DIR"
        ;;
    kill-primary) signal_server KILL primary ;;
    freeze-primary) signal_server STOP primary ;;
    promote) as_pg "$BIN/pg_ctl" -D "$DIR/standby" -w -t "$WAIT_SECS" promote >/dev/null 9>&- ;;
    status)
        for s in primary standby; do
            port=$PRIMARY_PORT
            [[ $s == standby ]] && port=$STANDBY_PORT
            if pid=$(postmaster "$s"); then
                echo "$s $pid :$port $(role "$port")"
            else
                echo "$s down"
            fi
        done
        ;;
esac
