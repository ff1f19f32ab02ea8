#!/bin/bash
# PyRecover on SLURM: train, save before the time limit, requeue, resume -- without losing a step.
#
#   sbatch submit-training-simple.sh [--distributed] [--exp_name=NAME] [--continue] [--use_torch_distributed_ckpt]
#          [--timeaware-checkpointing] [--use_flash_attention] [--log-loss-to-csv] [--fused-optimizer] [--compile]
#          [--sequence-length=N] [--setup=FILE] [--spares=K] [--profile-nsys] [-- any train.py flags]
#
# Valued options take `--opt=VALUE` or `--opt VALUE` (--exp_name, --sequence-length, --setup, --spares).
# --spares=K (with --distributed): launcher.py runs each node's ranks plus K spare processes in one srun task per node;
#   a rank that dies or raises, or a lost node's, is replaced by a spare in process -- one on its node first, else
#   another node's -- and the survivors keep their processes (no restart; docs/in-process-recovery.md).
#
# Environment:
#   PYTHON=/path/to/python   the interpreter that runs train.py on every node (default: `python` on PATH, after setup)
#   PYRECOVER_SETUP=FILE     same as --setup=FILE (the option wins): a bash file sourced in this batch shell AND on every
#                            node by each srun task right before `exec python train.py`, e.g. one of
#                              module load cuda/12.4 python/3.11
#                              source ~/miniforge3/etc/profile.d/conda.sh && conda activate pyrecover
#                              source /scratch/$USER/pyrecover/.venv/bin/activate
#                            (srun copies this shell's exported variables to the tasks, but not shell functions,
#                            aliases or anything a module system keeps outside the environment, and a node may need its
#                            own module/conda paths: sourcing per task is what works everywhere)
#   PYRECOVER_DIR=REPO       where train.py is (see below); PYRECOVER_MAX_RESTARTS=N (default 100)
#   PYRECOVER_INPLACE_RESTARTS=N  a rank that crashed: run again in this allocation from latest, up to N times per
#                            run of the job (default 2; 0: never), instead of ending the job
#   PYRECOVER_SRUN_ARGS="..."  more srun options for the training step, split on whitespace (quotes are refused), e.g.
#                            containers: "--container-image=IMAGE --container-mounts=$PWD:$PWD --container-workdir=$PWD"
#                            (pyxis/enroot) or "--environment=NAME" (CSCS EDF); "--cpu-bind=cores"; see docs/slurm.md
#   PYRECOVER_DRY_RUN=1      run it on the login node before sbatch: prints the #SBATCH resources, runs
#                            `PYTHON train.py --check <train.py flags>` here (flags, data files, tokenizer, memory
#                            estimate, checkpoint folder, what a resume would load; exit 2 if it fails), prints the srun
#                            line and exits 0 -- no srun. PYRECOVER_CHECK=0 skips the train.py check (e.g. when PYTHON
#                            only exists inside the job's container)
#
# Edit the #SBATCH block below once for your cluster (command-line sbatch options override it, e.g.
# `sbatch --time=12:00:00 --nodes=4 submit-training-simple.sh --distributed`). The job finds train.py in PYRECOVER_DIR,
# else the job's working directory, else the submit directory: run sbatch from the repository, or from anywhere with
# `sbatch --chdir=REPO REPO/submit-training-simple.sh`. Relative paths (checkpoints/, data/) are relative to the job's
# working directory (the submit directory unless --chdir).
#
# How a job survives its time limit:
#   * --signal=USR1@120: SLURM sends SIGUSR1 ~120 s (give or take the 30 s it checks with) before the limit. Without
#     `B:` it goes to every srun task, i.e. to every training rank directly (srun launches the ranks itself, no
#     torchrun in between), so no forwarding is needed. (`B:` would reach only this batch shell, which would then have
#     to forward it -- and bash runs traps only after the foreground srun returns.)
#   * train.py (see checkpoint/policy.py): all ranks agree at the next step boundary, save the same step, rank 0
#     `scontrol requeue`s the job once the checkpoint has committed; SLURM requeues it (#SBATCH --requeue), and the rerun
#     (SLURM_RESTART_COUNT > 0) resumes from `latest` automatically. --timeaware-checkpointing additionally stops on
#     its own before the end time it reads from squeue, for clusters/jobs without a warning signal.
#   * SIGTERM (time limit reached, preemption, scancel) also saves and stops, without a requeue.
#
# Chaining instead of requeueing (clusters that forbid requeue, or a fixed budget of runs): a job array, one task at a
# time, each resuming from `latest` (array tasks do not requeue themselves; pass `-- --requeue` to change that):
#   sbatch --array=1-10%1 submit-training-simple.sh --distributed --exp_name=big-run
#
# Exit codes of train.py and what this script does with them:
#   0 finished                      -> exit 0
#   1 failed (or a rank killed)     -> run again in this allocation from latest (PYRECOVER_INPLACE_RESTARTS), then
#                                      exit with that code
#   2 bad input (one-line message)  -> exit 2
#   3 stopped, state saved, requeue -> train.py already requeued the job (SLURM ends this script); if it did not
#                                      (--jit-checkpoint after a rank failure), requeue here, within MAX_RESTARTS
#   4 stopped, state saved, no requeue (SIGTERM, --no-requeue, array task, max restarts) -> exit 0
#   5 stopped, state saved, requeue failed (scontrol missing?) -> exit 5: resubmit with --continue
#   6 fenced: a newer incarnation took the run directory over (one writer per run directory) -> exit 6
#
# ---------------------------------------------------------------------------------------------------------------------
# Edit here: your cluster's defaults.
#SBATCH --job-name=pyrecover
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --time=04:00:00
#SBATCH --signal=USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
##SBATCH --gpus-per-node=4
##SBATCH --cpus-per-task=8
##SBATCH --partition=YOUR_PARTITION
##SBATCH --account=YOUR_ACCOUNT
#
# --ntasks-per-node = GPUs per node (one rank per GPU); on a CPU-only partition, the ranks a node should run (gloo).
# Uncomment --gpus-per-node (or --gres=gpu:N) on GPU clusters that need it; --open-mode=append keeps the first run's
# log when the job is requeued (the default truncates it). Requeued jobs keep their job id, so %x-%j.out is one file.
# ---------------------------------------------------------------------------------------------------------------------

