#!/usr/bin/env bash
# Start a Slurm cluster with accounting on this host: munge, MariaDB, slurmdbd, slurmctld and
# COUNT slurmd "nodes" (n1..nCOUNT; default 4) in multiple-slurmd mode. Idempotent.
#   start.sh [COUNT]   partition debug (the default) holds n1 and n2; partition wide holds all
#                      COUNT nodes (a restart on a spare node needs more than two)
# Daemons are started directly (no systemd). See README.md for what this changes.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# start.sh --scale N [--site SITE]: the emulated scale cluster instead, a second instance
# beside this one (machines/slurm_scale/start.sh; this cluster is left as it is)
[[ ${1:-} == --scale ]] && exec bash "$HERE/../slurm_scale/start.sh" "${@:2}"
if [[ -n ${1:-} ]]; then
    [[ $1 =~ ^[0-9]+$ ]] && (($1 >= 2 && $1 <= 9)) ||
        { echo "start.sh: node count $1: valid: 2 to 9" >&2 && exit 2; }
    export AXONN_SLURM_NODES=$1
fi
# shellcheck source=lib.sh
source "$HERE/lib.sh"

# libpmix-dev: Slurm's pmix_v4 plugin (srun --mpi=pmix, as on Alps) dlopens libpmix.so from
# /usr/lib/x86_64-linux-gnu/pmix2/lib, and only the -dev package has that name (libpmix2 has
# libpmix.so.2); without it slurmd logs "can not load PMIx library" and pmix steps hang.
PACKAGES=(slurm-wlm slurmdbd munge mariadb-server mariadb-client libpmix-dev)
SLURM_CONF_CHANGED=0
DBD_CONF_CHANGED=0

phase_start=$SECONDS
phase_done() {
    log "$1 done ($((SECONDS - phase_start)) s)"
    phase_start=$SECONDS
}

missing_packages() {
    local pkg
    for pkg in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' ||
            echo "$pkg"
    done
}

