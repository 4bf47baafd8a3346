# Names and helpers of the emulated scale cluster (sourced, not run): a second Slurm
# instance beside machines/slurm_local's, with its own slurm.conf (SLURM_CONF), cluster
# name, ports, state, pid and log directories; the same munged and slurmdbd.
# shellcheck shell=bash disable=SC2034

SCALE_HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# slurm_local's helpers (log, fail, wait_until, pid files, take_lock, spawn_slurmd); its
# names are replaced below, so nothing here touches the 4-node test cluster's files.
# shellcheck source=../slurm_local/lib.sh
source "$SCALE_HERE/../slurm_local/lib.sh"
LOCAL_CLUSTER_NAME=$CLUSTER_NAME   # the test cluster's: accounting is shared with it
LOCAL_STATE_DIR=$STATE_DIR
LOCAL_RUN_DIR=$RUN_DIR

SLURM_CONF_DIR=/etc/slurm-scale
export SLURM_CONF=$SLURM_CONF_DIR/slurm.conf   # every Slurm command below talks to this instance
STATE_DIR=/var/lib/axonn-slurm-scale
RUN_DIR=/run/axonn-slurm-scale
LOG_DIR=/var/log/slurm-scale
CLUSTER_NAME=axonnscale
CTLD_PORT=7817
# slurmd ports: SLURMD_PORT_BASE + the node's index, below Linux's ephemeral range (32768)
SLURMD_PORT_BASE=12000
MAX_NODES=16000
# start.sh stops spawning slurmd when the host has less memory available than this
MIN_AVAILABLE_MB=${SCALE_MIN_AVAILABLE_MB:-6144}
INSTANCE_FILE=$STATE_DIR/instance   # "N SITE" of the last start.sh
MANAGED_MARK="# managed by axonn_launch machines/slurm_scale/start.sh"
HOSTS_MARK="# axonn_launch slurm_scale node"
REPO_DIR="$(cd "$SCALE_HERE/../.." && pwd)"
NODES=()

# Site names: node name prefix and digits, as the site's own node names look.
site_prefix() {
    case $1 in
    frontier) echo "frontier 5" ;;
    perlmutter | alps) echo "nid 6" ;;
    *) echo "$1 5" ;;
    esac
}

# "partition gpus_per_node cpus_per_task" of conf/machine/<site>.yaml (cpus 1 when unset).
site_shape() {
    python3 - "$REPO_DIR/axonn_launch/conf/machine/$1.yaml" <<'PY'
import sys, yaml
profile = yaml.safe_load(open(sys.argv[1]))
slurm, hardware = profile.get("slurm") or {}, profile.get("hardware") or {}
print(slurm.get("partition") or "batch", hardware.get("gpus_per_node") or 8,
      slurm.get("cpus_per_task") or 1)
PY
}

# Sets NODE_COUNT, SITE, NODE_PREFIX, NODE_DIGITS, PARTITION, GPUS_PER_NODE, CPUS_PER_NODE
# and NODES for N nodes of SITE.
set_instance() {
    NODE_COUNT=$1
    SITE=$2
    read -r NODE_PREFIX NODE_DIGITS < <(site_prefix "$SITE")
    local per_task
    read -r PARTITION GPUS_PER_NODE per_task < <(site_shape "$SITE") ||
        fail "no machine profile $SITE (axonn_launch/conf/machine/$SITE.yaml)"
    CPUS_PER_NODE=$((GPUS_PER_NODE * per_task))
    NODES=()
    local i
    for ((i = 1; i <= NODE_COUNT; i++)); do NODES+=("$(node_name "$i")"); done
}

# The instance start.sh last made; false when none.
load_instance() {
    [[ -s $INSTANCE_FILE ]] || return 1
    local count site
    read -r count site <"$INSTANCE_FILE"
    set_instance "$count" "$site"
}

node_name() { printf '%s%0*d' "$NODE_PREFIX" "$NODE_DIGITS" "$1"; }
node_index() { echo $((10#${1#"$NODE_PREFIX"})); }
node_range() { echo "$NODE_PREFIX[$(printf '%0*d' "$NODE_DIGITS" 1)-$(printf '%0*d' "$NODE_DIGITS" "$NODE_COUNT")]"; }
node_port() { echo $((SLURMD_PORT_BASE + $(node_index "$1"))); }

# Nodes by compact state: "idle 256" lines.
state_counts() { sinfo -h -p "$PARTITION" -o '%t %D' 2>/dev/null; }
nodes_idle() { [[ "$(state_counts)" == "idle $NODE_COUNT" ]]; }

log() { printf '[slurm_scale %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
