#!/usr/bin/env bash
# Stop the emulated scale cluster that start.sh made: cancels its jobs, stops every slurmd
# and its slurmctld, removes its node names from /etc/hosts. The test cluster, munged and
# slurmdbd are left running. Prints the time taken. Safe when nothing runs.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=lib.sh
source "$HERE/lib.sh"

no_jobs_left() { [[ -z "$(squeue -h -o %i 2>/dev/null)" ]]; }

cancel_jobs() {
    pidfile_alive "$RUN_DIR/slurmctld.pid" slurmctld || return 0
    [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && return 0
    scancel --cluster="$CLUSTER_NAME" --user=root 2>/dev/null || scancel -u root 2>/dev/null || true
    wait_until 60 no_jobs_left || log "jobs still listed after 60 s; stopping anyway"
}

# SIGTERM to every slurmd at once, then SIGKILL to those left after 15 s.
stop_slurmds() {
    local pidfile pids=() pid
    for pidfile in "$RUN_DIR"/slurmd-*.pid; do
        [[ -e $pidfile ]] || continue
        pidfile_alive "$pidfile" slurmd && pids+=("$(pid_from_file "$pidfile")")
        rm -f "$pidfile"
    done
    ((${#pids[@]})) || return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    local deadline=$((SECONDS + 15))
    for pid in "${pids[@]}"; do
        while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
    done
    kill -KILL "${pids[@]}" 2>/dev/null || true
    log "stopped ${#pids[@]} slurmd"
}

remove_host_aliases() {
    grep -qF "$HOSTS_MARK" /etc/hosts || return 0
    local hosts
    hosts=$(grep -vF "$HOSTS_MARK" /etc/hosts || true)
    printf '%s\n' "$hosts" >/etc/hosts  # in place: /etc/hosts may be a mount
}

main() {
    require_root
    take_lock
    local t0
    t0=$(date +%s.%N)
    cancel_jobs
    stop_slurmds
    stop_pidfile "$RUN_DIR/slurmctld.pid" slurmctld 30
    remove_host_aliases
    rm -f "$INSTANCE_FILE"
    printf 'stop_s total=%.1f\n' "$(echo "$(date +%s.%N) - $t0" | bc)"
}

main "$@"
