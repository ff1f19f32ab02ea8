"""The local SLURM test cluster itself, proved with plain shell jobs (no train.py). Its time-limit warning and kill
(test_training.py::test_time_limit_warning_signal_then_kill) waits over a minute for SLURM, so it runs beside the
training jobs of test_training.py.

Measured timings are printed as ``[slurm-timing] ...`` lines (see them with ``pytest -rP`` or ``-s``).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm


def wait_for_file(path: Path, timeout: float = 30, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{path} did not appear within {timeout}s {what}")
        time.sleep(0.1)


def timing(msg: str) -> None:
    print(f"[slurm-timing] {msg}")


def test_cluster_is_up(slurm_cluster):
    out = slurm_cluster.run("sinfo", "-h", "-N", "-o", "%N %T %c %m").stdout.split()
    assert out[0] == slurm_cluster.node and out[1] == "idle", out
    assert slurm_cluster.cpus >= 1
    assert slurm_cluster.version.startswith("slurm"), slurm_cluster.version
    timing(f"{slurm_cluster.version}, node {out}, cluster.sh start took {slurm_cluster.start_seconds:.1f}s")


def test_job_runs_and_completes(slurm_cluster, tmp_path):
    t0 = time.monotonic()
    job = slurm_cluster.sbatch(
        """
echo "hello from $SLURM_JOB_ID on $SLURMD_NODENAME"
echo "marker=$PYRECOVER_TEST_MARKER"
exit 0
""",
        "--job-name=hello",
        env={"PYRECOVER_TEST_MARKER": "xyz"},
        cwd=tmp_path,
    )
    info = slurm_cluster.wait_for_state(job, "COMPLETED", timeout=60)
    timing(f"submit -> COMPLETED {time.monotonic() - t0:.1f}s")
    assert info["ExitCode"] == "0:0", info
    out = (tmp_path / f"slurm-{job}.out").read_text()
    assert f"hello from {job} on {slurm_cluster.node}" in out
    assert "marker=xyz" in out  # the submission environment reaches the job


def test_failing_job_is_failed(slurm_cluster, tmp_path):
    job = slurm_cluster.sbatch("exit 3\n", cwd=tmp_path)
    info = slurm_cluster.wait_for_state(job, "FAILED", timeout=60)
    assert info["ExitCode"] == "3:0", info


def test_srun_two_tasks(slurm_cluster, tmp_path):
    extra = [] if slurm_cluster.cpus >= 2 else ["--overcommit"]
    job = slurm_cluster.sbatch(
        """
srun bash -c 'echo "task $SLURM_PROCID of $SLURM_NTASKS localid $SLURM_LOCALID step $SLURM_STEP_ID"'
""",
        "--ntasks=2",
        *extra,
        cwd=tmp_path,
    )
    slurm_cluster.wait_for_state(job, "COMPLETED", timeout=60)
    lines = (tmp_path / f"slurm-{job}.out").read_text().splitlines()
    tasks = sorted(line for line in lines if line.startswith("task "))
    assert [t.split()[1] for t in tasks] == ["0", "1"], lines
    assert all(" of 2 " in t for t in tasks), lines


def test_scancel_signal_reaches_steps_and_batch_separately(slurm_cluster, tmp_path):
    """`scancel -s USR1` -> srun tasks only; `scancel -b -s USR2` -> batch shell only."""
    job = slurm_cluster.sbatch(
        """
