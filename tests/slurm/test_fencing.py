"""Two incarnations of one SLURM job on one run directory: the stale one is fenced and changes nothing.

A partitioned node's ranks can outlive their job: SLURM requeues it and starts a new incarnation (same job id,
SLURM_RESTART_COUNT + 1) while the old process still runs. Here the job script starts train.py outside SLURM's process
tracking (``setsid`` from a subshell that exits: proctrack/linuxproc follows parent links), so ``scontrol requeue``
leaves it alive; the test freezes it with SIGSTOP before the requeue, lets the new incarnation take over, and only then
lets the old one run again -- with the new one frozen, so that any change to the run directory in that window is the
old one's. The old one must stop with exit 6 (fenced) leaving the directory exactly as it was; the new one must finish
bitwise equal to an uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import PY, ROOT, TINY, check_weights, csv_rows, loss_rows, run_train  # noqa: E402

pytestmark = pytest.mark.slurm

STEPS = 30
FLAGS = TINY + ["--training-steps", str(STEPS), "--checkpoint-frequency", "5", "--max-kept-checkpoints", "0",
                "--log-loss-to-csv", "--resume-from-checkpoint", "latest"]

JOB = """#!/bin/bash
#SBATCH --requeue
#SBATCH --open-mode=append
# Incarnation n runs train.py detached from the job's process tree (a stale node's ranks, in miniature) and waits for
# it through its pid file; its exit code lands in rc-<n>.
n=${{SLURM_RESTART_COUNT:-0}}
( setsid bash -c 'echo $$ > {work}/pid-'$n'; {py} {train} "$@" > {work}/out-'$n'.log 2>&1; echo $? > {work}/rc-'$n \\
    _ {flags} < /dev/null > /dev/null 2>&1 & )
while [ ! -s {work}/pid-$n ]; do sleep 0.1; done
pid=$(cat {work}/pid-$n)
while [ ! -s {work}/rc-$n ]; do sleep 0.2; done
exit $(cat {work}/rc-$n)
"""


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under the run directory: (size, mtime_ns). Contents of a changed file change these."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_size if p.is_file() else 0, st.st_mtime_ns)
    return out


def _wait(cond, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _pid(work: Path, n: int) -> int:
    return int((work / f"pid-{n}").read_text())


def _signal_group(pid: int, sig: int) -> None:
    """train.py and the shell around it (setsid made them one process group)."""
    os.killpg(os.getpgid(pid), sig)


def test_requeued_incarnation_fences_the_stale_one(slurm_cluster, corpus, tmp_path):
    work, ckpt = tmp_path / "work", tmp_path / "ck"
    work.mkdir()
    flags = FLAGS + ["--dataset", corpus, "--checkpoint-dir", str(ckpt)]
    root = ckpt / "default"

    reference = tmp_path / "ref"
    run_train(flags[:-2] + ["--checkpoint-dir", str(reference)], check=True)
    reference = reference / "default"

    script = JOB.format(work=work, py=PY, train=ROOT / "train.py", flags=" ".join(flags))
    job = slurm_cluster.sbatch(script, "--job-name=pyr-fence", f"--chdir={work}", f"--output={work}/job.out",
                               env={"PYRECOVER_STEP_SLEEP": "0.2", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                                    "PYTHONPATH": str(ROOT)})
    old = None
    try:
        # 1. incarnation 0 trains and has committed a checkpoint; freeze it, then requeue the job.
        _wait(lambda: csv_rows(root / "loss.csv") >= 8, "incarnation 0 to reach step 8")
        old = _pid(work, 0)
        _signal_group(old, signal.SIGSTOP)
        slurm_cluster.requeue(job)
        # 2. incarnation 1 (same job id, restart 1) takes the run directory over and trains on.
        _wait(lambda: (work / "out-1.log").exists() and "resumed from" in (work / "out-1.log").read_text(),
              "incarnation 1 to resume")
        out1 = (work / "out-1.log").read_text()
        assert f"requeued SLURM job {job} (restart 1) fences generation 1" in out1, out1
        resumed = int(out1.split("resumed from")[1].split("(step ")[1].split(",")[0])
        _wait(lambda: csv_rows(root / "loss.csv") >= resumed + 6, "incarnation 1 to train and save")
        # 3. freeze the new one; wake the old one: it must notice, stop, and change nothing.
        new = _pid(work, 1)
        _signal_group(new, signal.SIGSTOP)
        before = _snapshot(root)
        _signal_group(old, signal.SIGCONT)
        _wait(lambda: (work / "rc-0").exists() and (work / "rc-0").read_text().strip() != "", "the stale one to exit",
              timeout=120)
        after = _snapshot(root)
        _signal_group(new, signal.SIGCONT)
        out0 = (work / "out-0.log").read_text()
        assert (work / "rc-0").read_text().strip() == "6", out0[-3000:]
        assert "fenced" in out0 and "Traceback" not in out0, out0[-3000:]
        assert after == before, {k: (before.get(k), after.get(k)) for k in set(before) | set(after)
                                 if before.get(k) != after.get(k)}
        old = None
        # 4. the job completes, and the result is exactly the uninterrupted run's.
        slurm_cluster.wait_for_state(job, "COMPLETED", timeout=300)
        assert (work / "rc-1").read_text().strip() == "0"
        assert loss_rows(root / "loss.csv") == loss_rows(reference / "loss.csv")
        final = f"step-{STEPS:08d}"
        diff = check_weights(reference / final, root / final, "--tolerance", "0", "--optimizer")
        assert diff.returncode == 0, diff.stdout + diff.stderr
    finally:
        slurm_cluster.run("scancel", str(job), check=False)
        for n in (0, 1):
            try:
                _signal_group(_pid(work, n), signal.SIGKILL)
            except (OSError, ValueError):
                pass
