#!/usr/bin/env bash
# A real SLURM cluster on this machine, for tests and CI: one node on localhost, or N emulated nodes.
#
#   tests/slurm/cluster.sh install             apt-get install slurmctld slurmd slurm-client munge iproute2 (if missing)
#   tests/slurm/cluster.sh start [--nodes N]   munged + slurmctld + slurmd(s) in the background; waits until idle
#   tests/slurm/cluster.sh stop [--nodes N]    cancel all jobs, stop the daemons by their recorded PIDs, remove
#                                              everything start made (state dir; with --nodes also the namespaces,
#                                              bridge and /etc/hosts lines)
#   tests/slurm/cluster.sh status [--nodes N]  exit 0 if the cluster is up (prints sinfo), 1 otherwise
#   tests/slurm/cluster.sh env [--nodes N]     prints `export SLURM_CONF=...` (eval "$(tests/slurm/cluster.sh env)")
#   tests/slurm/cluster.sh kill-node NODE      (--nodes) SIGKILL every process of the node (its namespace): node loss
#   tests/slurm/cluster.sh start-node NODE     (--nodes) start the node's slurmd again after kill-node
#   tests/slurm/cluster.sh cut-node NODE       (--nodes) take the node's link down: a network partition
#   tests/slurm/cluster.sh mend-node NODE      (--nodes) bring the link up again
#   tests/slurm/cluster.sh wipe-scratch NODE   (--nodes) empty the node-local scratch of a killed node: its disk is lost
#
# Without --nodes: one node, named like this machine, on 127.0.0.1.
# With --nodes N: nodes pyr-node1..N, each slurmd in its own network, UTS and mount namespace (its own hostname, its
# own IP on a private bridge, its own node-local scratch directory at the same path on every node, exported to its
# jobs as $TMPDIR); slurmctld and munged run on the host; the filesystem outside the scratch directory is shared, as
# a cluster's checkpoint filesystem is. On stop/status/env/*-node, --nodes only selects the multi-node defaults below
# (its value is not used). The namespaces are entered with `nsenter --net`: `ip netns exec` remounts /sys, and slurmd
# then finds no cgroup filesystem.
#
# Everything else (config, munge key and socket, spool, logs, PID files) lives in one state dir, nothing in /etc
# (except, with --nodes, one tagged /etc/hosts line per node: SLURM needs node names to resolve).
# Needs root (slurmd launches jobs as the submitting user; munged, SlurmUser and SlurmdUser are root here).
#
# Environment:
#   PYRECOVER_SLURM_DIR           state dir                  (default /tmp/pyrecover-slurm; --nodes: /tmp/pyrecover-slurm-multi)
#   PYRECOVER_SLURM_CPUS          CPUs of the node; if it differs from the hardware, slurmd is told to trust
#                                 the config (SlurmdParameters=config_overrides)  (default: what `slurmd -C` sees)
#   PYRECOVER_SLURM_CTLD_PORT     slurmctld port                         (default 6817; --nodes: 6827)
#   PYRECOVER_SLURMD_PORT         slurmd port                            (default 6818; each node has its own IP)
#   PYRECOVER_SLURM_SUBNET        --nodes: first three octets of the bridge's /24: host .1, node i .(i+1)
#                                 (default 10.218.44)
#   PYRECOVER_SLURM_KILLWAIT      KillWait: seconds between SIGTERM and SIGKILL          (default 5)
#   PYRECOVER_SLURM_CRED_EXPIRE   AuthInfo cred_expire; a requeued job is held this + 1 s  (default 10)
#   PYRECOVER_SLURMD_TIMEOUT      SlurmdTimeout: a silent node is marked DOWN after this  (default 30; --nodes: 10)
#   PYRECOVER_SLURM_START_TIMEOUT seconds to wait for the node(s) to become idle        (default 60)
#   PYRECOVER_SLURM_EXTRA_CONF    extra lines appended to slurm.conf
set -euo pipefail

