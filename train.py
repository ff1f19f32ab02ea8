"""PyRecover: pre-train a Llama-style transformer that never loses work.

    python train.py --model small                                   # one process (CPU or one GPU)
    torchrun --nproc_per_node=4 train.py --distributed --model 1b   # DDP, one rank per GPU
    sbatch submit-training-simple.sh --distributed                  # SLURM, see README

Reads top to bottom: flags -> setup (validated before any training time is spent) -> resume -> loop -> exit.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import random
import signal
import sys
import time
import uuid
from pathlib import Path

if __name__ == "__main__":
    # SLURM's warning signal can come while the imports below run (seconds; tens on a busy node), and its default
    # action kills the process: hold USR1/USR2 pending until the stop policy's handlers exist (SignalWatcher.install
    # releases them, and a held signal is delivered to the handler then).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})
    # Ctrl-C during the imports: nothing to save yet -- one line and 130 as SignalWatcher does later, no traceback.
    signal.signal(signal.SIGINT, lambda *_: (os.write(2, b"interrupted (SIGINT) before training started: nothing to "
                                                         b"save yet\n"), os._exit(128 + signal.SIGINT)))
    # One write() per line: ranks share the job's pipe, and under PYTHONUNBUFFERED (set by the SLURM script) print()
    # writes the text and its newline separately, so two ranks' lines could merge into one.
    for _stream in (sys.stdout, sys.stderr):
        _stream.reconfigure(line_buffering=True, write_through=False)

_T_IMPORTS = time.monotonic()  # the heavy imports start here (recovery_line reports how long a restart took)
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import distributed
from checkpoint import (CheckpointError, CheckpointManager, CheckpointState, ModelState, OptimizerState, RankInfo, RNGState, RunInfo,
                        TrainState, make_backend)
from checkpoint import layout, storage
from checkpoint.fsio import fsync_dir
from checkpoint import jit as checkpoint_jit
from checkpoint import lease as run_lease
from checkpoint import policy as stop_policy
from checkpoint.walltime import parse_walltime
from dataset import DEFAULT_TOKENIZER, DataError, TrainLoader, load_token_windows, load_tokenizer
from model import PRESETS, MemoryEstimate, Transformer, estimate_peak_memory, flash_attention_problem, get_config

_T_IMPORTED = time.monotonic()

__version__ = "0.1.0"

# Exit codes (documented in the README; submit-training-simple.sh acts on them).
EXIT_FINISHED = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
# 3-5: stopped early with the state saved (a checkpoint committed); resuming from `latest` loses nothing.
EXIT_REQUEUE = 3  # to be continued: requeued by train.py (SLURM signal/walltime stop), or --jit-checkpoint after a
#                   rank failed (then the launcher reruns/requeues)
EXIT_STOPPED = 4  # not requeued: SIGTERM, Ctrl-C (SIGINT; a second one exits at once with 130), --no-requeue, job
#                   array task, --max-restarts reached, or not under SLURM
EXIT_REQUEUE_FAILED = 5  # a requeue was due but failed (e.g. scontrol missing): resubmit to continue
EXIT_FENCED = 6  # a newer incarnation took the run directory over (checkpoint/lease.py): this one changed nothing


class BadInput(Exception):
    """A user mistake detected before training: one line, exit code 2."""


def _signal_flag(text: str) -> str:
    try:
        stop_policy.parse_signal(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _walltime_flag(text: str) -> float:
    try:
        return parse_walltime(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# ----------------------------------------------------------------------------------------------------------------------
# Flags
# ----------------------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Pre-train a Llama-style transformer with checkpointing that survives walltime, preemption and "
        "failures.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )

    g = p

    def flag(name: str, *more: str, **kw):
        """Accept both --dash-name and --underscore_name (the reference scripts mix them)."""
        names = set()
        for n in (name, *more):
            body = n[2:]
            names |= {n, "--" + body.replace("_", "-"), "--" + body.replace("-", "_")}
        kw.setdefault("dest", name[2:].replace("-", "_"))
        return g.add_argument(*sorted(names, key=lambda n: ("_" in n, n)), **kw)

    g = p.add_argument_group("data")
    flag("--dataset", default="data/train_data.parquet", help="parquet file with a `text` column")
    flag("--tokenizer-name-or-path", default=DEFAULT_TOKENIZER,
         help="mistral-sp-32k, mistral-tekken, cl100k_base, o200k_base, or a local tokenizer.json / HF tokenizer dir")
    flag("--sequence-length", type=int, default=128, help="tokens per training sample")
    flag("--batch-size", type=int, default=8, help="samples per step PER RANK (global batch = batch-size x ranks)")
    flag("--seed", type=int, default=42, help="seeds model init, data order and every RNG")

    g = p.add_argument_group("model and optimisation")
    flag("--model", default="small", choices=sorted(PRESETS), help="model preset")
    flag("--learning-rate", type=float, default=1e-3, help="peak learning rate (AdamW)")
    flag("--lr-warmup-steps", type=int, default=20, help="linear warm-up steps, then cosine decay to 10%%")
    flag("--training-steps", type=int, default=300, help="total optimizer steps")
    flag("--grad-max-norm", type=float, default=1.0, help="clip the global gradient norm to this (0 = off)")
    flag("--model-dtype", default="fp32", choices=sorted(distributed.DTYPES),
         help="bf16/fp16: autocast with fp32 weights; fp32/fp64: everything in that dtype")
    flag("--fused-optimizer", action="store_true", help="use the fused AdamW kernel")
    flag("--compile", action="store_true", help="torch.compile the model")
    flag("--use_flash_attention", action="store_true", help="flash-attn kernels (CUDA + flash-attn only; no fallback)")

    g = p.add_argument_group("distributed")
    flag("--pg-timeout-seconds", type=float, default=None,
         help="timeout of collectives in the training loop (setup keeps 600 s): how long a hung rank goes unnoticed; "
              "must exceed the longest blocking save. Default: 600")
    flag("--distributed", action="store_true", help="data-parallel over torchrun or srun ranks (NCCL on GPU, gloo on CPU)")
    flag("--parallel", default="ddp", choices=["ddp", "fsdp"],
         help="with --distributed: ddp (full replicas) or fsdp (FSDP2 fully_shard per transformer block, then the root: "
              "parameters, gradients and optimizer state sharded over ranks; checkpoints with --checkpoint-backend dcp)")

    g = p.add_argument_group("checkpointing")
    flag("--checkpoint-dir", default="checkpoints", help="checkpoints go to <checkpoint-dir>/<experiment_name>/step-N/")
    flag("--experiment_name", "--exp_name", default="default", help="run name (sub-folder of --checkpoint-dir)")
    flag("--checkpoint-frequency", type=int, default=100, help="save every N steps (0 = only at the end)")
    flag("--resume-from-checkpoint", default=None, metavar="latest|STEP|PATH",
         help="resume: `latest` (newest verified checkpoint; starts fresh if there is none), a step, or a path")
    flag("--checkpoint-backend", default="vanilla", choices=["vanilla", "concurrent", "dcp"],
         help="how checkpoint bytes are written (concurrent: snapshot to host buffers, persist in the background)")
    flag("--max-async", type=int, default=2, metavar="N",
         help="concurrent backend: checkpoints persisting at once (= host buffer sets of the state's size)")
    flag("--use-torch-distributed-ckpt", action="store_true",
         help="alias of --checkpoint-backend dcp: torch.distributed.checkpoint, every rank writes its own shard in "
              "parallel; loads at any world size; the only backend for --parallel fsdp and s3:// checkpoint dirs")
    flag("--async-checkpoint", nargs="?", const="thread", default=False, choices=["thread", "process"],
         help="dcp backend: save in the background (dcp.async_save on its own gloo group); training waits only for "
              "the state copy, right before the next optimizer step; one save in flight. `process` (`thread` when "
              "given alone): serialize and write in DCP's background save process instead of a thread of the "
              "training process (no GIL contention; the process starts at the first save)")
    flag("--max-kept-checkpoints", type=int, default=3, help="keep the newest K committed checkpoints (0 = keep all)")
    flag("--keep-every", type=int, default=0, help="also keep every checkpoint whose step is a multiple of N")
    flag("--timeaware-checkpointing", action="store_true", help="save and stop before the SLURM walltime runs out")
    flag("--force-takeover", action="store_true",
         help="take the run directory over even if another live run holds it (one writer per run directory; the "
              "other run is fenced: it can no longer commit or delete anything, and stops)")
    flag("--on-save-error", default="stop", choices=["stop", "continue"],
         help="a save that fails (e.g. disk full; the previous checkpoint stays intact and `latest`): stop = exit 1 at "
              "once; continue = warn, keep training, retry at the next interval (exit 1 if the final save fails)")
    flag("--jit-checkpoint", action="store_true",
         help="just-in-time checkpoint: if a rank fails mid-step, a surviving rank saves the last completed step and "
              "exits with code 3 (requeue); a rerun replays at most one step (see checkpoint/jit.py)")

    g = p.add_argument_group("stopping in time (SLURM): signals, walltime, requeue -- see checkpoint/policy.py")
    flag("--signal", type=_signal_flag, default="SIGUSR1",
         help="signal meaning 'save at the next step boundary, stop, requeue' (SLURM's --signal warning; `none` = off); "
              "SIGTERM is always 'save and stop' (no requeue)")
    flag("--walltime", type=_walltime_flag, default=None, metavar="[D-]HH:MM:SS",
         help="with --timeaware-checkpointing: a deadline counted from the start of train.py, for runs without a "
              "SLURM time limit (under SLURM the job's end time is read from squeue; the earlier one wins)")
    flag("--walltime-margin-seconds", type=float, default=60.0,
         help="--timeaware-checkpointing stops when time left < longest save + 3 x step time + this margin")
    flag("--checkpoint-interval-minutes", type=float, default=0.0,
         help="also save every N minutes of wall-clock time (0 = off; 10-15 is the usual HPC advice)")
    flag("--requeue", action=argparse.BooleanOptionalAction, default=None,
         help="after a signal/walltime stop, `scontrol requeue` the job once the checkpoint has committed "
              "(default: on in a SLURM job, off in a job array task, whose next task resumes instead)")
    flag("--max-restarts", type=int, default=100, help="do not requeue once SLURM_RESTART_COUNT reaches this")

    g = p.add_argument_group("logging")
    flag("--logging-frequency", type=int, default=10, help="progress-bar/log update every N steps")
    flag("--log-loss-to-csv", nargs="?", const="auto", default=None, metavar="PATH",
         help="one row per step; default path <checkpoint-dir>/<experiment_name>/loss.csv; appends on resume")
    flag("--profile", action="store_true", help="record a torch.profiler trace between the profile steps")
    flag("--profile-step-start", type=int, default=10, help="first profiled step")
    flag("--profile-step-end", type=int, default=12, help="last profiled step")
    return p


# ----------------------------------------------------------------------------------------------------------------------
# Setup helpers
# ----------------------------------------------------------------------------------------------------------------------


def say(line: str) -> None:
    """An error or warning line from any rank, to stderr."""
    print(line, file=sys.stderr, flush=True)


def log(msg: str) -> None:
    """A progress line from any rank, to stdout."""
    print(msg, flush=True)


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc), so the interpreter's start-up before our first line counts."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return float(Path("/proc/uptime").read_text().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _T_IMPORTS


def recovery_line(t_loop: float, load_s: float) -> str:
    """What a restart cost this rank, from its process start to the end of its first step after the resume."""
    now = time.monotonic()
    total = process_age_s()
    return (f"recovery: first step after resume {total:.2f}s after process start (python start-up "
            f"{max(0.0, total - (now - _T_IMPORTS)):.2f}s, imports {_T_IMPORTED - _T_IMPORTS:.2f}s, setup "
            f"{t_loop - _T_IMPORTED - load_s:.2f}s, checkpoint load {load_s:.2f}s, first step {now - t_loop:.2f}s)")


def log0(env: distributed.DistEnv, msg: str) -> None:
    if env.is_main:
        log(msg)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def lr_lambda(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


class LossCSV:
    """One row per step. At start the file is rewritten with the rows up to the step the run continues from (0 for a
    fresh start; later rows belong to work that was lost and will be redone), so it ends up with every step exactly
    once. The rewrite is a new file renamed over the old one, never a truncation: a fenced stale incarnation that still
    appends to the old file writes into an unlinked inode, not into this run's log."""

    FIELDS = ["step", "loss", "lr", "tokens_seen", "wall_time", "restart"]

    def __init__(self, path: Path, resumed_step: int | None):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = []
        if path.exists():
            with open(path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= (resumed_step or 0)]
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, self.FIELDS)
            w.writeheader()
            w.writerows(rows)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
        self.file = open(path, "a", newline="")
        self.writer = csv.DictWriter(self.file, self.FIELDS)

    def row(self, **values) -> None:
        self.writer.writerow(values)
        self.file.flush()

    def sync(self) -> None:
        """Make rows durable up to a checkpoint: a resume must never find fewer rows than the step it resumes."""
        os.fsync(self.file.fileno())
        fsync_dir(self.path.parent)


