"""submit-training-simple.sh finds train.py when sbatch runs from another directory: in PYRECOVER_DIR, the job's working
directory (sbatch --chdir=REPO) or the submit directory, in that order -- and names all three when none has it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import PY, ROOT, TINY, csv_rows  # noqa: E402

pytestmark = pytest.mark.slurm

SCRIPT = ROOT / "submit-training-simple.sh"


def submit(cluster, tmp_path: Path, name: str, chdir: Path, script_args: list[str],
           env: dict | None = None) -> tuple[int, Path]:
    elsewhere = tmp_path / "elsewhere"  # the submit directory: no train.py here
    elsewhere.mkdir(exist_ok=True)
    out = tmp_path / f"{name}.out"  # absolute: the job's working directory may be the repository
    job = cluster.sbatch(str(SCRIPT), f"--job-name=pyr-{name}", "--ntasks-per-node=1", "--time=5", f"--chdir={chdir}",
                         f"--output={out}", script_args=script_args,
                         env={"PYTHON": PY, "OMP_NUM_THREADS": "1", "PYRECOVER_DIR": None, **(env or {})},
                         cwd=elsewhere)
    return job, out


def test_chdir_to_the_repository_from_another_directory_runs_train_py(slurm_cluster, tmp_path, corpus):
    """Also PYRECOVER_SRUN_ARGS: its --label reaches srun, which then prefixes every line of the task with its id."""
    ck = tmp_path / "ck"
    job, out = submit(slurm_cluster, tmp_path, "chdir-repo", ROOT,
                      ["--exp_name=chdir", "--log-loss-to-csv", "--", *TINY, "--training-steps", "3",
                       "--dataset", corpus, "--checkpoint-dir", str(ck)], env={"PYRECOVER_SRUN_ARGS": "--label"})
    try:
        info = slurm_cluster.wait_for_state(job, "COMPLETED", timeout=240)
    except AssertionError as e:
        log = out.read_text(errors="replace") if out.exists() else "(no output file)"
        raise AssertionError(f"{e}\njob output:\n{log[-3000:]}") from None
    log = out.read_text(errors="replace")
    assert info["ExitCode"] == "0:0", (info, log)
    assert f"{ROOT}/train.py" in log, log  # the repository's train.py, found through the job's working directory
    assert "done: 3 steps" in log and "training finished" in log, log
    assert any(line.startswith("0: ") and "done: 3 steps" in line for line in log.splitlines()), log  # srun --label
    assert "srun --kill-on-bad-exit=0 --ntasks=1 --nodes=1 --label " in log, log
    assert csv_rows(ck / "chdir" / "loss.csv") == 3


def test_no_train_py_anywhere_names_the_three_places(slurm_cluster, tmp_path):
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    job, out = submit(slurm_cluster, tmp_path, "no-train-py", workdir, [])
    info = slurm_cluster.wait_for_state(job, "FAILED", timeout=120)
    assert info["ExitCode"] == "2:0", info
    errors = [line for line in out.read_text(errors="replace").splitlines() if "error" in line]
    assert len(errors) == 1, errors
    line = errors[0]
    assert "train.py not found" in line and "PYRECOVER_DIR" in line, line
    assert f"working directory ({workdir})" in line and f"submit directory ({tmp_path / 'elsewhere'})" in line, line


def test_a_crashing_rank_runs_again_in_the_allocation_until_the_cap(slurm_cluster, tmp_path):
    """A task that crashes every time (PYTHON stands in for a train.py that dies): the script runs it again in the same
    allocation from latest, PYRECOVER_INPLACE_RESTARTS times, then ends the job with its exit code. (Resuming from the
    node-local tier after such a restart: tests/slurm/test_multinode.py, the tiered scenario.)"""
    crash = tmp_path / "crash.sh"
    calls = tmp_path / "calls"
    crash.write_text(f'#!/bin/bash\necho "argv: $*" >> {calls}\nkill -9 $$\n')
    crash.chmod(0o755)
    out = tmp_path / "crash.out"
    job = slurm_cluster.sbatch(str(SCRIPT), "--job-name=pyr-crash", "--ntasks-per-node=1", "--time=5",
                               f"--chdir={ROOT}", f"--output={out}", script_args=[],
                               env={"PYTHON": str(crash), "PYRECOVER_INPLACE_RESTARTS": "2"}, cwd=tmp_path)
    info = slurm_cluster.wait_for_state(job, "FAILED", timeout=120)
    log = out.read_text(errors="replace")
    argvs = calls.read_text().splitlines()
    assert len(argvs) == 3 and "--resume-from-checkpoint" not in argvs[0], log
    assert all(a.endswith("--resume-from-checkpoint latest") for a in argvs[1:]), argvs
    assert "restarting in this allocation from latest (2 of 2)" in log, log
    assert "not restarting in this allocation: 2 restarts reached PYRECOVER_INPLACE_RESTARTS=2" in log, log
    assert info["Restarts"] == "0" and info["ExitCode"] != "0:0", info
