"""What the goodput harness (goodput.py) and its failure runner (goodput_failures.py) share: the training command,
the configurations, the run's settings (module state main sets in place), and the small readers and formatters."""

from __future__ import annotations

import csv
import os
import random
import re
import sys
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent

PY = sys.executable

# --eval-windows 0: the checkpoint path alone, as the figures in docs/benchmarks.md were measured (the card's evaluation
# forward at each save is measured on its own, docs/checkpointing.md "Validation by prediction").
TRAIN_ARGS = ["--model", "small", "--batch-size", "2", "--sequence-length", "64", "--eval-windows", "0"]

RANKS = 2  # --ranks: each rank runs one compute thread (OMP_NUM_THREADS=1), so on 2 cores 2 ranks leave none free

# dcp async has two modes (a thread or a process persists in the background): both run, the better is reported.
DCP_ASYNC_MODES = {"dcp-async": "--async-checkpoint", "dcp-async-process": "--async-checkpoint process"}

CONFIGS = {
    "vanilla": "--checkpoint-backend vanilla",
    **{name: f"--checkpoint-backend dcp {mode}" for name, mode in DCP_ASYNC_MODES.items()},
    "concurrent": "--checkpoint-backend concurrent",
    "concurrent-jit": "--checkpoint-backend concurrent --jit-checkpoint",
    # the node-local tier in /dev/shm: the interval below is the local one; the shared tier (--checkpoint-dir, or S3
    # with --shared s3) receives every SHARED_FACTOR-th local step
    "tiered": "--checkpoint-backend concurrent --local-checkpoint-dir {local}",
    # the same, each start a child of a warm standby (warm.py) that paid the imports before the first start
    "tiered-warm": "--checkpoint-backend concurrent --local-checkpoint-dir {local}",
    # no local tier, the same warm standby: what the standby alone buys (kept out of the default set)
    "concurrent-warm": "--checkpoint-backend concurrent",
}

SHARED_FACTOR = 10

#: --shared s3: the S3 prefix each job's checkpoints go under (a SeaweedFS server of this run) and its clients' variables
S3: dict = {"uri": None, "env": {}, "pid": None}

#: the variables of the configuration now running (a warm standby's socket)
EXTRA_ENV: dict = {}

#: --launcher direct: the ranks start as srun starts them (benchmarks/launch.py), not under torchrun's agent
LAUNCHER: dict = {"direct": False, "ranks": RANKS}

RESUMED = re.compile(r"resumed from \S+ \(step (\d+)")

FRESH = "no checkpoint found"

def train_cmd(ckpt_dir: Path, steps: int, every: int, flags: list[str], dataset: str, s3: bool = True,
              shared_every: int | None = None) -> list[str]:
    """The job. A configuration with a local tier (``{local}`` in its flags: a folder in /dev/shm of this job's) saves
    there every ``every`` steps and to the shared tier every ``shared_every`` (default SHARED_FACTOR x ``every``). The
    shared tier is ``ckpt_dir``, or with --shared s3 (and ``s3``) a prefix on the S3 server; the loss CSV stays in
    ``ckpt_dir`` either way."""
    shared = f"{S3['uri']}/{ckpt_dir.name}" if S3["uri"] and s3 else None
    if shared:
        (ckpt_dir / "run").mkdir(parents=True, exist_ok=True)
    flags = [f.replace("{local}", str(local_dir(ckpt_dir))) for f in flags]
    tiered = "--local-checkpoint-dir" in flags
    if tiered:
        flags += ["--local-checkpoint-frequency", str(every)]
        every = shared_every or every * SHARED_FACTOR
    ranks = LAUNCHER["ranks"]
    launcher = ([PY, "benchmarks/launch.py", "--nproc", str(ranks), "--"] if LAUNCHER["direct"] else
                [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)])
    return [*launcher, "train.py", "--distributed", *TRAIN_ARGS, "--dataset", dataset, "--training-steps", str(steps),
            "--checkpoint-frequency", str(every), "--checkpoint-dir", shared or str(ckpt_dir), "--exp-name", "run",
            "--resume-from-checkpoint", "latest",
            f"--log-loss-to-csv={ckpt_dir / 'run' / 'loss.csv'}" if shared else "--log-loss-to-csv", *flags]

def local_dir(ckpt_dir: Path) -> Path:
    """The node-local tier of the job writing to ``ckpt_dir``: in /dev/shm, removed with the job's folder."""
    return Path("/dev/shm") / f"pyrecover-goodput-{os.getpid()}-{ckpt_dir.name}"

def loss_rows(path: Path) -> list[tuple[int, float]]:
    """(step, unix time the step completed) of every complete row of a loss CSV."""
    rows = []
    try:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                try:
                    rows.append((int(r["step"]), float(r["wall_time"])))
                except (TypeError, ValueError):  # a row cut short by SIGKILL
                    pass
    except FileNotFoundError:
        pass
    return rows

def kill_schedule(seed: int, mtbf: float) -> Iterator[float]:
    """Kill times: exponential gaps of mean ``mtbf`` from a seeded RNG (a Poisson process), without end."""
    rng, t = random.Random(seed), 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf)
        yield t

def f(x, digits: int = 2) -> str:
    return "–" if x is None or (isinstance(x, float) and x != x) else f"{x:.{digits}f}"

def row(*cells) -> str:
    """One markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"