def device_peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of the GPU, for MFU. None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in (("H100", 989e12), ("GH200", 989e12), ("H200", 989e12), ("A100", 312e12), ("L40", 181e12),
                       ("A10", 125e12), ("V100", 125e12)):
        if key in name:
            return flops
    return None


def validate(args: argparse.Namespace, env: distributed.DistEnv):
    """Everything that can be wrong with the user's input, checked before any collective or training time: numbers
    first (instant), then the memory the configuration needs (as soon as the tokenizer gives the vocabulary), then
    the data (tokenizing may take minutes). Returns (tokenizer, windows, config)."""
    check_numeric_flags(args)
    if args.use_flash_attention:
        problem = flash_attention_problem(env.device)
        if problem:
            raise BadInput(problem)
    tokenizer = load_tokenizer(args.tokenizer_name_or_path)
    config = get_config(args.model, vocab_size=tokenizer.vocab_size, max_seq_len=args.sequence_length)
    check_memory(args, env, config)
    windows = load_token_windows(args.dataset, tokenizer, args.sequence_length)
    if len(windows) < args.batch_size * env.world_size:
        raise BadInput(
            f"--sequence-length {args.sequence_length} leaves {len(windows)} samples in {args.dataset}, fewer than one "
            f"global batch ({args.batch_size} x {env.world_size} ranks); use a shorter sequence or a larger dataset"
        )
    return tokenizer, windows, config


