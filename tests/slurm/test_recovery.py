"""In-process recovery under SLURM, one node: `sbatch submit-training-simple.sh --distributed --spares 1` runs
launcher.py as the step's one task, which starts the job's 2 ranks and a spare. Rank 1 is SIGKILLed in step 7: the
survivor keeps its process, the spare takes rank 1, both reload step 6 from the node-local tier, and the job completes
bitwise an uninterrupted torchrun run (weights, optimizer state, loss rows). Several nodes with spares are refused in
one line (not yet built: docs/in-process-recovery.md)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import PY, ROOT, TINY, check_weights, loss_rows, run_torchrun  # noqa: E402

pytestmark = pytest.mark.slurm

SCRIPT = ROOT / "submit-training-simple.sh"
STEPS = 12


def _train_args(corpus: str, ck: Path, local: Path) -> list[str]:
    return TINY + ["--dataset", corpus, "--checkpoint-dir", str(ck), "--training-steps", str(STEPS),
                   "--checkpoint-frequency", "4", "--local-checkpoint-dir", str(local), "--local-checkpoint-frequency",
                   "2"]


def test_a_rank_killed_in_a_one_node_job_with_a_spare_recovers_in_process_and_ends_bitwise(slurm_cluster, tmp_path,
                                                                                            corpus):
    ck, out = tmp_path / "ck", tmp_path / "job.out"
    job = slurm_cluster.sbatch(
        str(SCRIPT), "--job-name=pyr-recovery", "--nodes=1", "--ntasks-per-node=2", "--overcommit", "--time=5",
        f"--output={out}", f"--chdir={tmp_path}",
        script_args=["--distributed", "--spares", "1", "--exp_name=rec", "--log-loss-to-csv", "--",
                     *_train_args(corpus, ck, tmp_path / "local")],
        env={"PYTHON": PY, "OMP_NUM_THREADS": "1", "PYRECOVER_CRASH_AT_STEP": "7:1:kill",
             "PYRECOVER_CRASH_ONCE": str(tmp_path / "crashed")}, cwd=ROOT)
    reference = tmp_path / "reference"
    run_torchrun(2, _train_args(corpus, reference, tmp_path / "reference-local") + ["--log-loss-to-csv"], check=True,
                 timeout=600)
    try:
        info = slurm_cluster.wait_for_state(job, "COMPLETED", timeout=300)
    except AssertionError as e:
        raise AssertionError(f"{e}\njob output:\n{out.read_text(errors='replace')[-5000:] if out.exists() else ''}")
    text = out.read_text(errors="replace")
    assert info["ExitCode"] == "0:0" and "training finished" in text, (info, text[-4000:])
    assert "2 ranks and 1 spares on one node (launcher.py)" in text, text[-4000:]
    assert re.search(r"launcher: generation 1: rank 1 \(member 1, pid \d+\) died \(SIGKILL\); member 2 \(spare\) takes "
                     r"rank 1", text), text[-4000:]
    assert re.search(r"^recovery: .* generation 1 resumed step 6 from .*local tier in-process", text, re.M), text[-4000:]
    assert len(re.findall(r"launcher: member \d+ pid", text)) == 3  # nothing restarted
    cmp = check_weights(ck / "rec" / f"step-{STEPS:08d}", reference / "default" / f"step-{STEPS:08d}", "--tolerance",
                        "0", "--optimizer")
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr
    assert loss_rows(ck / "rec" / "loss.csv") == loss_rows(reference / "default" / "loss.csv")