trap 'echo USR1 >> batch.sig' USR1
trap 'echo USR2 >> batch.sig; touch batch.usr2' USR2
srun bash -c 'trap "echo USR1 \\$SLURM_PROCID >> step.sig; exit 0" USR1; touch step.ready; while :; do sleep 0.1; done'
echo "srun exit $?" >> batch.sig
for _ in $(seq 600); do [ -e batch.usr2 ] && exit 0; sleep 0.1; done
exit 1
""",
        cwd=tmp_path,
    )
    wait_for_file(tmp_path / "step.ready", 60, "(srun task did not start)")
    t0 = time.monotonic()
    slurm_cluster.scancel(job, signal="USR1")
    wait_for_file(tmp_path / "step.sig", 20, "(USR1 did not reach the srun task)")
    timing(f"scancel -s USR1 -> srun task trap {time.monotonic() - t0:.2f}s")
    wait_for_file(tmp_path / "batch.sig", 20, "(srun did not end after its task exited)")
    slurm_cluster.scancel(job, signal="USR2", batch=True)
    slurm_cluster.wait_for_state(job, "COMPLETED", timeout=30)
    assert (tmp_path / "step.sig").read_text().split() == ["USR1", "0"]
    batch = (tmp_path / "batch.sig").read_text().split("\n")
    assert batch[:2] == ["srun exit 0", "USR2"], batch  # and no USR1 in the batch shell


def test_requeue_running_job(slurm_cluster, tmp_path):
    """`scontrol requeue` kills the running job and runs it again with SLURM_RESTART_COUNT=1.
    --open-mode=append keeps the first run's output; without it the output file is truncated."""
    script = """
echo "run restart_count=${SLURM_RESTART_COUNT:-unset} at $(date +%s.%N)"
if [ "${SLURM_RESTART_COUNT:-0}" -ge 1 ]; then echo second-run-done; exit 0; fi
touch "ready.$SLURM_JOB_ID"
while :; do sleep 0.1; done
"""
    job_append = slurm_cluster.sbatch(script, "--open-mode=append", "--output=append.out", cwd=tmp_path)
    job_trunc = slurm_cluster.sbatch(script, "--output=truncate.out", cwd=tmp_path)
    for job in (job_append, job_trunc):
        wait_for_file(tmp_path / f"ready.{job}", 60, f"(job {job} did not start)")
    t_requeue = time.time()
    for job in (job_append, job_trunc):
        slurm_cluster.requeue(job)
    pending = slurm_cluster.wait_for_state(job_append, {"PENDING", "REQUEUED"}, timeout=30)
    info = slurm_cluster.wait_for_state(job_append, "COMPLETED", timeout=90)
    slurm_cluster.wait_for_state(job_trunc, "COMPLETED", timeout=90)

    out = (tmp_path / "append.out").read_text()
    runs = re.findall(r"run restart_count=(\S+) at (\S+)", out)
    assert [r[0] for r in runs] == ["unset", "1"], out
    assert "second-run-done" in out
    assert info.get("Restarts") == "1", info
    timing(
        f"requeue -> second run started {float(runs[1][1]) - t_requeue:.1f}s "
        f"(pending reason after requeue: {pending.get('Reason')})"
    )
    trunc = (tmp_path / "truncate.out").read_text()
    assert "restart_count=unset" not in trunc and "restart_count=1" in trunc, trunc


def test_job_array_one_at_a_time(slurm_cluster, tmp_path):
    t0 = time.monotonic()
    job = slurm_cluster.sbatch(
        """
echo "start $SLURM_ARRAY_TASK_ID $(date +%s.%N)" >> tasks.log
sleep 1
echo "end $SLURM_ARRAY_TASK_ID $(date +%s.%N)" >> tasks.log
""",
        "--array=1-3%1",
        "--output=array-%A_%a.out",
        cwd=tmp_path,
    )
    for task in (1, 2, 3):
        info = slurm_cluster.wait_for_state(f"{job}_{task}", "COMPLETED", timeout=60)
        assert info["ArrayTaskId"] == str(task), info
    elapsed = time.monotonic() - t0
    events = [line.split() for line in (tmp_path / "tasks.log").read_text().splitlines()]
    # strictly sequential: start 1, end 1, start 2, end 2, start 3, end 3
    assert [(e[0], e[1]) for e in events] == [(k, str(t)) for t in (1, 2, 3) for k in ("start", "end")], events
    gaps = [float(events[i + 1][2]) - float(events[i][2]) for i in (1, 3)]
    timing(f"--array=1-3%1 (1 s tasks): all done {elapsed:.1f}s after submit, gaps between tasks {gaps}")
    for task in (1, 2, 3):
        assert (tmp_path / f"array-{job}_{task}.out").exists()