# Every numeric flag: (dest, lowest allowed value, whether that value itself is allowed). Floats must also be finite.
NUMERIC_FLAGS: tuple[tuple[str, float, bool], ...] = (
    ("sequence_length", 1, True), ("batch_size", 1, True), ("seed", 0, True), ("learning_rate", 0, False),
    ("lr_warmup_steps", 0, True), ("training_steps", 1, True), ("grad_max_norm", 0, True),
    ("pg_timeout_seconds", 0, False), ("checkpoint_frequency", 0, True), ("max_async", 1, True),
    ("max_kept_checkpoints", 0, True), ("keep_every", 0, True), ("walltime_margin_seconds", 0, True),
    ("checkpoint_interval_minutes", 0, True), ("max_restarts", 0, True), ("logging_frequency", 1, True),
    ("profile_step_start", 1, True), ("profile_step_end", 1, True),
)


def check_numeric_flags(args: argparse.Namespace) -> None:
    """Refuse a non-finite or out-of-range number in one line, before anything is loaded."""
    for dest, lowest, inclusive in NUMERIC_FLAGS:
        value = getattr(args, dest, None)
        if value is None:  # optional flag not given (e.g. --pg-timeout-seconds)
            continue
        flag = "--" + dest.replace("_", "-")
        need = f"{'>=' if inclusive else '>'} {lowest:g}"
        if isinstance(value, float) and not math.isfinite(value):
            raise BadInput(f"{flag} {value} is not a finite number; give a number {need}")
        if value < lowest or (value == lowest and not inclusive):
            raise BadInput(f"{flag} {value:g} is out of range; give a number {need}")
    if args.seed >= 2**63:
        raise BadInput(f"--seed {args.seed} is too large; give a number below 2**63")
    if args.profile and args.profile_step_end < args.profile_step_start:
        raise BadInput(f"--profile-step-end {args.profile_step_end} is before --profile-step-start "
                       f"{args.profile_step_start}; give an end step >= the start step")


