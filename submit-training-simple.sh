#!/bin/bash
# PyRecover on SLURM: train, save before the time limit, requeue, resume -- without losing a step.
#
#   sbatch submit-training-simple.sh [--distributed] [--exp_name=NAME] [--continue] [--use_torch_distributed_ckpt]
#          [--timeaware-checkpointing] [--use_flash_attention] [--log-loss-to-csv] [--fused-optimizer] [--compile]
#          [--sequence-length=N] [--profile-nsys] [-- any train.py flags]
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
#   1 failed                        -> exit 1
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
PYTHON=${PYTHON:-python}

set -uo pipefail

die() { echo "submit-training-simple.sh: error: $*" >&2; exit 2; }

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

distributed=0 resume=0 nsys=0
train_args=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --distributed) distributed=1 ;;
        --exp_name=* | --exp-name=*) train_args+=(--experiment_name "${1#*=}") ;;
        --continue) resume=1 ;;
        --use_torch_distributed_ckpt | --use-torch-distributed-ckpt) train_args+=(--use-torch-distributed-ckpt) ;;
        --timeaware-checkpointing | --timeaware_checkpointing) train_args+=(--timeaware-checkpointing) ;;
        --use_flash_attention | --use-flash-attention) train_args+=(--use_flash_attention) ;;
        --log-loss-to-csv | --log_loss_to_csv) train_args+=(--log-loss-to-csv) ;;
        --fused-optimizer | --fused_optimizer) train_args+=(--fused-optimizer) ;;
        --compile) train_args+=(--compile) ;;
        --sequence-length=* | --sequence_length=*) train_args+=(--sequence-length "${1#*=}") ;;
        --profile-nsys | --profile_nsys) nsys=1 ;;
        --) shift; train_args+=("$@"); break ;;
        -h | --help) sed -n '2,40p' "$REPO/submit-training-simple.sh" 2>/dev/null || sed -n '2,40p' "$0"; exit 0 ;;
        *) die "unknown option '$1' (train.py flags go after --, e.g. -- --training-steps 1000)" ;;
    esac
    shift
done

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

launch=(srun --kill-on-bad-exit=0)
if [[ $distributed == 1 ]]; then
    # One rank per task (= per GPU); distributed.py reads SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID. The master is the
    # first node of the allocation, the port derived from the job id (two jobs sharing a node do not collide).
    if [[ -z ${MASTER_ADDR:-} ]]; then
        MASTER_ADDR=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" 2>/dev/null | head -n 1)
        export MASTER_ADDR=${MASTER_ADDR:-localhost}
    fi
    export MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
    train_args=(--distributed "${train_args[@]}")
    echo "job ${SLURM_JOB_ID:-?}: ${SLURM_NTASKS:-?} ranks on ${SLURM_JOB_NUM_NODES:-?} node(s), master $MASTER_ADDR:$MASTER_PORT"
else
    launch+=(--ntasks=1 --nodes=1)  # one process; still under srun so that --signal (without B:) reaches it
fi
if [[ $nsys == 1 ]]; then
    command -v nsys >/dev/null || die "--profile-nsys: nsys (NVIDIA Nsight Systems) not found on PATH"
    mkdir -p profiles
    launch+=(nsys profile --trace=cuda,nvtx,osrt,cudnn,cublas --force-overwrite=true
             --output="profiles/${SLURM_JOB_NAME:-pyrecover}-${SLURM_JOB_ID:-0}-restart${restart}-rank%q{SLURM_PROCID}")
fi

echo "$(date -u +%FT%TZ) run $((restart + 1)) of job ${SLURM_JOB_ID:-?}${SLURM_ARRAY_TASK_ID:+ (array task $SLURM_ARRAY_TASK_ID)}:" \
     "${launch[*]} $PYTHON $REPO/train.py ${train_args[*]}"
"${launch[@]}" "$PYTHON" "$REPO/train.py" "${train_args[@]}"
rc=$?
echo "$(date -u +%FT%TZ) train.py exit code $rc"

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
