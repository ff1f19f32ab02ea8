"""In-process recovery under SLURM, through `sbatch submit-training-simple.sh --distributed --spares 1`.

One node: launcher.py is the step's one task and starts the job's 2 ranks and a spare. Rank 1 is SIGKILLed in step 7:
the survivor keeps its process, the spare takes rank 1, both reload step 6 from the node-local tier, and the job
completes bitwise an uninterrupted torchrun run (weights, optimizer state, loss rows).

Two emulated nodes (the multi-node cluster: each node its own network namespace, hostname and scratch), 1 rank + 1
spare each: one launcher.py per node, node 0's hosting the store. Rank 1 (node 1) is SIGKILLed in step 7 and node 1's
spare takes it from node 1's tier; later node 1 is lost whole (every process of its namespace SIGKILLed, its scratch
wiped): node 0's launcher hears no heartbeat, node 0's spare takes rank 1 and loads its part from the peer copy node 0
kept. The survivor (rank 0) is one process throughout, and the job completes bitwise the torchrun run."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import PY, ROOT, TINY, check_weights, loss_rows, run_torchrun  # noqa: E402

pytestmark = pytest.mark.slurm

SCRIPT = ROOT / "submit-training-simple.sh"
STEPS = 12


def _train_args(corpus: str, ck: Path, local: Path, steps: int = STEPS, every: int = 4) -> list[str]:
    return TINY + ["--dataset", corpus, "--checkpoint-dir", str(ck), "--training-steps", str(steps),
                   "--checkpoint-frequency", str(every), "--local-checkpoint-dir", str(local),
                   "--local-checkpoint-frequency", "2"]


def _bitwise(ck: Path, reference: Path, exp: str, steps: int) -> None:
    cmp = check_weights(ck / exp / f"step-{steps:08d}", reference / "default" / f"step-{steps:08d}", "--tolerance",
                        "0", "--optimizer")
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr
    assert loss_rows(ck / exp / "loss.csv") == loss_rows(reference / "default" / "loss.csv")


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
    _bitwise(ck, reference, "rec", STEPS)


NODE_STEPS = 40
NODE_LOSS_AT_ROW = 20  # after generation 1's recovery (step 7), between two local saves


def test_two_nodes_with_a_spare_each_survive_a_killed_rank_then_a_lost_node_in_process(slurm_multinode, tmp_path,
                                                                                        corpus):
    cluster = slurm_multinode
    ck, out = tmp_path / "ck", tmp_path / "job.out"
    tmp_path.chmod(0o755)
    local = cluster.state_dir / "scratch" / "tier"  # each node's own scratch
    args = _train_args(corpus, ck, local, NODE_STEPS, every=100) + ["--peer-checkpoint"]  # shared: the end only
    job = cluster.sbatch(
        str(SCRIPT), "--job-name=pyr-recovery-2n", "--nodes=2", "--ntasks-per-node=1", "--overcommit", "--no-kill",
        "--nodelist=pyr-node[1-2]", "--time=5", f"--output={out}", f"--chdir={tmp_path}",
        script_args=["--distributed", "--spares", "1", "--exp_name=rec2", "--log-loss-to-csv", "--", *args],
        env={"PYTHON": PY, "OMP_NUM_THREADS": "1", "PYRECOVER_CRASH_AT_STEP": "7:1:kill", "PYRECOVER_STEP_SLEEP": "0.3",
             "PYRECOVER_CRASH_ONCE": str(tmp_path / "crashed")}, cwd=ROOT)
    csv = ck / "rec2" / "loss.csv"

    def text() -> str:
        return out.read_text(errors="replace") if out.exists() else ""

    def wait(cond, what: str, timeout: float = 300):
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{text()[-5000:]}"
            time.sleep(0.2)

    reference = tmp_path / "reference"
    run_torchrun(2, _train_args(corpus, reference, tmp_path / "reference-local", NODE_STEPS, every=100)
                 + ["--log-loss-to-csv"], check=True, timeout=600)
    victim = "pyr-node2"
    try:
        wait(lambda: re.search(r"recovery: .* generation 1 resumed step", text()), "the first recovery")
        wait(lambda: csv.exists() and len(csv.read_text().splitlines()) - 1 >= NODE_LOSS_AT_ROW, "the loss's row")
        done_before = len(csv.read_text().splitlines()) - 1  # the kill lands after this step (later under load)
        cluster.node_sh("kill-node", victim)
        done_after = len(csv.read_text().splitlines()) - 1
        cluster.node_sh("wipe-scratch", victim)
        info = cluster.wait_for_state(job, "COMPLETED", timeout=600)
    except AssertionError as e:
        raise AssertionError(f"{e}\njob output:\n{text()[-6000:]}") from None
    finally:
        cluster.run("scancel", str(job), check=False)
        cluster.node_sh("start-node", victim)
    said = text()
    assert info["ExitCode"] == "0:0" and "training finished" in said, (info, said[-5000:])
    assert "1 ranks and 1 spares on each of 2 nodes (launcher.py, store pyr-node1:" in said, said[-5000:]
    # the kill: node 1's own spare (member 3) takes rank 1 and loads node 1's tier
    assert re.search(r"launcher: generation 1: rank 1 \(member 2, pid \d+\) died \(SIGKILL\); member 3 \(spare\) takes "
                     r"rank 1 on node 1; 1 spares left", said), said[-5000:]
    assert re.search(r"^recovery: .* generation 1 resumed step 6 from 2 of 2 ranks from their local tier in-process",
                     said, re.M), said[-5000:]
    # the node: no heartbeat, node 0's spare (member 1) takes rank 1 and loads the peer copy node 0 kept
    assert re.search(r"launcher: node 1 \(pyr-node2\) lost: no heartbeat for [\d.]+s", said), said[-5000:]
    assert re.search(r"launcher: generation 2: rank 1 \(member 3, pid \d+\) died \(node 1 \(pyr-node2\) lost: no "
                     r"heartbeat for [\d.]+s\); member 1 \(spare\) takes rank 1 on node 0; 0 spares left", said), \
        said[-5000:]
    m = re.search(r"^recovery: .* generation 2 resumed step (\d+) from 2 of 2 ranks from their local tier \(1 from a "
                  r"peer copy\) in-process", said, re.M)
    # the newest step both nodes held when node 1 went: at most two local intervals (every 2 steps) before the kill,
    # the last one's peer copy perhaps in flight
    assert m and 6 < int(m.group(1)) and done_before - 4 <= int(m.group(1)) <= done_after, \
        (done_before, done_after, said[-5000:])
    assert len(re.findall(r"launcher: member \d+ pid", said)) == 4  # 2 per node at the start, nothing restarted
    rank0 = re.search(r"launcher: member 0 pid (\d+) rank 0", said).group(1)
    assert re.search(rf"launcher: generation 2 ended: rank 0 exit 0 \(member 0, pid {rank0}\), rank 1 exit 0 "
                     r"\(member 1, pid \d+\)", said), said[-5000:]
    _bitwise(ck, reference, "rec2", NODE_STEPS)