MAX_RESTARTS=${PYRECOVER_MAX_RESTARTS:-100}  # also passed to train.py as --max-restarts
INPLACE_RESTARTS=${PYRECOVER_INPLACE_RESTARTS:-2}  # a crashed rank: rerun in the allocation, this many times
PYTHON=${PYTHON:-python}

set -uo pipefail

die() { echo "submit-training-simple.sh: error: $*" >&2; exit 2; }
[[ $INPLACE_RESTARTS =~ ^[0-9]+$ ]] || die "PYRECOVER_INPLACE_RESTARTS='$INPLACE_RESTARTS': give a whole number of" \
    "restarts in the allocation (0: none)"

# The batch script runs from a copy in SLURM's spool directory, so $0 does not locate the repository. Look for train.py
# in PYRECOVER_DIR, then the job's working directory (sbatch --chdir=REPO), then the submit directory (outside SLURM:
# this script's own directory), in that order.
submit_dir=${SLURM_SUBMIT_DIR:-$(cd "$(dirname "$0")" && pwd)}
REPO=
for dir in "${PYRECOVER_DIR:-}" "$PWD" "$submit_dir"; do
    if [[ -n $dir && -f $dir/train.py ]]; then
        REPO=$(cd "$dir" && pwd)
        break
    fi
done
[[ -n $REPO ]] || die "train.py not found in PYRECOVER_DIR (${PYRECOVER_DIR:-not set}), the job's working directory" \
    "($PWD) or the submit directory ($submit_dir): set PYRECOVER_DIR to the repository, or sbatch --chdir=REPO"

