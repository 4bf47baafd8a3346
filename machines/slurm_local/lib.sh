# Shared names and helpers for the local Slurm cluster scripts (sourced, not run).
# shellcheck shell=bash disable=SC2034

SLURM_CONF_DIR=/etc/slurm
STATE_DIR=/var/lib/axonn-slurm
RUN_DIR=/run/axonn-slurm
LOG_DIR=/var/log/slurm
CLUSTER_NAME=axonn
PARTITION=debug
# Every job of the test suite but the few that need more nodes runs on the two nodes of
# PARTITION; WIDE_PARTITION holds all of them (start.sh [COUNT], default 4: restarts on a
# spare node and packed sweeps are tested there).
WIDE_PARTITION=wide
BASE_NODES=2
ACCOUNT=axonn
DEFAULT_NODE_COUNT=4
NODE_COUNT_FILE=/var/lib/axonn-slurm/node_count
# The nodes: as many as the last start.sh was given (the file it keeps), else the default.
node_count() {
    local count=${AXONN_SLURM_NODES:-}
    [[ -z $count && -s $NODE_COUNT_FILE ]] && count=$(tr -dc '0-9' <"$NODE_COUNT_FILE")
    echo "${count:-$DEFAULT_NODE_COUNT}"
}
NODES=()
for ((axonn_n = 1; axonn_n <= $(node_count); axonn_n++)); do NODES+=("n$axonn_n"); done
unset axonn_n
CPUS_PER_NODE=8
REAL_MEMORY_MB=8192
GPUS_PER_NODE=8
CTLD_PORT=6817
DBD_PORT=6819
DB_NAME=slurm_acct_db
DB_USER=slurm
MANAGED_MARK="# managed by axonn_launch machines/slurm_local/start.sh"
# Node-local storage, as a site node has its own /tmp or NVMe: every slurmd runs in a mount
# namespace of its own where NODE_LOCAL_DIR is that node's directory $STATE_DIR/local-<node>,
# and its job steps inherit it. sbcast (machine.python_broadcast) writes there.
NODE_LOCAL_DIR=/mnt/node-local

log() { printf '[slurm_local %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

fail() {
    printf '[slurm_local] ERROR: %s\n' "$1" >&2
    if [[ -n "${2:-}" && -f "$2" ]]; then
        printf '[slurm_local] last lines of %s:\n' "$2" >&2
        tail -n 30 "$2" >&2
    fi
    exit 1
}

require_root() {
    [[ $(id -u) -eq 0 ]] || fail "run as root (it installs packages and starts system daemons)"
}

node_port() {
    # n1 -> 6831, n2 -> 6832: distinct slurmd ports, clear of slurmdbd's 6819.
    echo $((6830 + ${1#n}))
}

pid_from_file() {
    [[ -s "$1" ]] && tr -dc '0-9' <"$1"
}

# True if the pid file names a live process whose command name starts with $2.
pidfile_alive() {
    local pid comm
    pid=$(pid_from_file "$1") || return 1
    [[ -n "$pid" && -d /proc/$pid ]] || return 1
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
    [[ "$comm" == "$2"* ]]
}

# Poll a command until it succeeds or the timeout (s) passes.
wait_until() {
    local timeout=$1
    shift
    local deadline=$((SECONDS + timeout))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || return 1
        sleep 0.5
    done
}

# SIGTERM the process in a pid file, SIGKILL it after $3 s; no-op if not running.
stop_pidfile() {
    local pidfile=$1 comm=$2 timeout=${3:-15} pid
    if ! pidfile_alive "$pidfile" "$comm"; then
        rm -f "$pidfile"
        return 0
    fi
    pid=$(pid_from_file "$pidfile")
    log "stopping $comm (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    if ! wait_until "$timeout" bash -c "! kill -0 $pid"; then
        log "$comm (pid $pid) ignored SIGTERM for ${timeout} s; sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        wait_until 5 bash -c "! kill -0 $pid" || true
    fi
    rm -f "$pidfile"
}

slurmd_pidfile() { echo "$RUN_DIR/slurmd-$1.pid"; }
slurmd_log() { echo "$LOG_DIR/slurmd-$1.log"; }

# Serialises start/stop/node actions (several test sessions may call start.sh at once).
# Daemons are started with fd 9 closed, or they would hold the lock for good.
take_lock() {
    mkdir -p "$RUN_DIR"
    exec 9>"$RUN_DIR/lock"
    flock -w 300 9 || fail "another slurm_local script held $RUN_DIR/lock for 300 s"
}

# Spawns the slurmd of node $1 with its own node-local storage at NODE_LOCAL_DIR.
spawn_slurmd() {
    local node=$1 dir="$STATE_DIR/local-$1"
    mkdir -p "$dir" "$NODE_LOCAL_DIR"
    chmod 1777 "$dir"
    if unshare --mount --propagation private true 2>/dev/null; then
        # shellcheck disable=SC2016
        unshare --mount --propagation private sh -c \
            'mount --bind "$1" "$2" && exec slurmd -N "$3"' _ "$dir" "$NODE_LOCAL_DIR" "$node" 9>&-
    else
        log "no mount namespaces here: $NODE_LOCAL_DIR is one directory for all nodes"
        slurmd -N "$node" 9>&-
    fi
}
