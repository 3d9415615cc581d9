#!/usr/bin/env bash
# A three-node NATS JetStream cluster on loopback, for oncely-nats tests.
#
#   scripts/nats-cluster.sh up            start (idempotent) and wait for a JetStream meta leader
#   scripts/nats-cluster.sh boot          start every node and return at once (no waiting)
#   scripts/nats-cluster.sh down          stop every node and remove the data directory
#   scripts/nats-cluster.sh stop-node N   stop node N (1-3), keep its data
#   scripts/nats-cluster.sh start-node N  start node N again and wait for the cluster
#   scripts/nats-cluster.sh urls          print the client URLs (comma-separated)
#   scripts/nats-cluster.sh status        print each node's pid or "down"
#
# Client ports 4301-4303, cluster ports 6301-6303, monitoring ports 8301-8303,
# unless ONCELY_NATS_CLUSTER_CLIENT_PORT, _ROUTE_PORT and _MONITOR_PORT name
# node 1's others (node N gets that + N - 1): a second cluster beside the
# default one needs its own ports and its own directory.
# State lives in $ONCELY_NATS_CLUSTER_DIR (default /tmp/oncely-nats-cluster);
# every command holds an flock on it, so parallel test binaries can call `up`.
# NATS_SERVER names the nats-server binary (default /usr/sbin/nats-server).
set -euo pipefail

NATS_SERVER=${NATS_SERVER:-/usr/sbin/nats-server}
DIR=${ONCELY_NATS_CLUSTER_DIR:-/tmp/oncely-nats-cluster}
LOCK=${DIR}.lock
CLIENT_PORT=${ONCELY_NATS_CLUSTER_CLIENT_PORT:-4301}
ROUTE_PORT=${ONCELY_NATS_CLUSTER_ROUTE_PORT:-6301}
MONITOR_PORT=${ONCELY_NATS_CLUSTER_MONITOR_PORT:-8301}
WAIT_SECS=${ONCELY_NATS_CLUSTER_WAIT:-30}

client_port() { echo $((CLIENT_PORT + $1 - 1)); }
route_port() { echo $((ROUTE_PORT + $1 - 1)); }
monitor_port() { echo $((MONITOR_PORT + $1 - 1)); }
ROUTES=nats://127.0.0.1:$(route_port 1),nats://127.0.0.1:$(route_port 2),nats://127.0.0.1:$(route_port 3)

urls() { echo "nats://127.0.0.1:$(client_port 1),nats://127.0.0.1:$(client_port 2),nats://127.0.0.1:$(client_port 3)"; }

pid_of() { # prints the pid of node $1 if it is running
    local f="$DIR/n$1.pid"
    [[ -f $f ]] || return 1
    local pid
    pid=$(cat "$f" 2>/dev/null) || return 1
    [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null && grep -q nats-server "/proc/$pid/cmdline" 2>/dev/null || return 1
    echo "$pid"
}

start_node() {
    local n=$1
    if pid_of "$n" >/dev/null; then return 0; fi
    mkdir -p "$DIR/n$n"
    # setsid + nohup: the node outlives the test process that started it.
    setsid nohup "$NATS_SERVER" -a 127.0.0.1 -p "$(client_port "$n")" -m "$(monitor_port "$n")" -js -sd "$DIR/n$n" \
        --cluster_name oncely-test --cluster "nats://127.0.0.1:$(route_port "$n")" --routes "$ROUTES" \
        -n "n$n" -P "$DIR/n$n.pid" -l "$DIR/n$n.log" </dev/null >/dev/null 2>&1 9>&- &
    for _ in $(seq 1 50); do
        pid_of "$n" >/dev/null && return 0
        sleep 0.1
    done
    echo "node n$n did not start; see $DIR/n$n.log" >&2
    return 1
}

stop_node() {
    local n=$1 pid
    pid=$(pid_of "$n") || { rm -f "$DIR/n$n.pid"; return 0; }
    # SIGKILL: a node loss is a crash, not a graceful shutdown.
    kill -9 "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do
        kill -0 "$pid" 2>/dev/null || { rm -f "$DIR/n$n.pid"; return 0; }
        sleep 0.1
    done
    echo "node n$n (pid $pid) did not exit" >&2
    return 1
}

# Waits until every running node reports the same JetStream meta leader.
wait_ready() {
    local deadline=$((SECONDS + WAIT_SECS)) running
    while ((SECONDS < deadline)); do
        running=()
        for n in 1 2 3; do pid_of "$n" >/dev/null && running+=("$(monitor_port "$n")"); done
        if python3 - "${running[@]}" <<'EOF'; then return 0; fi
import json, sys, urllib.request
leaders = set()
for port in sys.argv[1:]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/jsz", timeout=1) as r:
            meta = json.load(r).get("meta_cluster") or {}
    except Exception:
        sys.exit(1)
    leader = meta.get("leader")
    if not leader:
        sys.exit(1)
    leaders.add(leader)
sys.exit(0 if len(leaders) == 1 and len(sys.argv) > 2 else 1)
EOF
        sleep 0.2
    done
    echo "the NATS cluster has no JetStream meta leader after ${WAIT_SECS}s; logs in $DIR" >&2
    return 1
}

cmd=${1:-}
node=${2:-}
case $cmd in
    up | boot | down | stop-node | start-node | status) ;;
    urls) urls; exit 0 ;;
    *) echo "usage: $0 up|boot|down|stop-node N|start-node N|urls|status" >&2; exit 2 ;;
esac
if [[ $cmd == stop-node || $cmd == start-node ]] && [[ ! $node =~ ^[123]$ ]]; then
    echo "node must be 1, 2 or 3" >&2
    exit 2
fi

exec 9>"$LOCK"
flock 9

case $cmd in
    up)
        mkdir -p "$DIR"
        for n in 1 2 3; do start_node "$n"; done
        wait_ready
        urls
        ;;
    boot)
        mkdir -p "$DIR"
        for n in 1 2 3; do start_node "$n"; done
        ;;
    down)
        for n in 1 2 3; do stop_node "$n"; done
        rm -rf "$DIR"
        ;;
    stop-node) stop_node "$node" ;;
    start-node)
        start_node "$node"
        wait_ready
        ;;
    status)
        for n in 1 2 3; do echo "n$n $(pid_of "$n" || echo down)"; done
        ;;
esac
