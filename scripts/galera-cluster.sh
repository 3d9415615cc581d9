#!/usr/bin/env bash
# A three-node MariaDB Galera cluster on loopback, for oncely-mysql tests.
#
#   scripts/galera-cluster.sh up        start (idempotent) and wait until every node is synced
#   scripts/galera-cluster.sh down      stop every node and remove the data directory
#   scripts/galera-cluster.sh kill N    SIGKILL node N (1-3), keep its data (a crash)
#   scripts/galera-cluster.sh stop N    shut node N down cleanly (it rejoins by IST, in seconds)
#   scripts/galera-cluster.sh freeze N  SIGSTOP node N: it stops answering, its sockets stay open
#   scripts/galera-cluster.sh thaw N    SIGCONT node N and wait until every node is synced again
#   scripts/galera-cluster.sh start N   start node N again (it rejoins) and wait for the cluster;
#                                       with ONCELY_GALERA_FAKETIME=OFFSET (libfaketime's form,
#                                       e.g. +8 for 8 s ahead) its clock runs off by OFFSET
#   scripts/galera-cluster.sh recover   if every running node answers and none has been in the
#                                       primary component for 10 s (quorum lost: a starved
#                                       machine can split the survivors of a kill), bootstrap the
#                                       most advanced one (pc.bootstrap) and wait for the cluster;
#                                       prints "re-bootstrapped nN" when it did
#   scripts/galera-cluster.sh urls      print the client URLs (comma-separated)
#   scripts/galera-cluster.sh status    print each node's pid or "down"
#
# Client ports 3311-3313, Galera replication ports 4571-4573, incremental
# state transfer ports 4671-4673, full state transfer (rsync) ports 4771-4773,
# all on 127.0.0.1. Node 1 bootstraps the cluster (--wsrep-new-cluster) when
# no node is running; every other start joins the running nodes. State lives
# in $ONCELY_GALERA_DIR (default /tmp/oncely-galera); every command holds an
# flock on it, so parallel test binaries can call `up`. Needs the galera-4 and
# rsync packages (installed with apt-get when missing and running as root).
set -euo pipefail

MARIADBD=${MARIADBD:-/usr/sbin/mariadbd}
PROVIDER=${ONCELY_GALERA_PROVIDER:-/usr/lib/galera/libgalera_smm.so}
DIR=${ONCELY_GALERA_DIR:-/tmp/oncely-galera}
LOCK=${DIR}.lock
PEERS=gcomm://127.0.0.1:4571,127.0.0.1:4572,127.0.0.1:4573
WAIT_SECS=${ONCELY_GALERA_WAIT:-120}

urls() { echo "mysql://root@127.0.0.1:3311/test,mysql://root@127.0.0.1:3312/test,mysql://root@127.0.0.1:3313/test"; }

# The server runs as an unprivileged user: mariadbd refuses root, and the
# joiner's rsync daemon (the state transfer) drops root to `nobody`, which
# could not write the data directory.
if [[ $(id -u) == 0 ]]; then RUN_AS=mysql; else RUN_AS=$(id -un); fi

