#!/usr/bin/env bash
# Fault injection on one node of the local Slurm cluster.
#   node.sh stop NODE         the node "crashes": its slurmd and every process of its job steps
#                             are SIGKILLed; slurmctld marks it DOWN after SlurmdTimeout (~10 s)
#   node.sh stop-daemon NODE  only its slurmd dies; running tasks go on, unsupervised
#   node.sh start NODE        slurmd starts again; the node returns to service (ReturnToService=2)
#   node.sh restart NODE      a wedged node heals: its slurmd is killed and started again (job
#                             steps are left alone), a node left DOWN/DRAIN is resumed
#   node.sh status NODE       prints the node's sinfo state
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=lib.sh
source "$HERE/lib.sh"

usage() {
    echo "usage: $0 stop|stop-daemon|start|restart|status NODE   (NODE one of: ${NODES[*]})" >&2
    exit 2
}

# slurmstepd of a node listen on sockets in that node's spool directory.
stepd_pids() {
    ss -xlpH 2>/dev/null | grep -F "$STATE_DIR/slurmd-$1/" |
        grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u
}

descendants() {
    local child
    for child in $(pgrep -P "$1" || true); do
        descendants "$child"
        echo "$child"
    done
}

kill_steps() {
    local stepd pids=()
    for stepd in $(stepd_pids "$1"); do
        mapfile -t -O "${#pids[@]}" pids < <(descendants "$stepd")
        pids+=("$stepd")
    done
    ((${#pids[@]} == 0)) && return 0
    log "killing job step processes of $1: ${pids[*]}"
    kill -KILL "${pids[@]}" 2>/dev/null || true
}

kill_slurmd() {
    local pidfile pid
    pidfile=$(slurmd_pidfile "$1")
    if ! pidfile_alive "$pidfile" slurmd; then
        log "slurmd $1 is not running"
        return 0
    fi
    pid=$(pid_from_file "$pidfile")
    log "killing slurmd $1 (pid $pid)"
    kill -KILL "$pid"
    wait_until 5 bash -c "! kill -0 $pid" || fail "slurmd $1 (pid $pid) did not die"
    rm -f "$pidfile"
}

node_up() {
    [[ "$(sinfo -h -n "$1" -o %t 2>/dev/null)" =~ ^(idle|mix|alloc)$ ]]
}

start_node() {
    if ! pidfile_alive "$(slurmd_pidfile "$1")" slurmd; then
        log "starting slurmd $1"
        spawn_slurmd "$1" || fail "slurmd $1 did not start" "$(slurmd_log "$1")"
    fi
    wait_until 30 node_up "$1" || fail "node $1 not back in service after 30 s" "$(slurmd_log "$1")"
    log "node $1 is $(sinfo -h -n "$1" -o %t)"
}

# Heals a node whose slurmd stopped launching steps (_send_slurmstepd_init failed) or left a
# job COMPLETING: a fresh slurmd re-registers and finishes the cleanup.
restart_node() {
    kill_slurmd "$1"
    log "starting slurmd $1"
    spawn_slurmd "$1" || fail "slurmd $1 did not start" "$(slurmd_log "$1")"
    if ! wait_until 15 node_up "$1"; then
        log "resuming $1 (was $(sinfo -h -n "$1" -o %t))"
        scontrol update nodename="$1" state=resume || true
    fi
    wait_until 30 node_up "$1" || fail "node $1 not back in service after 45 s" "$(slurmd_log "$1")"
    log "node $1 is $(sinfo -h -n "$1" -o %t)"
}

main() {
    (($# == 2)) || usage
    local action=$1 node=$2
    [[ " ${NODES[*]} " == *" $node "* ]] || usage
    require_root
    take_lock
    case $action in
    stop)
        kill_slurmd "$node"
        kill_steps "$node"
        ;;
    stop-daemon) kill_slurmd "$node" ;;
    start) start_node "$node" ;;
    restart) restart_node "$node" ;;
    status) sinfo -h -n "$node" -o '%N %t %E' ;;
    *) usage ;;
    esac
}

main "$@"