def memory_estimate(args: argparse.Namespace, env: distributed.DistEnv, config, batch_size: int | None = None,
                    seq_len: int | None = None) -> MemoryEstimate:
    """model.estimate_peak_memory for this run's flags (or another batch size / sequence length)."""
    batch_size, seq_len = batch_size or args.batch_size, seq_len or args.sequence_length
    copies = 0  # training on CPU: asynchronous checkpointing's host copies of the state share the same RAM
    if env.device.type == "cpu" and args.checkpoint_backend == "concurrent":
        copies = args.max_async
    elif env.device.type == "cpu" and args.checkpoint_backend == "dcp" and args.async_checkpoint:
        copies = 1
    return estimate_peak_memory(dataclasses.replace(config, max_seq_len=seq_len), batch_size, seq_len,
                                args.model_dtype, env.world_size, args.parallel if env.distributed else "single",
                                env.device.type, "fused" if args.fused_optimizer else "default", copies)


def check_memory(args: argparse.Namespace, env: distributed.DistEnv, config) -> MemoryEstimate:
    """Refuse, in one line, a configuration whose estimated peak memory exceeds what the device has."""
    estimate = memory_estimate(args, env, config)
    available, where = distributed.device_memory(env)
    if available is not None and estimate.total > available:
        def fits(batch: int, seq: int) -> bool:
            return memory_estimate(args, env, config, batch, seq).total <= available

        batch, low, high = None, 1, args.batch_size - 1  # the largest batch that fits (memory grows with the batch)
        while low <= high:
            mid = (low + high) // 2
            if fits(mid, args.sequence_length):
                batch, low = mid, mid + 1
            else:
                high = mid - 1
        seq = args.sequence_length
        while batch is None and seq > 1 and not fits(1, seq):
            seq //= 2
        hint = (f" (--batch-size {batch} fits)" if batch else
                f" (--batch-size 1 with --sequence-length {seq} fits)" if seq > 1 and fits(1, seq) else
                " (even --batch-size 1 --sequence-length 1 does not fit: use a smaller --model)")
        raise BadInput(
            f"--model {args.model} with --batch-size {args.batch_size} x --sequence-length {args.sequence_length} "
            f"({args.model_dtype}) needs an estimated {estimate.describe()} per rank, but {where} "
            f"{available / 2**20:,.1f} MiB; use a smaller --batch-size, --sequence-length or --model{hint}"
            + (" or more ranks with --parallel fsdp" if env.device.type == "cuda" else "")
        )
    return estimate


def check_checkpoint_flags(args: argparse.Namespace) -> None:
    """Combinations only the dcp backend can do, refused with one line before any training time is spent."""
    how = "--checkpoint-backend dcp (or --use-torch-distributed-ckpt)"
    if args.distributed and args.parallel == "fsdp" and args.checkpoint_backend != "dcp":
        raise BadInput(f"--parallel fsdp shards the model over ranks; save it with {how}: the "
                       f"{args.checkpoint_backend} backend writes one full copy from rank 0 (convert a DCP checkpoint "
                       "afterwards with `python -m checkpoint convert SRC DST --to vanilla`)")
    if storage.is_remote(args.checkpoint_dir) and args.checkpoint_backend != "dcp":
        raise BadInput(f"--checkpoint-dir {args.checkpoint_dir} is object storage: it needs {how}")
    if storage.is_remote(args.checkpoint_dir) and getattr(args, "jit_checkpoint", False):
        raise BadInput("--jit-checkpoint writes to a local --checkpoint-dir; it does not support s3://")
    if args.async_checkpoint and args.checkpoint_backend != "dcp":
        raise BadInput(f"--async-checkpoint is for {how}; the concurrent backend is always asynchronous")