need_packages() {
    local missing=()
    [[ -f $PROVIDER ]] || missing+=(galera-4)
    command -v rsync >/dev/null || missing+=(rsync)
    [[ -x $MARIADBD ]] || missing+=(mariadb-server)
    ((${#missing[@]} == 0)) && return 0
    install_packages "${missing[@]}"
}

install_packages() {
    if [[ $(id -u) != 0 ]]; then
        echo "missing packages: $* (apt-get install them as root)" >&2
        return 1
    fi
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >&2
}

pid_of() { # prints the pid of node $1 if it is running
    local f="$DIR/n$1.pid"
    [[ -f $f ]] || return 1
    local pid
    pid=$(cat "$f" 2>/dev/null) || return 1
    [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null && grep -q mariadbd "/proc/$pid/cmdline" 2>/dev/null || return 1
    echo "$pid"
}

sql() { # node statement: runs it over the node's socket, prints tab-separated rows
    mariadb --no-defaults -uroot --socket="$DIR/n$1.sock" --connect-timeout=2 -N -B -e "$2" 2>/dev/null
}

config() { # node: writes its option file
    local n=$1
    cat >"$DIR/n$n.cnf" <<EOF
[mariadbd]
user = $RUN_AS
datadir = $DIR/n$n/data
tmpdir = $DIR/n$n/tmp
socket = $DIR/n$n.sock
pid-file = $DIR/n$n.pid
log-error = $DIR/n$n.log
port = 331$n
bind-address = 127.0.0.1
skip-name-resolve
character-set-server = utf8mb4
collation-server = utf8mb4_general_ci
innodb_buffer_pool_size = 64M
innodb_log_file_size = 32M
max_connections = 400
binlog_format = ROW
default_storage_engine = InnoDB
innodb_autoinc_lock_mode = 2
wsrep_on = ON
wsrep_provider = $PROVIDER
wsrep_cluster_name = oncely-test
wsrep_cluster_address = $PEERS
wsrep_node_name = n$n
wsrep_node_address = 127.0.0.1:457$n
wsrep_node_incoming_address = 127.0.0.1:331$n
wsrep_provider_options = "base_host=127.0.0.1; base_port=457$n; gmcast.listen_addr=tcp://127.0.0.1:457$n; ist.recv_addr=127.0.0.1:467$n; gcache.size=64M; evs.suspect_timeout=PT3S; evs.inactive_timeout=PT8S; repl.causal_read_timeout=PT5S"
wsrep_sst_method = rsync
wsrep_sst_receive_address = 127.0.0.1:477$n
EOF
}

init_node() { # node: a fresh data directory
    local n=$1
    mkdir -p "$DIR/n$n/data" "$DIR/n$n/tmp"
    config "$n"
    mariadb-install-db --no-defaults --user="$RUN_AS" --datadir="$DIR/n$n/data" \
        --auth-root-authentication-method=normal --skip-test-db >"$DIR/n$n.install.log" 2>&1 || {
        echo "mariadb-install-db failed for n$n; see $DIR/n$n.install.log" >&2
        return 1
    }
    chown -R "$RUN_AS" "$DIR/n$n"
}

# Starts node $1 (bootstrapping a new cluster when $2 is "new") and waits
# until its server answers (a joiner answers once its state transfer is done).
start_node() {
    local n=$1 mode=${2:-join}
    if pid_of "$n" >/dev/null; then return 0; fi
    [[ -d $DIR/n$n/data ]] || init_node "$n"
    config "$n"
    local extra=() wrap=()
    if [[ -n ${ONCELY_GALERA_FAKETIME:-} ]]; then
        command -v faketime >/dev/null || install_packages faketime
        wrap=(faketime -f "$ONCELY_GALERA_FAKETIME")
    fi
    if [[ $mode == new ]]; then
        extra+=(--wsrep-new-cluster)
        # A crashed cluster's last node may not be marked safe to bootstrap.
        [[ -f $DIR/n$n/data/grastate.dat ]] &&
            sed -i 's/^safe_to_bootstrap: 0/safe_to_bootstrap: 1/' "$DIR/n$n/data/grastate.dat"
    fi
    rm -f "$DIR/n$n.pid"
    # setsid + nohup: the node outlives the test process that started it.
    setsid nohup "${wrap[@]}" "$MARIADBD" --defaults-file="$DIR/n$n.cnf" "${extra[@]}" \
        </dev/null >>"$DIR/n$n.log" 2>&1 9>&- &
    local deadline=$((SECONDS + WAIT_SECS))
    while ((SECONDS < deadline)); do
        if [[ $(sql "$n" "SELECT 1") == 1 ]]; then return 0; fi
        sleep 0.2
    done
    echo "node n$n did not start in ${WAIT_SECS}s; see $DIR/n$n.log" >&2
    return 1
}

kill_node() {
    local n=$1 pid
    pid=$(pid_of "$n") || { rm -f "$DIR/n$n.pid"; return 0; }
    # SIGKILL: a node loss is a crash, not a graceful shutdown. Its state
    # transfer helpers (if it was joining) go with its process group.
    kill -9 -- "-$pid" 2>/dev/null || kill -9 "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do
        kill -0 "$pid" 2>/dev/null || { rm -f "$DIR/n$n.pid"; return 0; }
        sleep 0.1
    done
    echo "node n$n (pid $pid) did not exit" >&2
    return 1
}

signal_node() { # node signal
    local n=$1 pid
    pid=$(pid_of "$n") || { echo "node n$n is not running" >&2; return 1; }
    kill "-$2" "$pid"
}

stop_node() {
    local n=$1 pid
    pid=$(pid_of "$n") || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 600); do
        kill -0 "$pid" 2>/dev/null || { rm -f "$DIR/n$n.pid"; return 0; }
        sleep 0.1
    done
    echo "node n$n (pid $pid) did not shut down in 60s" >&2
    return 1
}

# Prints the running nodes' wsrep_cluster_status, one "n status" a line
# ("n ?" for a node that does not answer).
cluster_status() {
    local n
    for n in 1 2 3; do
        pid_of "$n" >/dev/null || continue
        echo "$n $(sql "$n" "SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS WHERE VARIABLE_NAME = 'wsrep_cluster_status'" || echo '?')"
    done
}

# Quorum lost: every running node answers, none is Primary, for 10 s in a
# row. Bootstraps the node with the highest wsrep_last_committed (Galera's
# own recovery: the others rejoin its new primary component) and prints
# "re-bootstrapped nN". Returns 1 when there was nothing to recover.
recover_quorum() {
    local since=$SECONDS line n st nonprim
    while ((SECONDS - since < 10)); do
        nonprim=0
        while read -r n st; do
            [[ $st == Primary || $st == '?' ]] && return 1
            nonprim=$((nonprim + 1))
        done < <(cluster_status)
        ((nonprim == 0)) && return 1
        sleep 0.5
    done
    local best='' best_seq=-2 seq
    while read -r n st; do
        seq=$(sql "$n" "SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS WHERE VARIABLE_NAME = 'wsrep_last_committed'") || continue
        if ((seq > best_seq)); then best=$n best_seq=$seq; fi
    done < <(cluster_status)
    [[ -n $best ]] || return 1
    echo "galera-cluster.sh: quorum lost ($(cluster_status | tr '\n' ' ')); bootstrapping n$best at seqno $best_seq" >&2
    sql "$best" "SET GLOBAL wsrep_provider_options = 'pc.bootstrap=YES'" || return 1
    echo "re-bootstrapped n$best"
}

# Prints every node's status and the end of its log, for a failed wait.
dump_logs() {
    local n
    cluster_status >&2
    for n in 1 2 3; do
        [[ -f $DIR/n$n.log ]] || continue
        echo "--- n$n.log (last 40 lines)" >&2
        tail -n 40 "$DIR/n$n.log" >&2
    done
}

# Waits until every running node is synced, ready and sees all of them.
# Recovers a lost quorum on the way (recover_quorum).
wait_ready() {
    local deadline=$((SECONDS + WAIT_SECS)) running n ok last_check=$SECONDS
    while ((SECONDS < deadline)); do
        running=0 ok=0
        for n in 1 2 3; do
            pid_of "$n" >/dev/null || continue
            running=$((running + 1))
            local s
            s=$(sql "$n" "SELECT GROUP_CONCAT(VARIABLE_VALUE ORDER BY VARIABLE_NAME) FROM information_schema.GLOBAL_STATUS
                WHERE VARIABLE_NAME IN ('wsrep_ready', 'wsrep_cluster_size', 'wsrep_local_state_comment', 'wsrep_cluster_status')") || continue
            # cluster_size, cluster_status, local_state_comment, ready
            [[ $s == "$expected,Primary,Synced,ON" ]] && ok=$((ok + 1))
        done
        ((running == expected && ok == expected)) && return 0
        if ((SECONDS - last_check >= 15)); then
            recover_quorum >&2 || true
            last_check=$SECONDS
        fi
        sleep 0.3
    done
    echo "the Galera cluster is not ready with $expected nodes after ${WAIT_SECS}s; logs in $DIR" >&2
    dump_logs
    return 1
}

cmd=${1:-}
node=${2:-}
case $cmd in
    up | down | kill | stop | start | freeze | thaw | status | recover) ;;
    urls) urls; exit 0 ;;
    *) echo "usage: $0 up|down|kill N|stop N|start N|freeze N|thaw N|recover|urls|status" >&2; exit 2 ;;
esac
if [[ $cmd =~ ^(kill|stop|start|freeze|thaw)$ ]] && [[ ! $node =~ ^[123]$ ]]; then
    echo "node must be 1, 2 or 3" >&2
    exit 2
fi

mkdir -p "$(dirname "$LOCK")"
exec 9>"$LOCK"
flock 9

running_nodes() { local n c=0; for n in 1 2 3; do pid_of "$n" >/dev/null && c=$((c + 1)); done; echo $c; }

case $cmd in
    up)
        need_packages
        expected=3
        if (($(running_nodes) == 0)); then
            # Nothing runs: a cluster from scratch (a crashed one's data is
            # not worth recovering for tests).
            rm -rf "$DIR"
            mkdir -p "$DIR"
            chown "$RUN_AS" "$DIR"
            start_node 1 new
            sql 1 "CREATE DATABASE IF NOT EXISTS test" || {
                echo "could not create database test on n1" >&2
                exit 1
            }
        fi
        for n in 1 2 3; do start_node "$n"; done
        wait_ready
        urls
        ;;
    down)
        for n in 1 2 3; do kill_node "$n"; done
        rm -rf "$DIR"
        ;;
    kill) kill_node "$node" ;;
    stop) stop_node "$node" ;;
    freeze) signal_node "$node" STOP ;;
    thaw)
        signal_node "$node" CONT
        expected=$(running_nodes)
        wait_ready
        ;;
    start)
        if (($(running_nodes) == 0)); then
            start_node "$node" new
        else
            # A joiner cannot join survivors that lost their quorum.
            recover_quorum >&2 || true
            start_node "$node"
        fi
        expected=$(running_nodes)
        wait_ready
        ;;
    recover)
        if recover_quorum; then
            expected=$(running_nodes)
            wait_ready
        fi
        ;;
    status)
        for n in 1 2 3; do echo "n$n $(pid_of "$n" || echo down)"; done
        ;;
esac