# Extra srun options, split on whitespace as an unquoted shell word list would be (no globbing). Quotes would reach srun
# as literal characters, so a value that needs them is refused rather than mangled.
srun_extra=()
if [[ -n ${PYRECOVER_SRUN_ARGS:-} ]]; then
    [[ $PYRECOVER_SRUN_ARGS == *[\"\']* ]] && die "PYRECOVER_SRUN_ARGS='$PYRECOVER_SRUN_ARGS': it is split on" \
        "whitespace and quotes are not interpreted; give options without quotes or spaces inside a value"
    read -r -d '' -a srun_extra <<< "$PYRECOVER_SRUN_ARGS" || true  # -d '': every line, not just the first
fi

distributed=0 resume=0 nsys=0 spares=0
setup=${PYRECOVER_SETUP:-}
train_args=()
# A valued option as `--opt=VALUE` or `--opt VALUE`: sets $value and $consumed (1 extra argument taken, or 0).
take_value() {  # take_value OPTION-AS-GIVEN [NEXT-ARG...]
    consumed=0
    if [[ $1 == *=* ]]; then
        value=${1#*=}
    elif [[ $# -ge 2 && $2 != --* ]]; then
        value=$2 consumed=1
    else
        die "option '$1' needs a value: '$1=VALUE' or '$1 VALUE'"
    fi
    [[ -n $value ]] || die "option '${1%%=*}' needs a non-empty value"
}
while [[ $# -gt 0 ]]; do
    case $1 in
        --distributed) distributed=1 ;;
        --exp_name | --exp_name=* | --exp-name | --exp-name=*)
            take_value "$@"; shift "$consumed"; train_args+=(--experiment_name "$value") ;;
        --setup | --setup=*) take_value "$@"; shift "$consumed"; setup=$value ;;
        --spares | --spares=*) take_value "$@"; shift "$consumed"; spares=$value ;;
        --continue) resume=1 ;;
        --use_torch_distributed_ckpt | --use-torch-distributed-ckpt) train_args+=(--use-torch-distributed-ckpt) ;;
        --timeaware-checkpointing | --timeaware_checkpointing) train_args+=(--timeaware-checkpointing) ;;
        --use_flash_attention | --use-flash-attention) train_args+=(--use_flash_attention) ;;
        --log-loss-to-csv | --log_loss_to_csv) train_args+=(--log-loss-to-csv) ;;
        --fused-optimizer | --fused_optimizer) train_args+=(--fused-optimizer) ;;
        --compile) train_args+=(--compile) ;;
        --sequence-length | --sequence-length=* | --sequence_length | --sequence_length=*)
            take_value "$@"; shift "$consumed"; train_args+=(--sequence-length "$value") ;;
        --profile-nsys | --profile_nsys) nsys=1 ;;
        --) shift; train_args+=("$@"); break ;;
        -h | --help) sed -n '2,/^# ----/p' "$REPO/submit-training-simple.sh" 2>/dev/null || sed -n '2,/^# ----/p' "$0"; exit 0 ;;
        *) die "unknown option '$1' (train.py flags go after --, e.g. -- --training-steps 1000)" ;;
    esac
    shift
done

