#!/usr/bin/env bash
# A Redis primary (127.0.0.1:6390), its replica (6391) and three Sentinels
# (26390-26392, quorum 2, master name "mymaster") for oncely-redis's
# failover tests (crates/oncely-redis/tests/sentinel.rs).
#   scripts/redis-sentinel.sh up     start it, the primary on 6390 (kept if it
#                                    already runs that way and is healthy; any
#                                    other state, such as after a failover, is
#                                    stopped and started afresh)
#   scripts/redis-sentinel.sh rejoin PORT
#                                    after a failover: stop the server on PORT
#                                    (the old primary, killed or frozen) and
#                                    start it again, with its data, as a
#                                    replica of the primary Sentinel names now
#   scripts/redis-sentinel.sh down   stop it and remove its files
# The primary and the replica run appendonly yes (appendfsync everysec), so a
# ledger opens them without ?ephemeral=true. Sentinels declare a master down
# after 1 s; a failover may take 10 s before it is retried. Only the
# redis-server binary is needed: Sentinels run as `redis-server --sentinel`
# (the redis-sentinel package installs nothing more).
set -euo pipefail

DIR=${ONCELY_REDIS_SENTINEL_DIR:-/tmp/oncely-redis-sentinel}
LOCK=${DIR}.lock
PRIMARY=6390
REPLICA=6391
SENTINELS=(26390 26391 26392)
NAME=mymaster

cli() { timeout 5 redis-cli -h 127.0.0.1 -p "$@" 2>/dev/null | tr -d '\r'; }
pings() { [ "$(cli "$1" ping)" = PONG ]; }

# One field of `SENTINEL master mymaster` (a flat name/value list).
sentinel_field() { # port field
  cli "$1" sentinel master "$NAME" | awk -v f="$2" 'NR % 2 == 1 && $0 == f { getline; print; exit }'
}

# The primary on 6390 with the replica online behind it, and every Sentinel
# agreeing, knowing the replica and the two other Sentinels.
healthy() {
  local p
  cli "$PRIMARY" role | head -n1 | grep -qx master || return 1
  cli "$REPLICA" info replication | grep -qx "master_port:$PRIMARY" || return 1
  cli "$REPLICA" info replication | grep -qx 'master_link_status:up' || return 1
  for p in "${SENTINELS[@]}"; do
    [ "$(sentinel_field "$p" port)" = "$PRIMARY" ] || return 1
    [ "$(sentinel_field "$p" flags)" = master ] || return 1
    [ "$(sentinel_field "$p" num-slaves)" = 1 ] || return 1
    [ "$(sentinel_field "$p" num-other-sentinels)" = 2 ] || return 1
    cli "$p" sentinel replicas "$NAME" | grep -qx slave || return 1
  done
}

wait_healthy() { # seconds
  local i
  for ((i = 0; i < $1 * 10; i++)); do
    healthy && return 0
    sleep 0.1
  done
  return 1
}

# Stops every process of the fixture, whatever its state: a test may leave a
# server stopped (SIGSTOP), which would never answer SHUTDOWN.
stop_all() {
  local f pid p i
  for f in "$DIR"/*.pid; do
    [ -e "$f" ] || continue
    pid=$(cat "$f" 2>/dev/null || true)
    [ -n "$pid" ] || continue
    kill -CONT "$pid" 2>/dev/null || true
    kill -KILL "$pid" 2>/dev/null || true
  done
  for p in "$PRIMARY" "$REPLICA" "${SENTINELS[@]}"; do
    for ((i = 0; i < 50; i++)); do
      pings "$p" || break
      cli "$p" shutdown nosave >/dev/null || true
      sleep 0.1
    done
    if pings "$p"; then
      echo "redis on port $p did not stop" >&2
      return 1
    fi
  done
  rm -rf "$DIR"
}

# A full copy to a (re)joining replica starts at once: Redis otherwise waits
# 5 s for more replicas to share the transfer (repl-diskless-sync-delay).
start_server() { # port [redis-server arguments...]
  local port=$1
  shift
  mkdir -p "$DIR/$port"
  redis-server --port "$port" --bind 127.0.0.1 --dir "$DIR/$port" --daemonize yes \
    --pidfile "$DIR/$port.pid" --logfile "$DIR/$port.log" \
    --appendonly yes --appendfsync everysec --save "" --repl-diskless-sync-delay 0 "$@" 9>&-
}

start_sentinel() { # port
  local conf="$DIR/sentinel-$1.conf"
  cat >"$conf" <<EOF
port $1
bind 127.0.0.1
daemonize yes
pidfile $DIR/sentinel-$1.pid
logfile $DIR/sentinel-$1.log
dir $DIR
sentinel monitor $NAME 127.0.0.1 $PRIMARY 2
sentinel down-after-milliseconds $NAME 1000
sentinel failover-timeout $NAME 10000
sentinel parallel-syncs $NAME 1
EOF
  redis-server "$conf" --sentinel 9>&-
}

rejoin() { # port
  local port=$1 primary pid i
  primary=$(cli "${SENTINELS[0]}" sentinel get-master-addr-by-name "$NAME" | tail -n1)
  if [ -z "$primary" ] || [ "$primary" = "$port" ]; then
    echo "Sentinel names no other primary than $port" >&2
    return 1
  fi
  pid=$(cat "$DIR/$port.pid" 2>/dev/null || true)
  if [ -n "$pid" ]; then
    kill -CONT "$pid" 2>/dev/null || true
    kill -KILL "$pid" 2>/dev/null || true
  fi
  for ((i = 0; i < 50; i++)); do
    pings "$port" || break
    sleep 0.1
  done
  start_server "$port" --replicaof 127.0.0.1 "$primary"
}

up() {
  healthy && return 0
  stop_all
  mkdir -p "$DIR"
  start_server "$PRIMARY"
  start_server "$REPLICA" --replicaof 127.0.0.1 "$PRIMARY"
  local p
  for p in "${SENTINELS[@]}"; do start_sentinel "$p"; done
  wait_healthy 60 || {
    echo "redis sentinel fixture did not become healthy; see $DIR/*.log" >&2
    return 1
  }
}

case "${1:-}" in
  up | down | rejoin)
    command -v redis-server >/dev/null || {
      echo "redis-server is not installed (apt-get install redis-server)" >&2
      exit 1
    }
    mkdir -p "$(dirname "$LOCK")"
    exec 9>"$LOCK"
    flock -w 180 9
    case "$1" in
      up) up ;;
      down) stop_all ;;
      rejoin) rejoin "${2:?usage: $0 rejoin PORT}" ;;
    esac
    ;;
  *)
    echo "usage: $0 up|down|rejoin PORT" >&2
    exit 2
    ;;
esac