# Flags that may differ from the checkpoint's on resume (README "Changing flags on resume"). APPLIED: they take effect
# from the resumed step on, each named in one line. REFUSED (with why): the checkpoint's weights, data position and RNG
# were made with the saved value, so a new one could not apply -- exit 2 instead of a half-applied run.
RESUME_APPLIED = ("learning_rate", "lr_warmup_steps", "training_steps", "grad_max_norm", "fused_optimizer", "compile",
                  "batch_size")
RESUME_REFUSED = (("model", "the weights are that model's"),
                  ("tokenizer_name_or_path", "the embeddings and the data position are that tokenizer's"),
                  ("sequence_length", "the data position counts windows of that length"),
                  ("seed", "the data order and every RNG continue from the checkpoint"),
                  ("model_dtype", "the weights and optimizer state were trained in it"))


def apply_resume_flags(args: argparse.Namespace, run_info: RunInfo, step: int | None,
                       optimizer: torch.optim.Optimizer, scheduler) -> list[str]:
    """Compare the flags with the ones the loaded checkpoint was saved with (``run_info.saved``, the same on every rank):
    raise BadInput for a refused difference, apply the others and return one 'resume: applying' line each. Nothing
    differs: nothing is touched (the resumed run stays bitwise an uninterrupted one). ``step`` None: a load that failed
    part-way, only the refusals are checked (run_info loads first, so another --model is named, not its tensor shapes)."""
    saved = getattr(run_info, "saved", {}).get("config", {})
    shown = lambda v: ("on" if v else "off") if isinstance(v, bool) else v  # noqa: E731
    flag = lambda k: "--" + k.replace("_", "-")  # noqa: E731
    for key, why in RESUME_REFUSED:
        if key in saved and saved[key] != getattr(args, key):
            raise BadInput(f"{flag(key)} {shown(getattr(args, key))} differs from the checkpoint's {shown(saved[key])} "
                           f"and cannot change on resume ({why}); resume with {flag(key)} {shown(saved[key])}, or "
                           f"start a new --experiment_name")
    if step is None:
        return []
    if args.training_steps < step:
        raise BadInput(f"checkpoint is at step {step} but --training-steps {args.training_steps} ends before it; pass "
                       f"--training-steps {step} or more, or start a new --experiment_name")
    changed = [k for k in RESUME_APPLIED if k in saved and saved[k] != getattr(args, k)]
    if {"learning_rate", "lr_warmup_steps", "training_steps"} & set(changed):
        # LambdaLR's state restored the old base lr and the optimizer the old step's lr; the lambda is the current
        # flags'. Set both so step s runs at learning_rate * lambda(s), as a fresh run with these flags would.
        scheduler.base_lrs = [args.learning_rate] * len(optimizer.param_groups)
        for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
            group["initial_lr"] = args.learning_rate
            group["lr"] = args.learning_rate * factor(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports
    if "fused_optimizer" in changed:  # the loaded param groups carry the saved run's choice
        for group in optimizer.param_groups:
            group["fused"] = True if args.fused_optimizer else None
    return [f"resume: applying {flag(k)} {shown(getattr(args, k))} (checkpoint had {shown(saved[k])})" for k in changed]


def shard_fsdp(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2: every transformer block is one all-gather / reduce-scatter unit, then the root (embeddings, norm, output)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return model


def on_save_error(args: argparse.Namespace, error: CheckpointError, step: int) -> int:
    """--on-save-error: `stop` re-raises (one line, exit 1); `continue` warns and returns the step it happened at."""
    if args.on_save_error == "stop":
        raise error
    say(f"warning: {error}; training continues (--on-save-error continue), the next save retries")
    return step


def agree_on_failure(env: distributed.DistEnv, failed: bool) -> bool:
    """All ranks learn whether any rank failed setup, so none is left waiting in a collective."""
    return distributed.all_reduce_max(1.0 if failed else 0.0, env) > 0


# ----------------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    wall_start = time.time()  # --walltime counts from here
    signals = stop_policy.install_signal_handlers(args.signal)  # first: SLURM's warning must not kill us during setup
    if args.use_torch_distributed_ckpt:
        args.checkpoint_backend = "dcp"
    t_start = time.perf_counter()

    env = distributed.init(args.distributed)
    # Setup that can fail on bad input runs on every rank without collectives; then ranks agree.
    error, lease = None, None
    try:
        tokenizer, windows, config = validate(args, env)
        check_checkpoint_flags(args)
        run_root = storage.as_path(args.checkpoint_dir) / args.experiment_name  # a local folder or s3://bucket/prefix
        if env.is_main:
            layout.ensure_writable(run_root)  # fail now, not at the first save hours from now
            if not storage.is_remote(run_root):  # one writer per run directory (checkpoint/lease.py)
                lease = run_lease.acquire(run_root, force=args.force_takeover, log=log)
        rank_info = RankInfo(env.rank, env.world_size, env.local_rank)
        backend_options = ({"max_async": args.max_async, "log": lambda m: log0(env, m)}
                           if args.checkpoint_backend == "concurrent" else {})
        if args.checkpoint_backend == "dcp":
            backend_options = {"async_save": args.async_checkpoint}
        backend = make_backend(args.checkpoint_backend, rank_info, **backend_options)
    except (BadInput, DataError, CheckpointError, ValueError, RuntimeError) as e:
        error = e
    if agree_on_failure(env, error is not None):
        if env.is_main and error is None and lease is not None:
            lease.release()
        if error is not None:
            say(f"error: {error}" if env.is_main else f"error (rank {env.rank}): {error}")
        return EXIT_BAD_INPUT

    # --- model, optimizer, schedule, data ------------------------------------------------------------------------
    mem_estimate = memory_estimate(args, env, config)  # checked against the device's memory in validate()
    log0(env, f"memory estimate: {mem_estimate.describe()} per rank on {env.device.type}")
    # Every save takes its state dicts through DCP's state_dict helpers: import them before the memory baseline, so
    # the module memory they bring is not counted as training memory (they are not needed before the first step).
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    peak_memory = distributed.PeakMemory(env)  # baseline: after imports and data loading
    seed_everything(args.seed)  # identical init on every rank
    model = Transformer(config, attention="flash" if args.use_flash_attention else "sdpa")
    model = model.to(device=env.device, dtype=distributed.param_dtype(args.model_dtype))
    if env.distributed and args.parallel == "fsdp":
        model = shard_fsdp(model)
    elif env.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)
    if args.compile:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=True if args.fused_optimizer else None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.lr_warmup_steps, args.training_steps))
    scaler = torch.amp.GradScaler(env.device.type) if args.model_dtype == "fp16" else None
    loader = TrainLoader(windows, args.batch_size, env.rank, env.world_size, args.seed)
    seed_everything(args.seed + env.rank)  # per-rank streams from here on (restored from the checkpoint on resume)

    train = TrainState()
    run_info = RunInfo(config=vars(args) | {"model_config": vars(config)},
                       versions={"torch": str(torch.__version__), "pyrecover": __version__}, world_size=env.world_size)
    if args.checkpoint_backend == "dcp":  # sharded state dicts (DTensors under FSDP): every rank saves its own shard
        from checkpoint.backends.dcp import DCPModelState, DCPOptimizerState  # DCP costs ~0.6 s to import: only here

        model_state, optim_state = DCPModelState(model), DCPOptimizerState(model, optimizer)
    else:  # full state dicts, written once by rank 0
        model_state, optim_state = ModelState(model), OptimizerState(model, optimizer)
    # run_info first: a load that fails on another --model/tokenizer/sequence length is explained by the saved flags
    state = CheckpointState(run_info=run_info, model=model_state, optimizer=optim_state, lr_scheduler=scheduler,
                            dataloader=loader, train_state=train, rng=RNGState())
    if scaler is not None:
        state["grad_scaler"] = scaler

    # One id per incarnation (part records, staging folder) and the lease's generation (fencing), the same on every rank.
    run_id = [uuid.uuid4().hex[:12], lease.generation if lease else 0] if env.is_main else [None, None]
    if env.distributed:
        dist.broadcast_object_list(run_id, src=0)
    if lease is None and run_id[1]:
        lease = run_lease.Lease(run_root, run_id[1])
    if lease is not None and env.is_main:
        lease.start_heartbeat()
    manager = CheckpointManager(run_root, backend, rank_info, run_id=run_id[0], keep=args.max_kept_checkpoints,
                                keep_every=args.keep_every, lease=lease, log=lambda m: log0(env, m))

    # --- resume --------------------------------------------------------------------------------------------------
    # Crashed incarnations' leftovers go, `latest` (or the given step) is loaded, and newer checkpoints of a line the
    # run no longer follows are moved aside, so a later `latest` cannot jump back to them.
    applied: list[str] = []  # flags that differ from the checkpoint's and take effect ('resume: applying ...')

    def reconcile(step: int | None) -> None:  # right after the load, before begin() moves anything aside
        applied.extend(apply_resume_flags(args, run_info, step, optimizer, scheduler))

    try:
        try:
            resumed_step = manager.begin(args.resume_from_checkpoint, state, keep_files=("loss.csv",),
                                         after_load=reconcile)
        except (CheckpointError, DataError) as e:  # DataError: e.g. resharded to a global batch it does not fit
            reconcile(None)  # run_info loads first: a refused flag (another --model, ...) explains the failure best
            raise BadInput(str(e)) from None
    except BadInput as e:  # every rank has the same flags and run_info.saved: all refuse here, none waits in a collective
        if env.is_main:
            say(f"error: {e}")
            if lease is not None:
                lease.release()  # nothing was changed: the next start need not wait for anything
        return EXIT_BAD_INPUT
    if args.resume_from_checkpoint:
        if resumed_step is None:
            log0(env, f"no checkpoint found in {run_root}; starting fresh from step 0")
        else:
            train.restarts += 1
            for line in applied:
                log0(env, line)
            for line in run_info.differences(()):  # world size, torch version
                log0(env, f"warning: resumed run differs from the checkpoint: {line}")
    # Loss CSV and profiler traces stay on local disk: next to the checkpoints, or ./logs/<experiment> for s3://.
    log_dir = Path("logs") / args.experiment_name if storage.is_remote(run_root) else run_root
    csv_path = None
    if args.log_loss_to_csv:
        csv_path = log_dir / "loss.csv" if args.log_loss_to_csv == "auto" else Path(args.log_loss_to_csv)
    loss_csv = LossCSV(csv_path, resumed_step) if (csv_path and env.is_main) else None

    policy = stop_policy.from_args(args, rank=env.rank, agree=lambda v: distributed.all_reduce_max(v, env),
                                   signals=signals, log=log, save_history=manager.history,
                                   start=wall_start, fenced=(lambda: manager.fenced) if env.is_main else None)
    autocast = distributed.autocast(env, args.model_dtype)
    params = [p for p in model.parameters()]
    tokens_per_step = args.batch_size * args.sequence_length * env.world_size
    flops_per_token = ModelState(model).model.flops_per_token(args.sequence_length)
    peak = device_peak_flops(env.device)
    log0(env, f"model {args.model}: {ModelState(model).model.num_params() / 1e6:.1f}M params | {env.world_size} rank(s) "
              f"on {env.device.type} ({env.backend or 'single process'}) | {len(windows)} samples of "
              f"{args.sequence_length} tokens | tokenizer {tokenizer.name} | global batch {tokens_per_step} tokens")

    progress = None
    if env.is_main:
        from tqdm import tqdm

        progress = tqdm(total=args.training_steps, initial=train.step, desc="train", dynamic_ncols=True,
                        disable=not sys.stderr.isatty() and os.environ.get("PYRECOVER_PROGRESS") != "1")
    profiler = None
    if args.profile:
        profiler = torch.profiler.profile(schedule=torch.profiler.schedule(
            wait=max(0, args.profile_step_start - train.step - 1), warmup=1,
            active=max(1, args.profile_step_end - args.profile_step_start + 1), repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(log_dir / "profile")))
        profiler.start()

    jit = checkpoint_jit.setup(args.jit_checkpoint, root=log_dir,  # = run_root; local ./logs/<exp> for s3 (jit refused)
                               state=state, rank=rank_info, run_id=run_id[0],
                               model=model, current_step=lambda: train.step,
                               reseed=lambda r: seed_everything(args.seed + r), log=log,
                               csv_path=csv_path, guard=lease.check if lease is not None else None)
    if env.distributed and args.pg_timeout_seconds:
        distributed.set_timeout(args.pg_timeout_seconds)
    save_failed_at, saved_at = None, None  # --on-save-error continue: the final checkpoint must still exist
    policy.start()  # from here on SIGTERM / --signal mean "save at the next step boundary and stop"

    # --- the loop ------------------------------------------------------------------------------------------------
    model.train()
    t_loop, t_loop_mono = time.perf_counter(), time.monotonic()
    loss_f = float("nan")
    while train.step < args.training_steps:
        t0 = time.perf_counter()
        jit.begin_step()  # --jit-checkpoint: from here until the optimizer step the last step's state is intact
        inputs, targets = loader.next_batch()
        inputs, targets = inputs.to(env.device, non_blocking=True), targets.to(env.device, non_blocking=True)
        with autocast:
            logits = model(inputs)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        else:
            loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_max_norm) if args.grad_max_norm > 0 else None
        if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor; materialise it on every rank (a collective)
            grad_norm = grad_norm.full_tensor()

        loss_value = loss.detach().float()
        if env.distributed:  # the logged loss is the global batch's mean, identical on every rank
            dist.all_reduce(loss_value)  # before optimizer.step(): a peer failure seen here loses nothing (jit.py)
            loss_value /= env.world_size

        manager.wait_staged()  # an async save still copying the weights must finish before they change
        jit.begin_optimizer()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        train.step += 1
        train.tokens_seen += tokens_per_step
        jit.end_step()

        loss_f = float(loss_value)
        jit.note_row(step=train.step, loss=repr(loss_f), lr=repr(lr), tokens_seen=train.tokens_seen,
                     restart=train.restarts)  # --jit-checkpoint: a survivor logs this step if rank 0 died before it
        step_s = time.perf_counter() - t0
        if resumed_step is not None and train.step == resumed_step + 1:  # what the restart cost (README: recovery)
            log0(env, recovery_line(t_loop_mono, manager.load_seconds))
        if loss_csv:
            loss_csv.row(step=train.step, loss=repr(loss_f), lr=repr(lr), tokens_seen=train.tokens_seen,
                         wall_time=f"{time.time():.3f}", restart=train.restarts)
        if progress is not None and (train.step % args.logging_frequency == 0 or train.step == args.training_steps):
            tok_s = tokens_per_step / step_s
            postfix = {"loss": f"{loss_f:.4f}", "tok/s": f"{tok_s:,.0f}", "step_s": f"{step_s:.3f}"}
            if grad_norm is not None:
                postfix["gnorm"] = f"{float(grad_norm):.2f}"
            if peak:
                postfix["mfu"] = f"{100 * flops_per_token * tok_s / env.world_size / peak:.1f}%"
            progress.set_postfix(postfix, refresh=False)
            progress.update(train.step - progress.n)
            if progress.disable:  # not a terminal (batch job log): plain lines instead of a bar
                log(f"step {train.step}/{args.training_steps} " + " ".join(f"{k} {v}" for k, v in postfix.items()))
        if profiler is not None:
            profiler.step()

        decision = policy(train.step)  # intervals, signals, walltime: one small all-reduce, the same on every rank
        try:
            manager.poll()  # surface background save errors at a step boundary
            if decision.save:
                if loss_csv:
                    loss_csv.sync()
                manager.save(train.step, state)
                saved_at = train.step
        except run_lease.Fenced:
            pass  # a newer incarnation owns the run directory: the policy's next vote stops every rank, saving nothing
        except CheckpointError as e:  # e.g. disk full
            save_failed_at = on_save_error(args, e, train.step)
        if decision.stop:
            break  # saved just above, by every rank at this step; manager.close() waits until it has committed

    try:
        manager.close()
    except CheckpointError as e:
        save_failed_at = on_save_error(args, e, train.step)
    # A newer incarnation took the run directory over (rank 0 knows): this one committed nothing since, and must
    # neither requeue nor report success.
    if distributed.all_reduce_max(1.0 if manager.fenced else 0.0, env) > 0:
        if env.is_main:
            say(f"error: stopped at step {train.step}: {lease.fenced_message}")
        distributed.shutdown(env)
        _KEEP_UNTIL_EXIT.append(model)
        return EXIT_FENCED
    if save_failed_at is not None and save_failed_at >= (saved_at or 0):
        say(f"error: training reached step {train.step} but its final checkpoint could not be saved (save failed "
            f"at step {save_failed_at}); resume from `latest` repeats the steps since")
        return EXIT_FAILED
    if env.distributed and args.parallel == "ddp":
        same = distributed.replicas_identical(model, env)
        log0(env, f"replica check: parameters {'identical' if same else 'DIFFER'} across {env.world_size} ranks")
        if not same:
            return EXIT_FAILED
    if profiler is not None:
        profiler.stop()
    if progress is not None:
        progress.close()
    run_s = time.perf_counter() - t_start
    log0(env, f"done: {train.step} steps, final loss {loss_f:.4f}, "
              f"{(time.perf_counter() - t_loop):.1f}s in the loop")
    measured = peak_memory.peak_growth()
    log0(env, f"memory measured: {measured / 2**20:,.1f} MiB peak on rank 0 ({peak_memory.describe()}); estimate "
              f"{mem_estimate.total / 2**20:,.1f} MiB ({100 * (mem_estimate.total / max(measured, 1) - 1):+.1f}%)")
    log0(env, manager.summary(run_s))
    outcome = policy.finish(train.step, args.training_steps)  # a stop before the end: rank 0 requeues (committed above)
    distributed.shutdown(env)
    _KEEP_UNTIL_EXIT.append(model)  # see __main__: freeing DDP's reducer here can hang the process
    if lease is not None and env.is_main:
        lease.release()  # the next start takes the run directory over without asking
    return {stop_policy.FINISHED: EXIT_FINISHED, stop_policy.REQUEUED: EXIT_REQUEUE, stop_policy.STOPPED: EXIT_STOPPED,
            stop_policy.REQUEUE_FAILED: EXIT_REQUEUE_FAILED}[outcome]


def cli() -> int:
    try:
        return main()
    except distributed.LaunchError as e:
        say(f"error: {e}")
        return EXIT_BAD_INPUT
    except CheckpointError as e:
        say(f"error: {e}")
        return EXIT_FAILED
    except Exception as e:
        if checkpoint_jit.recover(e):  # --jit-checkpoint: this healthy rank saved the last completed step (or another)
            return EXIT_REQUEUE
        raise


# Freed by nobody: the process ends with os._exit once everything is durable and flushed. Freeing a DDP model after
# destroy_process_group runs ~ProcessGroupGloo with the GIL held while a gloo worker thread may still need the GIL to
# free the tensors of the last all_gather: a deadlock at exit (pytorch/pytorch#56297), seen here under CPU load -- under
# SLURM it would hold the allocation until the time limit.
_KEEP_UNTIL_EXIT: list = []

if __name__ == "__main__":
    code = cli()
    # os._exit skips multiprocessing's exit handler, which terminates daemonic children: after an error exit DCP's save
    # process (--async-checkpoint process; a normal end has stopped it) would outlive us, then print a traceback when
    # it finds its pipe closed.
    import multiprocessing

    for _child in multiprocessing.active_children():
        if _child.daemon:
            _child.terminate()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