# The setup file: checked here, before anything runs (one line, exit 2), then sourced in this shell (so `command -v`,
# MASTER_ADDR discovery and nsys below see the same environment) and again by every task (see the srun line).
if [[ -n $setup ]]; then
    [[ $setup == /* ]] || setup=$PWD/$setup  # the tasks must find it whatever their working directory
    [[ -f $setup && -r $setup ]] || die "setup file '$setup' (--setup / PYRECOVER_SETUP) does not exist or is not" \
        "readable: give a readable bash file (module load / conda activate / source venv), or unset it"
    # Sourced without nounset/pipefail (conda's and many module systems' scripts read unset variables), then this
    # script's own options again, whatever the file set (`set -e` would end this script before it reads the exit code).
    set +uo pipefail
    # shellcheck disable=SC1090
    source "$setup" || die "setup file '$setup' failed (exit $?) in the batch shell: fix it (or unset PYRECOVER_SETUP)"
    set +e -uo pipefail
fi

restart=${SLURM_RESTART_COUNT:-0}
# A requeued run, or a later task of a job array, continues from the newest verified checkpoint.
if [[ $resume == 0 && $restart -gt 0 ]]; then
    resume=1
    echo "requeued run (SLURM_RESTART_COUNT=$restart): resuming from latest"
fi
if [[ $resume == 0 && -n ${SLURM_ARRAY_TASK_ID:-} && ${SLURM_ARRAY_TASK_ID} != "${SLURM_ARRAY_TASK_MIN:-$SLURM_ARRAY_TASK_ID}" ]]; then
    resume=1
    echo "job array task $SLURM_ARRAY_TASK_ID: resuming from latest"
fi
[[ $resume == 1 ]] && train_args+=(--resume-from-checkpoint latest)
train_args+=(--max-restarts "$MAX_RESTARTS")

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
export PYTHONUNBUFFERED=1

[[ $spares =~ ^[0-9]+$ ]] || die "--spares '$spares': give a whole number of spare processes (0: none)"
if [[ $spares -gt 0 ]]; then
    [[ $distributed == 1 ]] || die "--spares $spares needs --distributed: spares take the place of a failed rank"
    nodes=${SLURM_JOB_NUM_NODES:-1} ranks=${SLURM_NTASKS:-1}
    (( ranks % nodes == 0 )) || die "--spares $spares: the job's $ranks tasks do not split evenly over its $nodes" \
        "nodes; ask for --ntasks-per-node (each node runs the same number of ranks)"
fi

launch=(srun --kill-on-bad-exit=0)
# The job's first node, and a port from the job id (two jobs sharing a node do not collide): where the ranks of a
# srun-launched group meet (MASTER_ADDR/PORT), or where node 0's launcher hosts the store.
first_node() { scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" 2>/dev/null | head -n 1; }
job_port() { echo "${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}"; }

rc_file=
if [[ $spares -gt 0 ]]; then
    # One task per node, launcher.py, which starts the node's ranks and spares, keeps the survivors of a failure alive
    # and forwards SLURM's signals to them; its exit code is the ranks'. One node: the store on 127.0.0.1. Several:
    # node 0's launcher hosts it on the first node's address and decides; a node that goes silent is lost and its
    # ranks go to spares elsewhere, so SLURM must not end the step or the job for it (--no-kill). srun's own code then
    # counts the lost node's task: the job's is what node 0's launcher wrote to rc_file (node 0 runs this script).
    per_node=$((ranks / nodes))
    launcher=(--nproc "$per_node" --spares "$spares")
    if [[ $nodes == 1 ]]; then
        launch+=(--ntasks=1 --nodes=1 --overcommit)
        echo "job ${SLURM_JOB_ID:-?}: $ranks ranks and $spares spares on one node (launcher.py)"
    else
        store_host=$(first_node)
        store_port=$(job_port)
        rc_file=${TMPDIR:-/tmp}/pyrecover-launcher-${SLURM_JOB_ID:-0}-$restart.rc
        launch+=(--nodes="$nodes" --ntasks="$nodes" --ntasks-per-node=1 --overcommit --no-kill)
        launcher+=(--nnodes "$nodes" --store "${store_host:-localhost}:$store_port" --rc-file "$rc_file")
        echo "job ${SLURM_JOB_ID:-?}: $per_node ranks and $spares spares on each of $nodes nodes (launcher.py, store" \
             "${store_host:-localhost}:$store_port)"
    fi
    train_args=(--distributed "${train_args[@]}")
elif [[ $distributed == 1 ]]; then
    # One rank per task (= per GPU); distributed.py reads SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID.
    if [[ -z ${MASTER_ADDR:-} ]]; then
        MASTER_ADDR=$(first_node)
        export MASTER_ADDR=${MASTER_ADDR:-localhost}
    fi
    MASTER_PORT=$(job_port)
    export MASTER_PORT
    train_args=(--distributed "${train_args[@]}")
    echo "job ${SLURM_JOB_ID:-?}: ${SLURM_NTASKS:-?} ranks on ${SLURM_JOB_NUM_NODES:-?} node(s), master $MASTER_ADDR:$MASTER_PORT"
else
    launch+=(--ntasks=1 --nodes=1)  # one process; still under srun so that --signal (without B:) reaches it
fi
launch+=(${srun_extra[@]+"${srun_extra[@]}"})  # bash < 4.4 under set -u: an empty array is "unbound"  # after ours (a later srun option wins), before nsys (a command, not an option)
if [[ $nsys == 1 ]]; then
    command -v nsys >/dev/null || die "--profile-nsys: nsys (NVIDIA Nsight Systems) not found on PATH"
    mkdir -p profiles
    launch+=(nsys profile --trace=cuda,nvtx,osrt,cudnn,cublas --force-overwrite=true
             --output="profiles/${SLURM_JOB_NAME:-pyrecover}-${SLURM_JOB_ID:-0}-restart${restart}-rank%q{SLURM_PROCID}")
fi

# With a setup file each task runs `bash -c 'source SETUP && exec PYTHON train.py ...'`: sourced on its own node, then
# `exec` replaces that bash by python: the task's process is train.py, so SLURM's SIGUSR1/SIGTERM reach it and no bash
# in between (which SIGUSR1's default action would kill) decides the task's exit code. A setup that fails ends the
# task with exit 2 (bad input) before python starts.
run=("$PYTHON" "$REPO/train.py" "${train_args[@]}")
[[ $spares -gt 0 ]] && run=("$PYTHON" "$REPO/launcher.py" "${launcher[@]}" "$REPO/train.py" "${train_args[@]}")
if [[ -n $setup ]]; then
    # shellcheck disable=SC2016  # expanded by the task's bash, not here
    run=(bash -c 'source "$0" || { echo "submit-training-simple.sh: error: setup file $0 failed (exit $?) on $(hostname)" >&2; exit 2; }; exec "$@"'
         "$setup" "${run[@]}")
fi

# The dry run, on a login node before sbatch: what the job asks for, then train.py's own checks of its flags with the
# same interpreter (and setup) the job uses -- a typo found now costs seconds, not a queue wait -- then the srun line.
if [[ ${PYRECOVER_DRY_RUN:-0} == 1 ]]; then
    script=$0
    [[ -f $script ]] || script=$REPO/submit-training-simple.sh
    sbatch_option() {  # the value the active #SBATCH lines give --OPTION (the last one), digits only, or nothing
        sed -nE "s/^#SBATCH[[:space:]]+--$1[= ]([0-9]+).*/\1/p" "$script" | tail -n 1
    }
    echo "#SBATCH resources asked for in $script (sbatch command-line options override them):"
    sed -nE 's/^#SBATCH[[:space:]]+/  /p' "$script"
    if [[ ${PYRECOVER_CHECK:-1} != 0 ]]; then
        check=("$PYTHON" "$REPO/train.py" --check)
        # a GPU job checked on a login node without GPUs: check for CUDA (the flags after it may still say --device)
        grep -qE '^#SBATCH[[:space:]]+--(gpus|gres=gpu)' "$script" && check+=(--device cuda)
        per_node=1
        if [[ $distributed == 1 ]]; then  # the ranks the #SBATCH lines ask for (inside an allocation: its own)
            per_node=$(sbatch_option ntasks-per-node)
            per_node=${per_node:-1}
            nodes=$(sbatch_option nodes)
            ranks=${SLURM_NTASKS:-$(sbatch_option ntasks)}
            ranks=${ranks:-$(( ${nodes:-1} * per_node ))}
            check+=(--check-world-size "$ranks")
        fi
        echo "checking the train.py flags here: ${check[*]} ${train_args[*]}"
        LOCAL_WORLD_SIZE=$per_node "${check[@]}" "${train_args[@]}"
        rc=$?
        [[ $rc == 0 ]] || die "\`train.py --check\` failed (exit $rc, see above): fix the train.py flags (after --) or" \
            "the files they name before submitting (PYRECOVER_CHECK=0 skips this check)"
    fi
    printf 'dry run: '; printf '%q ' "${launch[@]}" "${run[@]}"; echo
    exit 0
fi
echo "$(date -u +%FT%TZ) run $((restart + 1)) of job ${SLURM_JOB_ID:-?}${SLURM_ARRAY_TASK_ID:+ (array task $SLURM_ARRAY_TASK_ID)}:" \
     "${launch[*]} ${run[*]}"
# A rank that crashed (a segfault, the OOM killer, an exception) ends the job step, not the allocation: the nodes are
# still the job's, so it runs again here from `latest` -- from each node's local tier if it has one -- instead of
# waiting in the queue. At most INPLACE_RESTARTS times per run of the job. A lost node is SLURM's to handle: srun
# waits for its task until SLURM ends the job (NODE_FAIL) and requeues it.
inplace=0
while true; do
    [[ -n $rc_file ]] && rm -f "$rc_file"
    "${launch[@]}" "${run[@]}"
    rc=$?
    if [[ -n $rc_file && -s $rc_file ]]; then  # node 0's launcher: the ranks' code, whatever a lost node did to srun's
        launcher_rc=$(<"$rc_file")
        [[ $launcher_rc != "$rc" ]] && echo "srun exit code $rc; the launchers' (the ranks') exit code $launcher_rc"
        rc=$launcher_rc
    fi
    echo "$(date -u +%FT%TZ) train.py exit code $rc"
    case $rc in 0 | 2 | 3 | 4 | 5 | 6) break ;; esac
    if [[ $inplace -ge $INPLACE_RESTARTS ]]; then
        [[ $INPLACE_RESTARTS -gt 0 ]] && echo "not restarting in this allocation: $inplace restarts reached PYRECOVER_INPLACE_RESTARTS=$INPLACE_RESTARTS"
        break
    fi
    inplace=$((inplace + 1))
    [[ $inplace == 1 ]] && run+=(--resume-from-checkpoint latest)  # the last occurrence wins
    echo "$(date -u +%FT%TZ) a rank failed: restarting in this allocation from latest ($inplace of $INPLACE_RESTARTS):" \
         "${launch[*]} ${run[*]}"
