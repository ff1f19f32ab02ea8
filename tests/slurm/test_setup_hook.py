"""The setup hook (PYRECOVER_SETUP / --setup) of submit-training-simple.sh on two emulated nodes: the file is sourced in
the batch shell and again by every task on its own node, right before python -- which is exec'd, so it is the very
process that sourced the file -- and what the file sets up is what runs train.py: here it plays a venv's `activate` by
putting a directory first on PATH whose `python` logs where it runs and execs the real interpreter (PYTHON is unset,
so the script runs `python` from PATH). Training, 2 ranks over real TCP between the nodes, completes 3 steps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import PY, ROOT, TINY, csv_rows  # noqa: E402

pytestmark = pytest.mark.slurm

SCRIPT = ROOT / "submit-training-simple.sh"

SETUP = """# a user's setup file: module load / conda activate / source .venv/bin/activate
echo "setup $(hostname) ${{SLURM_STEP_ID:-batch}} ${{SLURM_PROCID:-none}} $$" >> "{log}"
export PATH="{bin}:$PATH"
export PYRECOVER_HOOK_SEEN=yes
"""

SHIM = """#!/bin/bash
echo "python $(hostname) ${{SLURM_PROCID:-none}} $$ ${{PYRECOVER_HOOK_SEEN:-no}}" >> "{log}"
exec "{py}" "$@"
"""


def test_setup_file_runs_on_every_node_before_train_py(slurm_multinode, tmp_path, corpus):
    log = tmp_path / "hook.log"  # shared filesystem: every node appends here
    bin_dir = tmp_path / "venv-bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(SHIM.format(log=log, py=PY))
    (bin_dir / "python").chmod(0o755)
    setup = tmp_path / "setup.sh"
    setup.write_text(SETUP.format(log=log, bin=bin_dir))
    ck, out = tmp_path / "ck", tmp_path / "job.out"
    job = slurm_multinode.sbatch(
        str(SCRIPT), "--job-name=pyr-setup-hook", "--nodes=2", "--ntasks-per-node=1", "--time=5", f"--output={out}",
        f"--chdir={tmp_path}",
        script_args=["--distributed", "--exp_name=hook", "--log-loss-to-csv", "--", *TINY, "--training-steps", "3",
                     "--dataset", corpus, "--checkpoint-dir", str(ck)],
        env={"PYTHON": None, "PYRECOVER_SETUP": str(setup), "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    try:
        info = slurm_multinode.wait_for_state(job, "COMPLETED", timeout=240)
    except AssertionError as e:
        text = out.read_text(errors="replace") if out.exists() else "(no output file)"
        hook = log.read_text() if log.exists() else "(no hook log)"
        raise AssertionError(f"{e}\njob output:\n{text[-3000:]}\nhook log:\n{hook}") from None
    text = out.read_text(errors="replace")
    assert info["ExitCode"] == "0:0" and "training finished" in text, (info, text[-3000:])
    assert csv_rows(ck / "hook" / "loss.csv") == 3

    lines = [line.split() for line in log.read_text().splitlines()]
    setups = [tuple(x[1:]) for x in lines if x[0] == "setup"]  # (host, step, procid, pid)
    pythons = [tuple(x[1:]) for x in lines if x[0] == "python"]  # (host, procid, pid, seen)
    batch = [s for s in setups if s[1] == "batch"]
    tasks = [s for s in setups if s[1] != "batch"]
    assert len(batch) == 1, lines  # the batch shell sourced it once
    assert len(tasks) == 2 and len(pythons) == 2, lines  # ... and each of the 2 tasks once
    assert {t[0] for t in tasks} == {p[0] for p in pythons} and len({t[0] for t in tasks}) == 2, lines  # 2 nodes
    assert sorted(t[2] for t in tasks) == ["0", "1"], lines
    # Same host, rank and pid: the task's bash sourced the file, then became (exec) the python that ran train.py --
    # signals from SLURM reach train.py directly -- and that python saw what the file exported.
    assert {(t[0], t[2], t[3]) for t in tasks} == {(p[0], p[1], p[2]) for p in pythons}, lines
    assert all(p[3] == "yes" for p in pythons), lines
