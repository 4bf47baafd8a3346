#!/usr/bin/env bash
# Stop the local Slurm cluster started by start.sh: cancels its jobs, then stops slurmd n1/n2,
# slurmctld, slurmdbd, and MariaDB/munge if start.sh started them. Safe when nothing runs.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# stop.sh --scale: stops the emulated scale cluster only (machines/slurm_scale/stop.sh)
[[ ${1:-} == --scale ]] && exec bash "$HERE/../slurm_scale/stop.sh"
# shellcheck source=lib.sh
source "$HERE/lib.sh"

no_jobs_left() { [[ -z "$(squeue -h -o %i 2>/dev/null)" ]]; }

# Cancelling first lets slurmd end the job steps, so no task outlives the cluster.
cancel_jobs() {
    pidfile_alive "$RUN_DIR/slurmctld.pid" slurmctld || return 0
    local jobs
    jobs=$(squeue -h -o %i 2>/dev/null || true)
    [[ -z "$jobs" ]] && return 0
    log "cancelling jobs: $(echo "$jobs" | tr '\n' ' ')"
    # shellcheck disable=SC2086
    scancel $jobs 2>/dev/null || true
    wait_until 20 no_jobs_left || log "some jobs still listed after 20 s; stopping anyway"
}

stop_started_service() {
    local name=$1 pidfile=$2 comm=$3
    [[ -e "$RUN_DIR/started-$name" ]] || return 0
    stop_pidfile "$pidfile" "$comm" 30
    rm -f "$RUN_DIR/started-$name"
}

main() {
    require_root
    take_lock
    cancel_jobs
    local node
    for node in "${NODES[@]}"; do stop_pidfile "$(slurmd_pidfile "$node")" slurmd; done
    stop_pidfile "$RUN_DIR/slurmctld.pid" slurmctld
    stop_pidfile "$RUN_DIR/slurmdbd.pid" slurmdbd
    stop_started_service mariadb /run/mysqld/mysqld.pid mariadbd
    stop_started_service munge /run/munge/munged.pid munged
    log "stopped"
}

main "$@"