done

case $rc in
    0) echo "training finished"; exit 0 ;;
    2) echo "bad input (see the error above); nothing to resume"; exit 2 ;;
    3)
        # train.py requeued the job itself (signal/walltime stop): SLURM is about to end this script. If the job was not
        # requeued (--jit-checkpoint after a rank failure), requeue it here so the rerun resumes from latest.
        restarts_now=$(scontrol -o show job "${SLURM_JOB_ID:-0}" 2>/dev/null | grep -o 'Restarts=[0-9]*' | cut -d= -f2)
        if [[ -n $restarts_now && $restarts_now -gt $restart ]]; then
            echo "stopped with the state saved; job already requeued (restart $restarts_now)"
            exit 0
        fi
        if [[ $restart -ge $MAX_RESTARTS ]]; then
            echo "stopped with the state saved; not requeueing: $restart restarts reached MAX_RESTARTS=$MAX_RESTARTS"
            exit 0
        fi
        target=${SLURM_JOB_ID:-}
        [[ -n ${SLURM_ARRAY_JOB_ID:-} && -n ${SLURM_ARRAY_TASK_ID:-} ]] && target=${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}
        if scontrol requeue "$target"; then
            echo "stopped with the state saved; requeued job $target"
            exit 0
        fi
        echo "stopped with the state saved, but \`scontrol requeue $target\` failed: resubmit with --continue" >&2
        exit 5
        ;;
    4) echo "stopped with the state saved, not requeued: resubmit with --continue (or the next array task resumes)"; exit 0 ;;
    5) echo "stopped with the state saved, but the requeue failed (see above): resubmit with --continue" >&2; exit 5 ;;
    6) echo "fenced: a newer incarnation of this run owns the checkpoint directory; this one changed nothing" >&2; exit 6 ;;
    *) echo "training failed (exit $rc); the newest committed checkpoint is intact: fix the cause, resubmit with --continue" >&2
       exit "$rc" ;;
esac