# Debian's maintainer scripts would try to start the daemons through invoke-rc.d;
# a temporary policy-rc.d (exit 101) forbids that, since this script starts them itself.
install_packages() {
    local missing
    mapfile -t missing < <(missing_packages)
    ((${#missing[@]} == 0)) && return 0
    log "installing: ${missing[*]}"
    local policy=/usr/sbin/policy-rc.d made_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod 755 "$policy"
        made_policy=1
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q || fail "apt-get update failed"
    apt-get install -y -q --no-install-recommends "${missing[@]}" ||
        fail "apt-get install ${missing[*]} failed"
    if ((made_policy)); then
        rm -f "$policy"
        trap - EXIT
    fi
}

# Makes n1 and n2 resolve to this host (jobs use node names as rendezvous addresses).
add_host_aliases() {
    local node
    for node in "${NODES[@]}"; do
        if ! getent hosts "$node" >/dev/null; then
            echo "127.0.0.1 $node $MANAGED_MARK" >>/etc/hosts
            log "added $node to /etc/hosts"
        fi
    done
}

make_dirs() {
    mkdir -p "$SLURM_CONF_DIR" "$STATE_DIR/slurmctld" "$RUN_DIR" "$LOG_DIR"
    local node
    for node in "${NODES[@]}"; do
        mkdir -p "$STATE_DIR/slurmd-$node" "$STATE_DIR/tmp-$node"
        chmod 1777 "$STATE_DIR/tmp-$node"
    done
    chmod 755 "$STATE_DIR"
    make_fake_gpus
}

# The database password is made once and kept, so reruns keep working.
db_password() {
    local file="$STATE_DIR/db_password"
    if [[ ! -s $file ]]; then
        (umask 077 && head -c 18 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' >"$file")
    fi
    cat "$file"
}

node_lines() {
    local host node
    host=$(hostname -s)
    for node in "${NODES[@]}"; do
        echo "NodeName=$node NodeHostname=$host NodeAddr=127.0.0.1 Port=$(node_port "$node")" \
            "CPUs=$CPUS_PER_NODE Sockets=1 CoresPerSocket=$CPUS_PER_NODE ThreadsPerCore=1" \
            "RealMemory=$REAL_MEMORY_MB Gres=gpu:$GPUS_PER_NODE State=UNKNOWN"
    done
}

slurm_conf_text() {
    cat <<EOF
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
# Per-node scratch: srun --mpi=pmix makes its client directory here, and n1/n2 share a host.
TmpFS=$STATE_DIR/tmp-%n
# More CPUs/GPUs are declared than the host has, so multi-task jobs fit on a small machine.
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Latencies for a test cluster (slurm.conf(5) of Slurm 22.05): a batch job is scheduled
# when it is submitted, not up to batch_sched_delay (default 3 s) later; backfill, the only
# pass that starts a job the main pass skipped, runs every 5 s instead of 30 (min 1).
SchedulerParameters=batch_sched_delay=0,bf_interval=5
# A requeued job waits cred_expire before it starts again (default 120 s). The value is
# also a step credential's lifetime, which must cover a step's launch on loaded cores.
AuthInfo=cred_expire=30
GresTypes=gpu
ReturnToService=2
# A stopped slurmd is marked DOWN (and its jobs NODE_FAIL) within ~SlurmdTimeout.
SlurmdTimeout=10
SlurmctldTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=3600
JobRequeue=1
MailProg=/bin/true
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
AccountingStorageTRES=gres/gpu
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
$(node_lines)
PartitionName=$PARTITION Nodes=n[1-$BASE_NODES] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
PartitionName=$WIDE_PARTITION Nodes=n[1-${#NODES[@]}] Default=NO MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

# Slurm only counts GPUs backed by character devices; copies of /dev/null (1:3) stand in,
# so jobs asking for --gpus-per-node get scheduled. Nothing runs on them.
make_fake_gpus() {
    local dir="$STATE_DIR/fake-gpu" i
    mkdir -p "$dir"
    for ((i = 0; i < GPUS_PER_NODE; i++)); do
        [[ -c "$dir/gpu$i" ]] || { rm -f "$dir/gpu$i" && mknod -m 666 "$dir/gpu$i" c 1 3; }
    done
}

gres_conf_text() {
    echo "$MANAGED_MARK"
    echo "AutoDetect=off"
    echo "NodeName=n[1-${#NODES[@]}] Name=gpu File=$STATE_DIR/fake-gpu/gpu[0-$((GPUS_PER_NODE - 1))]"
}

slurmdbd_conf_text() {
    cat <<EOF
$MANAGED_MARK
AuthType=auth/munge
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$LOG_DIR/slurmdbd.log
PidFile=$RUN_DIR/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StoragePort=3306
StorageLoc=$DB_NAME
StorageUser=$DB_USER
StoragePass=$(db_password)
EOF
}

# Writes $2 to $1 with mode $3; returns 0 if the content changed. Refuses to overwrite
# a file this script did not write (another Slurm installation's config).
write_config() {
    local path=$1 text=$2 mode=$3
    if [[ -f $path ]] && ! grep -qxF "$MANAGED_MARK" "$path"; then
        fail "$path exists and was not written by this script; move it away first"
    fi
    if [[ -f $path ]] && [[ "$(cat "$path")" == "$text" ]]; then
        chmod "$mode" "$path"
        return 1
    fi
    (umask 077 && printf '%s\n' "$text" >"$path")
    chmod "$mode" "$path"
    log "wrote $path"
}

write_configs() {
    write_config "$SLURM_CONF_DIR/slurm.conf" "$(slurm_conf_text)" 644 && SLURM_CONF_CHANGED=1
    write_config "$SLURM_CONF_DIR/gres.conf" "$(gres_conf_text)" 644 && SLURM_CONF_CHANGED=1
    write_config "$SLURM_CONF_DIR/slurmdbd.conf" "$(slurmdbd_conf_text)" 600 && DBD_CONF_CHANGED=1
    return 0
}

munge_works() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    munge_works && return 0
    if [[ ! -s /etc/munge/munge.key ]]; then
        log "creating /etc/munge/munge.key"
        mungekey --create --keyfile=/etc/munge/munge.key
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged --force 9>&- ||
        fail "munged did not start" /var/log/munge/munged.log
    wait_until 10 munge_works || fail "munge does not answer" /var/log/munge/munged.log
    touch "$RUN_DIR/started-munge"
}

mariadb_works() { mariadb-admin --protocol=socket ping >/dev/null 2>&1; }

start_mariadb() {
    mariadb_works && return 0
    mkdir -p /run/mysqld
    chown mysql:mysql /run/mysqld
    if [[ ! -d /var/lib/mysql/mysql ]]; then
        log "initialising MariaDB data directory"
        mariadb-install-db --user=mysql --datadir=/var/lib/mysql >"$LOG_DIR/mariadb-install.log" 2>&1 ||
            fail "mariadb-install-db failed" "$LOG_DIR/mariadb-install.log"
    fi
    log "starting MariaDB"
    setsid mariadbd --user=mysql --pid-file=/run/mysqld/mysqld.pid --innodb-lock-wait-timeout=900 \
        </dev/null >>"$LOG_DIR/mariadb.log" 2>&1 9>&- &
    wait_until 60 mariadb_works || fail "MariaDB does not answer" "$LOG_DIR/mariadb.log"
    touch "$RUN_DIR/started-mariadb"
}

create_database() {
    local pw
    pw=$(db_password)
    mariadb --protocol=socket <<EOF || fail "could not create the accounting database"
CREATE DATABASE IF NOT EXISTS $DB_NAME;
CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$pw';
ALTER USER '$DB_USER'@'localhost' IDENTIFIED BY '$pw';
GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'localhost';
FLUSH PRIVILEGES;
EOF
}

slurmdbd_works() { sacctmgr -n -P list cluster format=cluster >/dev/null 2>&1; }

start_slurmdbd() {
    local pidfile="$RUN_DIR/slurmdbd.pid"
    if pidfile_alive "$pidfile" slurmdbd; then
        ((DBD_CONF_CHANGED == 0)) && return 0
        log "slurmdbd.conf changed; restarting slurmdbd"
        stop_pidfile "$pidfile" slurmdbd
    fi
    log "starting slurmdbd"
    slurmdbd 9>&- || fail "slurmdbd did not start" "$LOG_DIR/slurmdbd.log"
    wait_until 60 slurmdbd_works || fail "slurmdbd does not answer" "$LOG_DIR/slurmdbd.log"
}

# Idempotent sacctmgr add: only adds what `list` does not show yet.
sacctmgr_ensure() {
    local entity=$1 name=$2
    shift 2
    if [[ -z "$(sacctmgr -n -P list "$entity" "$name" format="$entity" 2>/dev/null)" ]]; then
        sacctmgr -i add "$entity" "$name" "$@" >/dev/null || fail "sacctmgr add $entity $name failed"
        log "registered $entity $name"
    fi
}

register_cluster() {
    sacctmgr_ensure cluster "$CLUSTER_NAME"
}

register_accounts() {
    sacctmgr_ensure account "$ACCOUNT" cluster="$CLUSTER_NAME" description="local test account" \
        organization=axonn
    local user
    for user in root ${SUDO_USER:-}; do
        sacctmgr_ensure user "$user" account="$ACCOUNT" cluster="$CLUSTER_NAME"
    done
}

restart_slurm_if_reconfigured() {
    ((SLURM_CONF_CHANGED == 1)) || return 0
    local node
    if pidfile_alive "$RUN_DIR/slurmctld.pid" slurmctld; then
        log "slurm.conf changed; restarting slurmctld and slurmd"
    fi
    local pidfile  # every slurmd, also those of nodes a smaller count leaves out
    for pidfile in "$RUN_DIR"/slurmd-*.pid; do
        [[ -e $pidfile ]] && stop_pidfile "$pidfile" slurmd
    done
    stop_pidfile "$RUN_DIR/slurmctld.pid" slurmctld
}

start_slurmctld() {
    pidfile_alive "$RUN_DIR/slurmctld.pid" slurmctld && return 0
    log "starting slurmctld"
    slurmctld 9>&- || fail "slurmctld did not start" "$LOG_DIR/slurmctld.log"
    wait_until 30 scontrol ping || fail "slurmctld does not answer" "$LOG_DIR/slurmctld.log"
}

start_slurmd() {
    local node=$1
    pidfile_alive "$(slurmd_pidfile "$node")" slurmd && return 0
    log "starting slurmd $node"
    spawn_slurmd "$node" || fail "slurmd $node did not start" "$(slurmd_log "$node")"
}

# Nodes drained or down from an earlier run (a config error, a stopped slurmd) are put back.
resume_nodes() {
    local node state
    for node in "${NODES[@]}"; do
        state=$(sinfo -h -n "$node" -o %t 2>/dev/null || true)
        if [[ "$state" =~ ^(drain|drng|drained|down|inval|fail) ]]; then
            log "resuming $node (was $state)"
            scontrol update nodename="$node" state=resume || true
        fi
    done
}

# Registered: slurmctld has heard from both slurmd (state no longer "unk").
nodes_registered() {
    local states
    states=$(sinfo -h -N -p "$WIDE_PARTITION" -o '%N %t' 2>/dev/null) || return 1
    ! grep -q ' unk' <<<"$states"
}

nodes_ready() {
    local states
    states=$(sinfo -h -N -p "$WIDE_PARTITION" -o '%N %t' 2>/dev/null) || return 1
    local node
    for node in "${NODES[@]}"; do
        grep -Eq "^$node (idle|mix|alloc)$" <<<"$states" || return 1
    done
}

wait_nodes_ready() {
    if ! wait_until 60 nodes_ready; then
        sinfo -N -l >&2 || true
        fail "nodes ${NODES[*]} not idle after 60 s" "$(slurmd_log "${NODES[0]}")"
    fi
}

main() {
    require_root
    take_lock
    local t0=$SECONDS
    install_packages
    phase_done "packages"
    add_host_aliases
    make_dirs
    echo "${#NODES[@]}" >"$NODE_COUNT_FILE"
    write_configs
    start_munge
    start_mariadb
    create_database
    phase_done "munge + MariaDB"
    start_slurmdbd
    register_cluster
    phase_done "slurmdbd"
    restart_slurm_if_reconfigured
    start_slurmctld
    local node
    for node in "${NODES[@]}"; do start_slurmd "$node"; done
    register_accounts
    wait_until 10 nodes_registered || true
    resume_nodes
    wait_nodes_ready
    phase_done "slurmctld + slurmd"
    log "cluster $CLUSTER_NAME up in $((SECONDS - t0)) s: partitions $PARTITION (n1-n$BASE_NODES) and $WIDE_PARTITION (${NODES[*]})"
    sinfo -N
}

main "$@"
