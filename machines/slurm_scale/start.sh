#!/usr/bin/env bash
# Start the emulated scale cluster: N slurmd "nodes" of a site's shape on this host, as a
# second Slurm instance (its own slurmctld, SLURM_CONF=/etc/slurm-scale/slurm.conf, cluster
# axonnscale) beside machines/slurm_local's test cluster, which it leaves untouched.
#   start.sh N [--site SITE]   N nodes (1 to 16000), named, partitioned and shaped as SITE's
#                              (conf/machine/SITE.yaml; default frontier: frontier00001...,
#                              partition batch, 8 GPUs and 56 CPUs per node)
# Needs the test cluster's munged and slurmdbd running (machines/slurm_local/start.sh).
# Restarts the instance when N or SITE changed; idempotent otherwise. Prints the time taken.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=lib.sh
source "$HERE/lib.sh"

usage() {
    echo "start.sh: $1; usage: start.sh N [--site SITE] (N: 1 to $MAX_NODES; SITE: a" \
        "conf/machine profile, default frontier)" >&2
    exit 2
}

parse_args() {
    COUNT=${1:-}
    [[ $COUNT =~ ^[0-9]+$ ]] && ((COUNT >= 1 && COUNT <= MAX_NODES)) ||
        usage "node count '${COUNT}': valid: 1 to $MAX_NODES"
    shift
    SITE_ARG=frontier
    while (($#)); do
        case $1 in
        --site) SITE_ARG=${2:-} && shift 2 ;;
        --site=*) SITE_ARG=${1#--site=} && shift ;;
        *) usage "unknown argument '$1'" ;;
        esac
    done
    [[ -f $REPO_DIR/axonn_launch/conf/machine/$SITE_ARG.yaml ]] ||
        usage "--site '$SITE_ARG': no conf/machine/$SITE_ARG.yaml"
}

node_lines() {
    local host
    host=$(hostname -s)
    # one line per node: each has its own port (multiple-slurmd mode)
    local node
    for node in "${NODES[@]}"; do
        echo "NodeName=$node NodeHostname=$host NodeAddr=127.0.0.1 Port=$(node_port "$node")" \
            "CPUs=$CPUS_PER_NODE Sockets=1 CoresPerSocket=$CPUS_PER_NODE ThreadsPerCore=1" \
            "RealMemory=$REAL_MEMORY_MB Gres=gpu:$GPUS_PER_NODE State=UNKNOWN"
    done
}

slurm_conf_text() {
    cat <<CONF
$MANAGED_MARK
ClusterName=$CLUSTER_NAME
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$STATE_DIR/slurmctld
SlurmdSpoolDir=$STATE_DIR/slurmd-%n
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
SlurmdDebug=error
TmpFS=$STATE_DIR/tmp-%n
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,bf_interval=5
# Hundreds of daemons share 2 cores: a launch's messages wait for CPU, not the network.
# A step credential lives long enough for a large launch on a loaded host; nodes are
# declared lost after 5 minutes of silence, not 10 s (the test cluster's).
AuthInfo=cred_expire=120
MessageTimeout=60
TCPTimeout=10
SlurmdTimeout=300
SlurmctldTimeout=120
GresTypes=gpu
ReturnToService=2
InactiveLimit=0
KillWait=5
MinJobAge=3600
JobRequeue=1
MailProg=/bin/true
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
AccountingStorageTRES=gres/gpu
# No per-task /proc polling by every slurmstepd: at N x 8 tasks it is CPU this host lacks.
JobAcctGatherType=jobacct_gather/none
$(node_lines)
PartitionName=$PARTITION Nodes=$(node_range) Default=YES MaxTime=INFINITE State=UP
CONF
}

gres_conf_text() {
    echo "$MANAGED_MARK"
    echo "AutoDetect=off"
    echo "NodeName=$(node_range) Name=gpu File=$STATE_DIR/fake-gpu/gpu[0-$((GPUS_PER_NODE - 1))]"
}

make_dirs() {
    mkdir -p "$SLURM_CONF_DIR" "$STATE_DIR/slurmctld" "$RUN_DIR" "$LOG_DIR" "$STATE_DIR/fake-gpu"
    local node i
    for node in "${NODES[@]}"; do
        mkdir -p "$STATE_DIR/slurmd-$node" "$STATE_DIR/tmp-$node"
        chmod 1777 "$STATE_DIR/tmp-$node"
    done
    chmod 755 "$STATE_DIR"
    for ((i = 0; i < GPUS_PER_NODE; i++)); do
        [[ -c $STATE_DIR/fake-gpu/gpu$i ]] || mknod -m 666 "$STATE_DIR/fake-gpu/gpu$i" c 1 3
    done
}

write_managed() {
    local path=$1 text=$2
    if [[ -f $path ]] && ! grep -qxF "$MANAGED_MARK" "$path"; then
        fail "$path exists and was not written by this script; move it away first"
    fi
    printf '%s\n' "$text" >"$path.new" && mv "$path.new" "$path"
}

