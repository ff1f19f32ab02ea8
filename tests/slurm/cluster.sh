#!/usr/bin/env bash
# A real single-node SLURM cluster on localhost, for tests and CI.
#
#   tests/slurm/cluster.sh install   apt-get install slurmctld slurmd slurm-client munge (only if missing)
#   tests/slurm/cluster.sh start     munged + slurmctld + slurmd in the background; waits until the node is idle
#   tests/slurm/cluster.sh stop      cancel all jobs, stop the daemons by their recorded PIDs, remove the state dir
#   tests/slurm/cluster.sh status    exit 0 if the cluster is up (prints sinfo), 1 otherwise
#   tests/slurm/cluster.sh env       prints `export SLURM_CONF=...` (eval "$(tests/slurm/cluster.sh env)")
#
# Everything (config, munge key and socket, spool, logs, PID files) lives in one state dir, nothing in /etc.
# Needs root (slurmd launches jobs as the submitting user; munged, SlurmUser and SlurmdUser are root here).
#
# Environment:
#   PYRECOVER_SLURM_DIR           state dir                              (default /tmp/pyrecover-slurm)
#   PYRECOVER_SLURM_CPUS          CPUs of the node; if it differs from the hardware, slurmd is told to trust
#                                 the config (SlurmdParameters=config_overrides)  (default: what `slurmd -C` sees)
#   PYRECOVER_SLURM_CTLD_PORT     slurmctld port                         (default 6817)
#   PYRECOVER_SLURMD_PORT         slurmd port                            (default 6818)
#   PYRECOVER_SLURM_KILLWAIT      KillWait: seconds between SIGTERM and SIGKILL          (default 5)
#   PYRECOVER_SLURM_CRED_EXPIRE   AuthInfo cred_expire; a requeued job is held this + 1 s  (default 10)
#   PYRECOVER_SLURM_START_TIMEOUT seconds to wait for the node to become idle           (default 60)
#   PYRECOVER_SLURM_EXTRA_CONF    extra lines appended to slurm.conf
set -euo pipefail

STATE_DIR=${PYRECOVER_SLURM_DIR:-/tmp/pyrecover-slurm}
CONF=$STATE_DIR/slurm.conf
CTLD_PORT=${PYRECOVER_SLURM_CTLD_PORT:-6817}
SLURMD_PORT=${PYRECOVER_SLURMD_PORT:-6818}
KILLWAIT=${PYRECOVER_SLURM_KILLWAIT:-5}
CRED_EXPIRE=${PYRECOVER_SLURM_CRED_EXPIRE:-10}
START_TIMEOUT=${PYRECOVER_SLURM_START_TIMEOUT:-60}
PACKAGES=(slurmctld slurmd slurm-client munge)
BINARIES=(munged slurmctld slurmd sinfo squeue sbatch srun scontrol scancel)
# Order matters for stop: compute daemon first, controller, then authentication.
DAEMONS=(slurmd slurmctld munged)

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

pid_is() {  # pid_is NAME -> pid_running and the process really is that daemon (safe to kill)
    pid_running "$1" || return 1
    tr '\0' ' ' 2>/dev/null <"/proc/$(<"$STATE_DIR/pids/$1.pid")/cmdline" | grep -q -- "/$1 "
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
write_conf() {
    local host=$1 cpus=$2 mem=$3 overrides=$4
    cat >"$CONF" <<EOF
# Written by tests/slurm/cluster.sh -- a throw-away single-node test cluster.
ClusterName=pyrecover
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# socket: our own munged; cred_expire: also how long a requeued job is held before it may start again (+1 s)
AuthInfo=socket=$STATE_DIR/munge/munge.socket.2,cred_expire=$CRED_EXPIRE

StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/slurmd
SlurmctldPidFile=$STATE_DIR/run/slurmctld.pid
SlurmdPidFile=$STATE_DIR/run/slurmd.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd.log
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
SlurmdTimeout=30
SlurmctldTimeout=30
InactiveLimit=0
MessageTimeout=10
UnkillableStepTimeout=30
$overrides
NodeName=$host NodeAddr=127.0.0.1 NodeHostname=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
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

    if pid_is slurmctld && pid_is slurmd && pid_is munged; then
        log "already running in $STATE_DIR"
        wait_idle
        return 0
    fi
    if [[ -d $STATE_DIR ]]; then
        log "cleaning stale state in $STATE_DIR"
        cmd_stop >/dev/null 2>&1 || true
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
    echo "$host" >"$STATE_DIR/node"

    # --- controller and compute daemon (-c: start with no job state from an earlier run)
    start_daemon slurmctld "$(path_for slurmctld)" -D -c -f "$CONF"
    start_daemon slurmd "$(path_for slurmd)" -D -N "$host" -f "$CONF"
    wait_idle
    log "up in $((SECONDS - t0)) s: node $host CPUs=$cpus RealMemory=${mem}M, $(slurm_version), state dir $STATE_DIR"
    log "use: export SLURM_CONF=$CONF"
}

node_state() { "$(path_for sinfo)" -h -N -n "$(cat "$STATE_DIR/node" 2>/dev/null)" -o %T 2>/dev/null | head -1; }

wait_idle() {
    local deadline=$((SECONDS + START_TIMEOUT)) st=""
    while ((SECONDS < deadline)); do
        for d in "${DAEMONS[@]}"; do
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
        log "not running (no $STATE_DIR)"
        return 0
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
    for d in "${DAEMONS[@]}"; do
        pid_is "$d" || continue
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
    # 4. state
    rm -rf "$STATE_DIR"
    log "stopped, $STATE_DIR removed"
}

# ---------------------------------------------------------------------------------------------------- status
cmd_status() {
    local d ok=0
    for d in "${DAEMONS[@]}"; do
        if pid_is "$d"; then
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

case ${1:-} in
    install) cmd_install ;;
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    version) slurm_version ;;
    *) echo "usage: $0 {install|start|stop|status|env|version}" >&2; exit 2 ;;
esac
