#!/usr/bin/env bash
# A three-master Redis Cluster on 127.0.0.1:7000-7002 for oncely-redis's tests.
#   scripts/redis-cluster.sh up     start it (idempotent; safe to run concurrently)
#   scripts/redis-cluster.sh down   stop it and remove its files
# Nothing is durable (--save "" --appendonly no): it is a test fixture.
set -euo pipefail

DIR=${ONCELY_REDIS_CLUSTER_DIR:-/tmp/oncely-redis-cluster}
LOCK=${DIR}.lock
PORTS=(7000 7001 7002)

info() { redis-cli -h 127.0.0.1 -p "$1" cluster info 2>/dev/null | tr -d '\r'; }
pings() { [ "$(redis-cli -h 127.0.0.1 -p "$1" ping 2>/dev/null)" = PONG ]; }

all_ok() {
  local p
  for p in "${PORTS[@]}"; do
    info "$p" | grep -qx 'cluster_state:ok' || return 1
    info "$p" | grep -qx "cluster_known_nodes:${#PORTS[@]}" || return 1
  done
}

wait_ok() { # seconds
  local i
  for ((i = 0; i < $1 * 10; i++)); do
    all_ok && return 0
    sleep 0.1
  done
  return 1
}

stop_nodes() {
  local p i
  for p in "${PORTS[@]}"; do
    redis-cli -h 127.0.0.1 -p "$p" shutdown nosave >/dev/null 2>&1 || true
  done
  for p in "${PORTS[@]}"; do
    for ((i = 0; i < 100; i++)); do
      pings "$p" || break
      sleep 0.1
    done
    if pings "$p"; then
      echo "redis on port $p did not shut down" >&2
      return 1
    fi
  done
  rm -rf "$DIR"
}

start_nodes() {
  local p i
  mkdir -p "$DIR"
  for p in "${PORTS[@]}"; do
    pings "$p" && continue
    redis-server --port "$p" --cluster-enabled yes --cluster-config-file "$DIR/nodes-$p.conf" \
      --dir "$DIR" --daemonize yes --save "" --appendonly no --bind 127.0.0.1 \
      --logfile "$DIR/$p.log" --cluster-node-timeout 5000 9>&-
  done
  for p in "${PORTS[@]}"; do
    for ((i = 0; i < 100; i++)); do
      pings "$p" && break
      sleep 0.1
    done
    pings "$p" || { echo "redis on port $p did not start; see $DIR/$p.log" >&2; return 1; }
  done
}

create() {
  local nodes=() p
  for p in "${PORTS[@]}"; do nodes+=("127.0.0.1:$p"); done
  redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >"$DIR/create.log" 2>&1 || {
    cat "$DIR/create.log" >&2
    return 1
  }
}

up() {
  all_ok && return 0
  start_nodes
  if info "${PORTS[0]}" | grep -qx 'cluster_slots_assigned:0'; then
    create
  fi
  wait_ok 30 && return 0
  # Half-built or stale (nodes left from an earlier run): start afresh once.
  echo "redis cluster not ok; recreating it" >&2
  stop_nodes
  start_nodes
  create
  wait_ok 30 || { echo "redis cluster did not reach cluster_state:ok" >&2; return 1; }
}

case "${1:-}" in
  up | down)
    mkdir -p "$(dirname "$LOCK")"
    exec 9>"$LOCK"
    flock -w 180 9
    if [ "$1" = up ]; then up; else stop_nodes; fi
    ;;
  *)
    echo "usage: $0 up|down" >&2
    exit 2
    ;;
esac