# Node names resolve to this host (a job's first node is its rendezvous address): one
# marked line per node, removed by stop.sh.
add_host_aliases() {
    local hosts
    hosts=$(grep -vF "$HOSTS_MARK" /etc/hosts || true)
    printf '%s\n' "$hosts" >/etc/hosts.axonn-scale
    printf "127.0.0.1 %s $HOSTS_MARK\n" "${NODES[@]}" >>/etc/hosts.axonn-scale
    cat /etc/hosts.axonn-scale >/etc/hosts  # in place: /etc/hosts may be a mount
    rm -f /etc/hosts.axonn-scale
}

# The test cluster's slurmdbd keeps this cluster's accounting under its own name.
register_cluster() {
    pidfile_alive "$LOCAL_RUN_DIR/slurmdbd.pid" slurmdbd ||
        fail "slurmdbd of machines/slurm_local is not running; start it: bash machines/slurm_local/start.sh"
    munge -n </dev/null | unmunge >/dev/null 2>&1 || fail "munged does not answer"
    if [[ -z "$(sacctmgr -n -P list cluster "$CLUSTER_NAME" format=cluster 2>/dev/null)" ]]; then
        sacctmgr -i add cluster "$CLUSTER_NAME" >/dev/null || fail "sacctmgr add cluster failed"
    fi
    if [[ -z "$(sacctmgr -n -P list assoc cluster="$CLUSTER_NAME" account="$ACCOUNT" user=root format=user 2>/dev/null)" ]]; then
        sacctmgr -i add account "$ACCOUNT" cluster="$CLUSTER_NAME" >/dev/null 2>&1 || true
        sacctmgr -i add user root account="$ACCOUNT" cluster="$CLUSTER_NAME" >/dev/null ||
            fail "sacctmgr add user root to $CLUSTER_NAME failed"
    fi
}

start_slurmctld() {
    pidfile_alive "$RUN_DIR/slurmctld.pid" slurmctld && return 0
    slurmctld 9>&- || fail "slurmctld did not start" "$LOG_DIR/slurmctld.log"
    wait_until 60 scontrol ping || fail "slurmctld does not answer" "$LOG_DIR/slurmctld.log"
}

available_mb() { awk '/^MemAvailable:/{print int($2 / 1024)}' /proc/meminfo; }

# Every slurmd, 16 at a time (each daemonizes; its parent returns at once). Stops, and
# fails naming the cause, when the host's available memory falls under MIN_AVAILABLE_MB.
start_slurmds() {
    local node started=0 free
    for node in "${NODES[@]}"; do
        pidfile_alive "$(slurmd_pidfile "$node")" slurmd && continue
        spawn_slurmd "$node" &
        ((++started % 16)) && continue
        wait
        free=$(available_mb)
        ((free >= MIN_AVAILABLE_MB)) && continue
        fail "memory: $free MB available after $started slurmd of $NODE_COUNT (floor $MIN_AVAILABLE_MB MB, SCALE_MIN_AVAILABLE_MB); stop it with: bash $HERE/stop.sh"
    done
    wait
}

wait_idle() {
    local limit=$((120 + NODE_COUNT / 2))
    if ! wait_until "$limit" nodes_idle; then
        sinfo -p "$PARTITION" >&2 || true
        fail "not every node of $(node_range) idle after $limit s" "$LOG_DIR/slurmctld.log"
    fi
}

main() {
    parse_args "$@"
    require_root
    take_lock
    local t0 previous=""
    t0=$(date +%s.%N)
    [[ -s $INSTANCE_FILE ]] && previous=$(cat "$INSTANCE_FILE")
    if [[ -n $previous && $previous != "$COUNT $SITE_ARG" ]]; then
        log "instance was '$previous'; stopping it first"
        exec 9>&-
        bash "$HERE/stop.sh"
        take_lock
    fi
    set_instance "$COUNT" "$SITE_ARG"
    make_dirs
    write_managed "$SLURM_CONF_DIR/slurm.conf" "$(slurm_conf_text)"
    write_managed "$SLURM_CONF_DIR/gres.conf" "$(gres_conf_text)"
    register_cluster
    echo "$COUNT $SITE_ARG" >"$INSTANCE_FILE"
    add_host_aliases
    start_slurmctld
    local t1
    t1=$(date +%s.%N)
    start_slurmds
    local t2
    t2=$(date +%s.%N)
    wait_until 30 bash -c "! sinfo -h -p $PARTITION -o %t | grep -q unk" || true
    scontrol update nodename="$(node_range)" state=resume >/dev/null 2>&1 || true
    wait_idle
    local t3
    t3=$(date +%s.%N)
    log "cluster $CLUSTER_NAME up: $COUNT nodes $(node_range), partition $PARTITION," \
        "$GPUS_PER_NODE GPUs and $CPUS_PER_NODE CPUs per node"
    printf 'start_s total=%.1f slurmctld=%.1f slurmd_spawn=%.1f registered_idle=%.1f\n' \
        "$(echo "$t3 - $t0" | bc)" "$(echo "$t1 - $t0" | bc)" "$(echo "$t2 - $t1" | bc)" \
        "$(echo "$t3 - $t2" | bc)"
    echo "use it with: export SLURM_CONF=$SLURM_CONF"
}

main "$@"