COMMAND=${1:-}
[[ $# -gt 0 ]] && shift
NODES=0 NODE_ARG=""  # NODES=0: the single-node cluster on localhost
while [[ $# -gt 0 ]]; do
    case $1 in
        --nodes) [[ $# -ge 2 ]] || { echo "error: --nodes needs a number, e.g. --nodes 2" >&2; exit 2; }
                 NODES=$2; shift ;;
        --nodes=*) NODES=${1#*=} ;;
        -*) echo "error: unknown option '$1' (see the header of $0)" >&2; exit 2 ;;
        *) [[ -z $NODE_ARG ]] || { echo "error: unexpected argument '$1'" >&2; exit 2; }
           NODE_ARG=$1 ;;
    esac
    shift
done
[[ $NODES =~ ^[0-9]+$ && $NODES -le 200 ]] || { echo "error: --nodes '$NODES' is not a number of nodes (1-200)" >&2; exit 2; }
MULTI=0
[[ $NODES -gt 0 ]] && MULTI=1

if [[ $MULTI == 1 ]]; then
    STATE_DIR=${PYRECOVER_SLURM_DIR:-/tmp/pyrecover-slurm-multi}
    CTLD_PORT=${PYRECOVER_SLURM_CTLD_PORT:-6827}
    SLURMD_TIMEOUT=${PYRECOVER_SLURMD_TIMEOUT:-10}
else
    STATE_DIR=${PYRECOVER_SLURM_DIR:-/tmp/pyrecover-slurm}
    CTLD_PORT=${PYRECOVER_SLURM_CTLD_PORT:-6817}
    SLURMD_TIMEOUT=${PYRECOVER_SLURMD_TIMEOUT:-30}
fi
CONF=$STATE_DIR/slurm.conf
SLURMD_PORT=${PYRECOVER_SLURMD_PORT:-6818}
KILLWAIT=${PYRECOVER_SLURM_KILLWAIT:-5}
CRED_EXPIRE=${PYRECOVER_SLURM_CRED_EXPIRE:-10}
START_TIMEOUT=${PYRECOVER_SLURM_START_TIMEOUT:-60}
# --nodes: names of what start makes on the host. One multi-node cluster per machine (fixed names: a stop after a
# crash finds them without any record).
SUBNET=${PYRECOVER_SLURM_SUBNET:-10.218.44}
NODE_PREFIX=pyr-node
BRIDGE=pyrslurm0
HOSTS_TAG="# pyrecover-slurm-multi"
SCRATCH=$STATE_DIR/scratch  # the node-local scratch dir: the same path on every node, each node sees its own
PACKAGES=(slurmctld slurmd slurm-client munge iproute2)  # iproute2: the namespaces and bridge of --nodes
BINARIES=(munged slurmctld slurmd sinfo squeue sbatch srun scontrol scancel ip nsenter unshare)

export SLURM_CONF=$CONF

log() { echo "[slurm-cluster] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

path_for() {  # daemons live in /usr/sbin, which is not always on PATH for non-login shells
    command -v "$1" 2>/dev/null || { [[ -x /usr/sbin/$1 ]] && echo "/usr/sbin/$1"; } || return 1
}

missing_binaries() {
    local b out=()
    for b in "${BINARIES[@]}"; do path_for "$b" >/dev/null || out+=("$b"); done
    echo "${out[*]}"
}

need_root() { [[ $(id -u) -eq 0 ]] || die "must run as root (slurmd/munged are started by hand as root)"; }

pid_running() {  # pid_running NAME -> 0 if the recorded PID exists and is not a zombie
    local f=$STATE_DIR/pids/$1.pid pid st
    [[ -s $f ]] || return 1
    pid=$(<"$f")
    st=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
    [[ -n $st && $st != Z ]]
}

pid_is() {  # pid_is NAME [BINARY] -> pid_running and the process really is that daemon (safe to kill)
    pid_running "$1" || return 1
    tr '\0' ' ' 2>/dev/null <"/proc/$(<"$STATE_DIR/pids/$1.pid")/cmdline" | grep -q -- "/${2:-$1} "
}

# ---------------------------------------------------------------------------------------------------- install
cmd_install() {
    need_root
    local pkg missing=()
    for pkg in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    if [[ ${#missing[@]} -eq 0 ]]; then
        [[ -z $(missing_binaries) ]] || die "packages installed but binaries missing: $(missing_binaries)"
        log "already installed: $(slurm_version)"
        return 0
    fi
    command -v apt-get >/dev/null || die "apt-get not found; install ${missing[*]} by hand"
    # Keep the packages' init scripts / units from starting system daemons during the install: we start our own.
    local policy=/usr/sbin/policy-rc.d made_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && made_policy=1
    fi
    # shellcheck disable=SC2064
    trap "[[ $made_policy == 1 ]] && rm -f $policy" EXIT
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-cache show "${missing[@]}" >/dev/null 2>&1; then
        log "apt-get update"
        apt-get update -q
    fi
    log "apt-get install ${missing[*]:-${PACKAGES[*]}}"
    if ! apt-get install -y -q --no-install-recommends "${missing[@]}"; then
        log "install failed; retrying after apt-get update"
        apt-get update -q
        apt-get install -y -q --no-install-recommends "${missing[@]}"
    fi
    [[ $made_policy == 1 ]] && rm -f "$policy"
    trap - EXIT
    local still
    still=$(missing_binaries)
    [[ -z $still ]] || die "still missing after install: $still"
    log "installed: $(slurm_version)"
}

slurm_version() { "$(path_for slurmd)" -V 2>/dev/null || echo unknown; }

# ---------------------------------------------------------------------------------------------------- start
node_names() {  # the nodes of this cluster, one per line
    if [[ -s $STATE_DIR/nodes ]]; then cat "$STATE_DIR/nodes"; else cat "$STATE_DIR/node" 2>/dev/null; fi
}

write_conf() {
    local host=$1 cpus=$2 mem=$3 overrides=$4 ctld_addr=127.0.0.1 daemon=slurmd nodes_conf i name
    if [[ $MULTI == 1 ]]; then
        # several slurmd on one machine: per-node spool, PID and log files (%n = the node name of `slurmd -N`)
        ctld_addr=$SUBNET.1 daemon=slurmd-%n
        nodes_conf=""
        for ((i = 1; i <= NODES; i++)); do
            name=$NODE_PREFIX$i
            nodes_conf+="NodeName=$name NodeAddr=$SUBNET.$((i + 1)) NodeHostname=$name CPUs=$cpus RealMemory=$mem State=UNKNOWN"$'\n'
        done
        nodes_conf+="PartitionName=debug Nodes=${NODE_PREFIX}[1-$NODES] Default=YES MaxTime=INFINITE State=UP"$'\n'
        # every task (the batch script too) gets the node-local scratch dir as TMPDIR
        printf '#!/bin/sh\necho "export TMPDIR=%s"\n' "$SCRATCH" >"$STATE_DIR/task_prolog.sh"
        chmod 755 "$STATE_DIR/task_prolog.sh"
        overrides+=$'\n'"TaskProlog=$STATE_DIR/task_prolog.sh"
    else
        nodes_conf="NodeName=$host NodeAddr=127.0.0.1 NodeHostname=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP"
    fi
    cat >"$CONF" <<EOF
# Written by tests/slurm/cluster.sh -- a throw-away test cluster.
ClusterName=pyrecover
SlurmctldHost=$host($ctld_addr)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# socket: our own munged; cred_expire: also how long a requeued job is held before it may start again (+1 s)
AuthInfo=socket=$STATE_DIR/munge/munge.socket.2,cred_expire=$CRED_EXPIRE

StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/$daemon
SlurmctldPidFile=$STATE_DIR/run/slurmctld.pid
SlurmdPidFile=$STATE_DIR/run/$daemon.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/$daemon.log
SlurmctldDebug=info
SlurmdDebug=info

# No cgroups on these machines / in CI containers.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# No slurmdbd, so no sacct: finished jobs are appended to a text file instead.
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE_DIR/jobcomp.log
MpiDefault=none
MailProg=/bin/true
PropagateResourceLimits=NONE

# Scheduling: quick passes so tests do not wait for the 60 s default main-scheduler interval.
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2,batch_sched_delay=1
SelectType=select/cons_tres
# Count CPUs, not cores, and do not treat memory as consumable (several jobs may share the node).
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1

# Quick tests: SIGTERM -> SIGKILL after KillWait s; no grace past the time limit.
KillWait=$KILLWAIT
OverTimeLimit=0
MinJobAge=60
SlurmdTimeout=$SLURMD_TIMEOUT
SlurmctldTimeout=30
InactiveLimit=0
MessageTimeout=10
UnkillableStepTimeout=30
$overrides
$nodes_conf
${PYRECOVER_SLURM_EXTRA_CONF:-}
EOF
}

start_daemon() {  # start_daemon NAME CMD...   (foreground daemon, own session, no inherited fds)
    local name=$1; shift
    setsid "$@" </dev/null >>"$STATE_DIR/log/$name.stdout" 2>&1 &
    echo $! >"$STATE_DIR/pids/$name.pid"
}

dump_logs() {
    local f
    for f in "$STATE_DIR"/log/*; do
        [[ -s $f ]] || continue
        log "---- last lines of $f"
        tail -n 25 "$f" >&2
    done
}

cmd_start() {
    need_root
    local missing
    missing=$(missing_binaries)
    [[ -z $missing ]] || die "missing binaries: $missing (run: $0 install)"

    if [[ -s $STATE_DIR/pids/slurmctld.pid ]] && all_running; then
        log "already running in $STATE_DIR"
        wait_idle
        return 0
    fi
    if [[ -d $STATE_DIR ]] || { [[ $MULTI == 1 ]] && net_leftovers; }; then
        log "cleaning stale state in $STATE_DIR"
        cmd_stop >/dev/null 2>&1 || true
    fi
    if [[ $MULTI == 1 ]]; then
        command -v ip >/dev/null && command -v nsenter >/dev/null && command -v unshare >/dev/null \
            || die "--nodes needs ip (iproute2), nsenter and unshare (util-linux)"
    fi
    local t0=$SECONDS
    mkdir -p "$STATE_DIR"/{munge,ctld,slurmd,run,log,pids}
    chmod 755 "$STATE_DIR"
    chmod 711 "$STATE_DIR/munge"  # munged wants the socket dir traversable by all

    # --- munge
    local key=$STATE_DIR/munge/munge.key
    if [[ ! -s $key ]]; then
        if command -v mungekey >/dev/null || [[ -x /usr/sbin/mungekey ]]; then
            "$(path_for mungekey)" --create --keyfile="$key" --force
        else
            dd if=/dev/urandom of="$key" bs=1024 count=1 status=none
        fi
    fi
    chmod 400 "$key"
    start_daemon munged "$(path_for munged)" --foreground --force \
        --key-file="$key" \
        --socket="$STATE_DIR/munge/munge.socket.2" \
        --pid-file="$STATE_DIR/run/munged.pid" \
        --seed-file="$STATE_DIR/munge/munged.seed" \
        --log-file="$STATE_DIR/log/munged.log"
    local i
    for ((i = 0; i < 100; i++)); do
        [[ -S $STATE_DIR/munge/munge.socket.2 ]] && break
        pid_running munged || { dump_logs; die "munged exited"; }
        sleep 0.1
    done
    [[ -S $STATE_DIR/munge/munge.socket.2 ]] || { dump_logs; die "munged socket did not appear"; }
    if command -v munge >/dev/null && command -v unmunge >/dev/null; then
        munge -n --socket="$STATE_DIR/munge/munge.socket.2" | unmunge --socket="$STATE_DIR/munge/munge.socket.2" >/dev/null \
            || { dump_logs; die "munge self-test failed"; }
    fi

    # --- node shape
    local host cpus mem hw overrides=""
    host=$(hostname -s 2>/dev/null || cut -d. -f1 /proc/sys/kernel/hostname)
    hw=$("$(path_for slurmd)" -C 2>/dev/null | head -1 || true)
    cpus=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$hw")
    mem=$(sed -n 's/.* RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
    [[ -n $cpus ]] || cpus=$(nproc)
    [[ -n $mem ]] || mem=$(($(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024))
    if [[ -n ${PYRECOVER_SLURM_CPUS:-} && ${PYRECOVER_SLURM_CPUS} != "$cpus" ]]; then
        cpus=$PYRECOVER_SLURM_CPUS
        overrides="SlurmdParameters=config_overrides"
    fi
    write_conf "$host" "$cpus" "$mem" "$overrides"
    local node
    if [[ $MULTI == 1 ]]; then
        for ((i = 1; i <= NODES; i++)); do echo "$NODE_PREFIX$i"; done >"$STATE_DIR/nodes"
        net_up
    else
        echo "$host" >"$STATE_DIR/node"
    fi

    # --- controller and compute daemon(s) (-c: start with no job state from an earlier run)
    start_daemon slurmctld "$(path_for slurmctld)" -D -c -f "$CONF"
    if [[ $MULTI == 1 ]]; then
        while read -r node; do start_node "$node"; done < <(node_names)
    else
        start_daemon slurmd "$(path_for slurmd)" -D -N "$host" -f "$CONF"
    fi
    wait_idle
    log "up in $((SECONDS - t0)) s: $(node_names | tr '\n' ' ')CPUs=$cpus RealMemory=${mem}M each, $(slurm_version), state dir $STATE_DIR"
    log "use: export SLURM_CONF=$CONF"
}

# ---------------------------------------------------------------------------------------------------- --nodes
node_num() { [[ $1 =~ ^$NODE_PREFIX([0-9]+)$ ]] || die "'$1' is not a node of this cluster ($NODE_PREFIX<i>)"; echo "${BASH_REMATCH[1]}"; }
node_ip() { echo "$SUBNET.$(($(node_num "$1") + 1))"; }
node_veth() { echo "pyrv$(node_num "$1")"; }  # host side of the node's link (the node side is its eth0)

net_up() {  # a bridge on the host; per node a network namespace with a veth pair into the bridge, and a hosts line
    local node
    ip link add "$BRIDGE" type bridge
    ip addr add "$SUBNET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    while read -r node; do
        ip netns add "$node"
        ip link add "$(node_veth "$node")" type veth peer name eth0 netns "$node"
        ip link set "$(node_veth "$node")" master "$BRIDGE" up
        ip -n "$node" addr add "$(node_ip "$node")/24" dev eth0
        ip -n "$node" link set eth0 up
        ip -n "$node" link set lo up
        echo "$(node_ip "$node") $node $HOSTS_TAG" >>/etc/hosts
    done < <(node_names)
}

start_node() {  # slurmd of one node, in the node's network namespace plus its own UTS (hostname) and mount namespace
    local node=$1
    mkdir -p "$STATE_DIR/local/$node" "$SCRATCH"
    chmod 1777 "$STATE_DIR/local/$node"
    # nsenter, unshare and sh all exec: the recorded PID is slurmd's
    start_daemon "slurmd-$node" nsenter --net="/run/netns/$node" unshare --uts --mount --propagation private -- \
        /bin/sh -c 'hostname "$1" && mount --bind "$2" "$3" && exec "$4" -D -N "$1" -f "$5"' \
        _ "$node" "$STATE_DIR/local/$node" "$SCRATCH" "$(path_for slurmd)" "$CONF"
}

node_pids() { ip netns pids "$1" 2>/dev/null || true; }  # every process of the node: slurmd, slurmstepd, job tasks

kill_node_pids() {  # SIGKILL every process in the node's namespace, by PID, until none is left
    local node=$1 pids n=0
    while pids=$(node_pids "$node") && [[ -n $pids ]]; do
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null || true
        ((++n < 50)) || { log "processes of $node survive SIGKILL: $pids"; return 1; }
        sleep 0.1
    done
}

net_leftovers() {  # anything of a multi-node cluster on this machine (also one whose state dir is gone)
    ip netns list 2>/dev/null | grep -qE "^$NODE_PREFIX[0-9]+( |$)" || ip link show "$BRIDGE" >/dev/null 2>&1 \
        || grep -qF "$HOSTS_TAG" /etc/hosts 2>/dev/null
}

net_down() {  # everything net_up and start_node made, found by name, so that a crashed run's leftovers go too
    local ns link
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$NODE_PREFIX[0-9]+$" || true); do
        kill_node_pids "$ns" || true
        ip netns del "$ns" 2>/dev/null || log "could not delete network namespace $ns"
    done
    for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E '^pyrv[0-9]+$' || true); do
        ip link del "$link" 2>/dev/null || true
    done
    ip link show "$BRIDGE" >/dev/null 2>&1 && { ip link del "$BRIDGE" || log "could not delete bridge $BRIDGE"; }
    if grep -qF "$HOSTS_TAG" /etc/hosts 2>/dev/null; then
        # rewrite in place: /etc/hosts is often a bind mount that cannot be replaced by a rename
        local kept
        kept=$(grep -vF "$HOSTS_TAG" /etc/hosts || true)
        printf '%s\n' "$kept" >/etc/hosts
    fi
}

daemon_names() {  # the PID-file names of this cluster's daemons, in stop order: compute daemons, controller, munge
    local node
    if [[ $MULTI == 1 || -s $STATE_DIR/nodes ]]; then
        while read -r node; do echo "slurmd-$node"; done < <(node_names)
    else
        echo slurmd
    fi
    echo slurmctld
    echo munged
}

daemon_is() { pid_is "$1" "${1%%-*}"; }  # slurmd-pyr-node1 is a slurmd

all_running() {
    local d
    for d in $(daemon_names); do daemon_is "$d" || return 1; done
}

cmd_node() {  # kill-node | start-node | cut-node | mend-node | wipe-scratch NODE
    need_root
    local node=$NODE_ARG
    [[ -n $node ]] || die "usage: $0 $COMMAND NODE --nodes N"
    [[ -s $STATE_DIR/nodes ]] || die "no multi-node cluster in $STATE_DIR (start one with: $0 start --nodes N)"
    grep -qxF "$node" "$STATE_DIR/nodes" || die "no node '$node' in $STATE_DIR/nodes ($(node_names | tr '\n' ' '))"
    case $COMMAND in
        kill-node) kill_node_pids "$node"; log "killed every process of $node" ;;
        start-node)
            daemon_is "slurmd-$node" && { log "slurmd of $node already running"; return 0; }
            start_node "$node"
            log "slurmd of $node started (pid $(<"$STATE_DIR/pids/slurmd-$node.pid"))"
            ;;
        cut-node) ip link set "$(node_veth "$node")" down; log "link of $node down" ;;
        mend-node) ip link set "$(node_veth "$node")" up; log "link of $node up" ;;
        wipe-scratch)
            # a running node would go on writing into the directory being emptied: only a lost node loses its disk
            [[ -z $(node_pids "$node") ]] || die "$node still runs processes: kill-node $node first"
            local dir=$STATE_DIR/local/$node  # the host side of the node's bind mount at $SCRATCH (start_node)
            find "$dir" -mindepth 1 -delete
            log "scratch of $node emptied ($dir)"
            ;;
    esac
}

node_state() {  # the node's state, or with several nodes the first one not yet usable
    local st
    st=$("$(path_for sinfo)" -h -N -o '%N %T' 2>/dev/null) || return 1
    [[ -n $st ]] || return 1
    awk 'BEGIN {out = ""} $2 !~ /^(idle|mixed|allocated)$/ {if (out == "") out = $2} END {print (out == "" ? "idle" : out)}' <<<"$st"
}

wait_idle() {
    local deadline=$((SECONDS + START_TIMEOUT)) st=""
    while ((SECONDS < deadline)); do
        for d in $(daemon_names); do
            pid_running "$d" || { dump_logs; die "$d exited during start-up (logs above, state dir $STATE_DIR)"; }
        done
        st=$(node_state || true)
        case $st in
            idle | mixed | allocated) return 0 ;;
        esac
        sleep 0.5
    done
    dump_logs
    die "node did not become idle within ${START_TIMEOUT}s (last sinfo state: '${st:-no answer from slurmctld}'; logs above, state dir $STATE_DIR)"
}

# ---------------------------------------------------------------------------------------------------- stop
wait_gone() {  # wait_gone PID TIMEOUT_TENTHS
    local pid=$1 n=$2
    while ((n-- > 0)); do
        [[ -e /proc/$pid ]] || return 0
        # a zombie counts as gone
        [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) == Z ]] && return 0
        sleep 0.1
    done
    return 1
}

job_pids() {
    # PIDs of processes this cluster started for jobs: slurmstepd (inherits slurmd's environment, which has our
    # SLURM_CONF) and job tasks (SLURM_JOB_ID set and our SLURM_CONF). Never this script or its ancestors.
    local env p a skip=" $$ "
    a=$$
    while [[ $a -gt 1 ]]; do
        a=$(awk '{print $4}' "/proc/$a/stat" 2>/dev/null) || break
        skip+="$a "
    done
    for env in /proc/[0-9]*/environ; do
        p=${env#/proc/}; p=${p%/environ}
        [[ $skip == *" $p "* ]] && continue
        tr '\0' '\n' 2>/dev/null <"$env" | grep -qxF "SLURM_CONF=$CONF" || continue
        if [[ $(cat "/proc/$p/comm" 2>/dev/null) == slurmstepd ]] || tr '\0' '\n' 2>/dev/null <"$env" | grep -q '^SLURM_JOB_ID='; then
            echo "$p"
        fi
    done
    return 0
}

cmd_stop() {
    if [[ ! -d $STATE_DIR ]]; then
        if [[ $MULTI == 1 ]] && net_leftovers; then
            net_down
            log "removed the namespaces, bridge and hosts lines of an earlier multi-node cluster"
        fi
        log "not running (no $STATE_DIR)"
        return 0
    fi
    local node
    if [[ -s $STATE_DIR/nodes ]]; then  # a cut-off node could not hear the cancel
        while read -r node; do ip link set "$(node_veth "$node")" up 2>/dev/null || true; done < <(node_names)
    fi
    # 1. cancel every job so slurmd's slurmstepd processes end their tasks cleanly
    if pid_is slurmctld && [[ -f $CONF ]]; then
        local jobs
        jobs=$(timeout 10 "$(path_for squeue)" -h -o %A 2>/dev/null | sort -u | tr '\n' ' ' || true)
        if [[ -n ${jobs// /} ]]; then
            log "cancelling jobs: $jobs"
            # shellcheck disable=SC2086
            timeout 10 "$(path_for scancel)" $jobs 2>/dev/null || true
            local deadline=$((SECONDS + KILLWAIT + 10))
            while ((SECONDS < deadline)); do
                [[ -z $(timeout 10 "$(path_for squeue)" -h -t running,completing,suspended -o %A 2>/dev/null || true) ]] && break
                sleep 0.5
            done
        fi
    fi
    # 2. daemons, by recorded PID: TERM, wait, KILL
    local d pid
    for d in $(daemon_names); do
        daemon_is "$d" || continue
        pid=$(<"$STATE_DIR/pids/$d.pid")
        kill -TERM "$pid" 2>/dev/null || true
        if ! wait_gone "$pid" 150; then
            log "$d ($pid) ignored SIGTERM, sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            wait_gone "$pid" 50 || true
        fi
    done
    # 3. anything the jobs left behind (only if step 1 could not cancel them)
    local left
    left=$(job_pids)
    if [[ -n $left ]]; then
        log "killing leftover job processes: ${left//$'\n'/ }"
        # shellcheck disable=SC2086
        kill -KILL $left 2>/dev/null || true
    fi
    # 4. the nodes' namespaces (and whatever still runs in them), bridge, hosts lines
    if [[ $MULTI == 1 || -s $STATE_DIR/nodes ]]; then
        net_down
    fi
    # 5. state
    rm -rf "$STATE_DIR"
    log "stopped, $STATE_DIR removed"
}

# ---------------------------------------------------------------------------------------------------- status
cmd_status() {
    local d ok=0
    for d in $(daemon_names); do
        if daemon_is "$d"; then
            echo "$d: running (pid $(<"$STATE_DIR/pids/$d.pid"))"
        else
            echo "$d: not running"
            ok=1
        fi
    done
    if ((ok == 0)); then
        echo "SLURM_CONF=$CONF"
        "$(path_for sinfo)" -N -l || ok=1
    fi
    return $ok
}

case $COMMAND in
    install) cmd_install ;;
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    version) slurm_version ;;
    kill-node | start-node | cut-node | mend-node | wipe-scratch)
        [[ $MULTI == 1 ]] || die "$COMMAND is for a multi-node cluster: add --nodes N"
        cmd_node ;;
    *) echo "usage: $0 {install|start|stop|status|env|version} [--nodes N] | {kill,start,cut,mend}-node|wipe-scratch NODE --nodes N" >&2
       exit 2 ;;
esac
