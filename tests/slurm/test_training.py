"""submit-training-simple.sh + train.py on the real local SLURM cluster: `scancel -s USR1`, walltime-aware stop without
a signal, and a chained job array -- each time all ranks save the same step, nothing is lost and the final weights equal
an uninterrupted run's bit for bit. The time-limit warning (--signal=USR1@15, self-requeue, resume) is proved by
test_multinode.py on 2 nodes, one rank each, which asserts everything a 1-node run of it did and the rendezvous across
nodes besides. Beside the training jobs run the plain shell jobs of the cluster's own time-limit warning and kill
(``test_time_limit_warning_signal_then_kill``): they only wait, so they share the wait of the others.

The jobs are slow on purpose (``PYRECOVER_STEP_SLEEP``, test-only: timing, never numbers) so that a warning or deadline
lands mid-run. They are independent, so the module starts the ones of the selected tests at once, each driven by a
thread (submit, signal, wait), plus the uninterrupted reference run (torchrun, 2 ranks); each test then asserts on its
own job. With 2 CPUs the cluster runs two 2-rank jobs at a time (``--overcommit``: one CPU per job).

Timings of this SLURM (tests/slurm/README.md): time limits and ``--signal`` warnings are checked every 30 s, so
``--time=1 --signal=USR1@15`` warns 15-45 s after the start and kills at 60-90 s; a requeued job waits ~12 s.
"""

from __future__ import annotations

import csv
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import PY, ROOT, TINY, check_weights, env_for_tests, loss_rows, torchrun_cmd  # noqa: E402

pytestmark = pytest.mark.slurm

SCRIPT = ROOT / "submit-training-simple.sh"
STEPS = 60
NTASKS = 2
SUBMITTED: list[int] = []  # cancelled at the end of the module, whatever happened
TRAIN_FLAGS = TINY + ["--training-steps", str(STEPS), "--checkpoint-frequency", "25", "--max-kept-checkpoints", "2"]


def timing(msg: str) -> None:
    print(f"[slurm-timing] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------------------------------
# Jobs
# ----------------------------------------------------------------------------------------------------------------------


class Job:
    """One submission of submit-training-simple.sh (--distributed, 2 ranks on gloo) in its own directory."""

    def __init__(self, cluster, base: Path, name: str, corpus: str, *sbatch_args: str, sleep: float,
                 train_args: tuple[str, ...] = (), script: str | None = None, exp: str | None = None,
                 script_flags: tuple[str, ...] = ()):
        self.cluster, self.name = cluster, name
        self.dir = base / name
        self.dir.mkdir(parents=True)
        self.ckpt = base / "ck"  # one checkpoint dir per module run; one experiment (sub-folder) per scenario
        exp = exp or name
        self.run_dir = self.ckpt / exp
        self.csv = self.run_dir / "loss.csv"
        self.t_submit = time.monotonic()
        self.id = cluster.sbatch(
            script if script is not None else str(SCRIPT),
            f"--job-name=pyr-{name}", f"--ntasks-per-node={NTASKS}", "--overcommit", f"--chdir={self.dir}",
            *sbatch_args,
            script_args=["--distributed", f"--exp_name={exp}", "--log-loss-to-csv", *script_flags, "--",
                         *TRAIN_FLAGS, "--dataset", corpus, "--checkpoint-dir", str(self.ckpt), *train_args],
            env={"PYTHON": PY, "PYRECOVER_STEP_SLEEP": str(sleep), "OMP_NUM_THREADS": "1"},
            cwd=ROOT,  # the submit directory: the batch script finds train.py there
        )
        SUBMITTED.append(self.id)

    def outputs(self) -> list[str]:
        """The job's output files in the working directory: %x-%j.out (one, requeues append to it), or %x-%A_%a.out
        for an array (one per task, in task order)."""
        files = sorted(self.dir.glob(f"pyr-{self.name}-*.out"),
                       key=lambda p: [int(x) for x in p.stem.rsplit("-", 1)[1].split("_")])
        return [f.read_text(errors="replace") for f in files]

    def output(self) -> str:
        return "\n".join(self.outputs())

    def rows(self) -> int:
        try:
            return max(0, len(self.csv.read_text().splitlines()) - 1)
        except FileNotFoundError:
            return 0

    def wait_rows(self, n: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while self.rows() < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: loss CSV has {self.rows()} rows, waited {timeout}s for {n}\n"
                                     f"{self.output()[-3000:]}")
            time.sleep(0.1)

    def wait_output(self, pattern: str, timeout: float = 60) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.output())
            if m:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: /{pattern}/ not in the job output after {timeout}s\n"
                                     f"{self.output()[-3000:]}")
            time.sleep(0.1)

    def csv_rows(self) -> list[dict]:
        with open(self.csv, newline="") as f:
            return list(csv.DictReader(f))


def stop_steps(out: str) -> list[tuple[int, int, str]]:
    """(rank, step, reason) of every 'saving and stopping' line, in order."""
    return [(int(r), int(s), why) for r, s, why in
            re.findall(r"rank (\d+): saving and stopping at step (\d+): (.*)", out)]


# ----------------------------------------------------------------------------------------------------------------------
# Scenario drivers (run concurrently in threads; each returns what its test asserts on)
# ----------------------------------------------------------------------------------------------------------------------


def drive_usr1(cluster, base: Path, corpus: str, name: str = "usr1", script_flags: tuple[str, ...] = ()) -> dict:
    """`scancel -s USR1` mid-run (the #SBATCH warning would come only after the run is over)."""
    job = Job(cluster, base, name, corpus, "--time=5", sleep=0.05, script_flags=script_flags)
    job.wait_rows(10, timeout=900)
    t0 = time.monotonic()
    cluster.scancel(job.id, signal="USR1")
    m = job.wait_output(r"checkpoint step (\d+) committed.*\n(?:.*\n)*?.*requeued job", timeout=60)
    saved_s = time.monotonic() - t0
    info = cluster.wait_for_state(job.id, "COMPLETED", timeout=900)
    timing(f"scancel -s USR1 -> checkpoint committed and job requeued in {saved_s:.1f}s; all done "
           f"{time.monotonic() - job.t_submit:.1f}s after submit")
    return {"job": job, "info": info, "saved_s": saved_s, "stop_match": m}


def drive_walltime(cluster, base: Path, corpus: str) -> dict:
    """No --signal at all: --timeaware-checkpointing reads the end time from squeue and stops in time (--no-requeue:
    exit 4, the batch script ends the job cleanly); then `submit-training-simple.sh --continue` finishes the run."""
    text = SCRIPT.read_text()
    assert "#SBATCH --signal=" in text
    script = "\n".join(line for line in text.splitlines() if not line.startswith("#SBATCH --signal")) + "\n"
    job = Job(cluster, base, "walltime", corpus, "--time=2", sleep=0.8, script=script,
              train_args=("--timeaware-checkpointing", "--walltime-margin-seconds", "75", "--no-requeue"))
    info = cluster.wait_for_state(job.id, "COMPLETED", timeout=900)
    stopped_rows = job.csv_rows()
    rest = Job(cluster, base, "walltime-continue", corpus, "--time=5", sleep=0.0, exp="walltime",
               script_flags=("--continue",))
    rest_info = cluster.wait_for_state(rest.id, "COMPLETED", timeout=900)
    timing(f"walltime stop + --continue job: all done {time.monotonic() - job.t_submit:.1f}s after submit")
    return {"job": job, "info": info, "stopped_rows": stopped_rows, "rest": rest, "rest_info": rest_info}


def drive_array(cluster, base: Path, corpus: str) -> dict:
    """--array=1-3%1: tasks 1 and 2 are stopped mid-run (USR1, like their time-limit warning), task 3 finishes."""
    job = Job(cluster, base, "array", corpus, "--array=1-3%1", "--time=5", "--output=%x-%A_%a.out", sleep=0.1)
    stopped_at = []
    for task in (1, 2):
        job.wait_rows((stopped_at[-1] if stopped_at else 0) + 15, timeout=900)  # task `task` is training
        # On this SLURM (22.05) `scancel -s USR1` of an array task delivers the signal but may exit 229
        # (ESLURM_ALREADY_DONE & 0xff); what counts is that the ranks log it (asserted in the test).
        proc = cluster.run("scancel", "-s", "USR1", f"{job.id}_{task}", check=False)
        assert proc.returncode in (0, 229), (proc.returncode, proc.stderr)
        cluster.wait_for_state(f"{job.id}_{task}", "COMPLETED", timeout=120)
        stopped_at.append(job.rows())
    infos = [cluster.wait_for_state(f"{job.id}_3", "COMPLETED", timeout=900)]
    timing(f"array of 3: all done {time.monotonic() - job.t_submit:.1f}s after submit, tasks 1/2 stopped at "
           f"{stopped_at}")
    return {"job": job, "info": infos[0], "stopped_at": stopped_at}


def drive_warning_then_kill(cluster, base: Path, corpus: str) -> dict:
    """The cluster itself, with plain shell jobs (no train.py): --signal=[B:]USR1@50 with --time=1, the warning before
    the time-limit kill. Job A uses ``B:`` (batch shell only); job B does not (srun tasks only, batch shell untouched).
    SLURM checks time limits and warning signals only every 30 s (PERIODIC_TIMEOUT), so with --time=1 the warning (due
    at 10 s) comes 10-40 s after start and SIGTERM 60-90 s after start: both jobs run beside the training jobs of this
    module to share the wait."""
    a_dir, b_dir = base / "warn-batch", base / "warn-steps"
    a_dir.mkdir()
    b_dir.mkdir()
    stamp = 'date +%s.%N >>'
    job_a = cluster.sbatch(
        f"""
{stamp} start
trap '{stamp} usr1' USR1
trap '{stamp} term; exit 0' TERM
while :; do sleep 0.1; done
""",
        "--time=1",
        "--signal=B:USR1@50",
        "--job-name=warn-batch",
        cwd=a_dir,
    )
    SUBMITTED.append(job_a)
    job_b = cluster.sbatch(
        f"""
{stamp} start
trap '{stamp} batch_usr1' USR1
trap '{stamp} batch_term; exit 0' TERM
srun bash -c 'trap "{stamp} step_usr1" USR1; trap "{stamp} step_term; exit 0" TERM; while :; do sleep 0.1; done'
""",
        "--time=1",
        "--signal=USR1@50",
        "--job-name=warn-steps",
        cwd=b_dir,
    )
    SUBMITTED.append(job_b)
    cluster.wait_for_state(job_a, {"RUNNING", "TIMEOUT"}, timeout=900)  # pending while the node is full
    info_a = cluster.wait_for_state(job_a, "TIMEOUT", timeout=150)
    info_b = cluster.wait_for_state(job_b, "TIMEOUT", timeout=150)
    return {"info_a": info_a, "info_b": info_b, "a_dir": a_dir, "b_dir": b_dir}


SCENARIOS = {
    "test_time_limit_warning_signal_then_kill": drive_warning_then_kill,
    "test_scancel_usr1_saves_requeues_and_resumes_bit_exact": drive_usr1,
    "test_walltime_aware_stop_without_signal_loses_no_step": drive_walltime,
    "test_job_array_of_three_chained_tasks_reaches_the_target_step": drive_array,
    "test_dcp_backend_from_the_submit_script_saves_requeues_and_resumes_latest_bit_exact":
        lambda cluster, base, corpus: drive_usr1(cluster, base, corpus, "usr1-dcp", ("--use_torch_distributed_ckpt",)),
}


class Campaign:
    def __init__(self, pool: ThreadPoolExecutor):
        self.pool = pool
        self.futures: dict[str, Future] = {}

    def result(self, name: str, timeout: float = 900):
        return self.futures[name].result(timeout=timeout)


def _reference(base: Path, corpus: str) -> Path:
    """The uninterrupted run: same flags, 2 ranks (torchrun, gloo), no pacing."""
    ck = base / "reference"
    proc = subprocess.run(torchrun_cmd(NTASKS, TRAIN_FLAGS + ["--dataset", corpus, "--checkpoint-dir", str(ck),
                                                              "--log-loss-to-csv"]),
                          capture_output=True, text=True, timeout=600, env=env_for_tests(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return ck / "default"


@pytest.fixture(scope="module")
def campaign(slurm_cluster, corpus, tmp_path_factory, request):
    selected = {item.name for item in request.session.items if item.module.__name__ == __name__}
    base = tmp_path_factory.mktemp("slurm-training")
    base.chmod(0o755)
    pool = ThreadPoolExecutor(max_workers=len(SCENARIOS) + 1)
    c = Campaign(pool)
    c.futures["reference"] = pool.submit(_reference, base, corpus)
    for name, drive in SCENARIOS.items():
        if name in selected:
            c.futures[name] = pool.submit(drive, slurm_cluster, base, corpus)
            time.sleep(1.0)  # submission order = start order on a full node
    yield c
    for job_id in SUBMITTED:  # whatever a failed test left running or pending
        slurm_cluster.run("scancel", str(job_id), check=False)
    pool.shutdown(wait=False, cancel_futures=True)


# ----------------------------------------------------------------------------------------------------------------------
# Shared assertions
# ----------------------------------------------------------------------------------------------------------------------


def assert_same_step_on_all_ranks(stops: list[tuple[int, int, str]], out: str) -> int:
    assert sorted(r for r, _, _ in stops) == list(range(NTASKS)), out[-4000:]
    steps = {s for _, s, _ in stops}
    assert len(steps) == 1, f"ranks stopped at different steps: {stops}"
    step = steps.pop()
    assert 0 < step < STEPS, stops
    assert f"checkpoint step {step} committed" in out
    return step


def assert_resumed_and_finished(job: Job, out: str, stop: int, reference: Path, runs: int) -> None:
    assert re.search(rf"resumed from \S*step-0*{stop} \(step {stop},", out), out[-4000:]
    assert "replica check: parameters identical across 2 ranks" in out
    assert out.rstrip().endswith("training finished"), out[-2000:]
    # Nothing lost, nothing redone: every step exactly once, the first run's rows end where it saved.
    rows = job.csv_rows()
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    first_run = [int(r["step"]) for r in rows if r["restart"] == "0"]
    assert first_run == list(range(1, stop + 1))
    assert {r["restart"] for r in rows} == {str(i) for i in range(runs)}, out[-4000:]
    assert loss_rows(job.csv) == loss_rows(reference / "loss.csv")
    cmp = check_weights(reference, job.run_dir, "--tolerance", "0", "--optimizer")
    assert cmp.returncode == 0 and "bitwise" in cmp.stdout, cmp.stdout + cmp.stderr


# ----------------------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------------------


def test_scancel_usr1_saves_requeues_and_resumes_bit_exact(campaign):
    r = campaign.result("test_scancel_usr1_saves_requeues_and_resumes_bit_exact")
    job, info = r["job"], r["info"]
    out = job.output()
    assert info.get("Restarts") == "1" and info.get("ExitCode") == "0:0", info
    first = out.split("requeued run (SLURM_RESTART_COUNT=1)", 1)[0]
    step = assert_same_step_on_all_ranks(stop_steps(first), first)
    # stopped after the signal (sent at row 10), before the end; how many seconds that took is printed
    # ([slurm-timing]), not asserted: a loaded CI machine is no benchmark
    assert 10 <= step < STEPS, step
    for rank in range(NTASKS):  # scancel -s USR1 signals every task of the step
        assert re.search(rf"rank {rank}: (also )?received SIGUSR1", first), first[-4000:]
    assert_resumed_and_finished(job, out, step, campaign.result("reference"), runs=2)


def test_walltime_aware_stop_without_signal_loses_no_step(campaign):
    r = campaign.result("test_walltime_aware_stop_without_signal_loses_no_step")
    job, info, rest = r["job"], r["info"], r["rest"]
    out = job.output()
    assert info.get("ExitCode") == "0:0" and info.get("Restarts", "0") == "0", info  # ended by itself, before the kill
    assert not re.search(r"rank \d+: received SIG", out)  # no signal was configured: the deadline stopped it
    assert re.search(rf"walltime: deadline \S+ \(\d+s from now\) from squeue \(job {job.id}\)", out), out[-3000:]
    stops = stop_steps(out)
    step = assert_same_step_on_all_ranks(stops, out)
    why = {rk: w for rk, _, w in stops}
    m = re.match(r"walltime: ([\d.]+)s left before the deadline from squeue .*< ([\d.]+)s needed", why[0])
    # stopped with time to spare; `<=`: both figures are printed rounded to 0.1 s (CI saw "78.5s left, < 78.5s needed")
    assert m and 0 < float(m.group(1)) <= float(m.group(2)), why
    assert why[1] == "walltime (decided on rank 0)"
    assert "not requeueing: --no-requeue" in out and "train.py exit code 4" in out
    # Zero steps lost: the last step trained is the step saved.
    assert [int(x["step"]) for x in r["stopped_rows"]] == list(range(1, step + 1))
    rest_out = rest.output()
    assert r["rest_info"].get("ExitCode") == "0:0", r["rest_info"]
    assert_resumed_and_finished(rest, rest_out, step, campaign.result("reference"), runs=2)


def test_job_array_of_three_chained_tasks_reaches_the_target_step(campaign):
    r = campaign.result("test_job_array_of_three_chained_tasks_reaches_the_target_step")
    job = r["job"]
    tasks = job.outputs()
    assert [re.search(r"run 1 of job \d+ \(array task (\d)\)", t).group(1) for t in tasks] == ["1", "2", "3"], tasks
    previous = 0
    for i, text in enumerate(tasks[:2]):
        step = assert_same_step_on_all_ranks(stop_steps(text), text)
        assert "not requeueing: job array task" in text, text[-2000:]  # the next task continues instead
        assert "train.py exit code 4" in text and "stopped with the state saved, not requeued" in text
        if i:
            assert re.search(rf"resumed from \S*step-0*{previous} \(step {previous},", text), text[-3000:]
        assert step > previous
        previous = step
    assert "job array task 3: resuming from latest" in tasks[2]
    assert re.search(rf"resumed from \S*step-0*{previous} \(step {previous},", tasks[2])
    assert not stop_steps(tasks[2]) and tasks[2].rstrip().endswith("training finished")
    rows = job.csv_rows()
    assert [int(x["step"]) for x in rows] == list(range(1, STEPS + 1))  # the target step, every step once
    assert [x["restart"] for x in rows][0] == "0" and rows[-1]["restart"] == "2"
    reference = campaign.result("reference")
    assert loss_rows(job.csv) == loss_rows(reference / "loss.csv")
    cmp = check_weights(reference, job.run_dir, "--tolerance", "0", "--optimizer")
    assert cmp.returncode == 0 and "bitwise" in cmp.stdout, cmp.stdout + cmp.stderr


def test_dcp_backend_from_the_submit_script_saves_requeues_and_resumes_latest_bit_exact(campaign):
    """`sbatch submit-training-simple.sh --use_torch_distributed_ckpt`: every rank writes its DCP shard, the requeued
    run resumes `latest` through DCP, and ends bitwise equal to the (vanilla-format) uninterrupted reference."""
    r = campaign.result("test_dcp_backend_from_the_submit_script_saves_requeues_and_resumes_latest_bit_exact")
    job, info = r["job"], r["info"]
    out = job.output()
    assert info.get("Restarts") == "1" and info.get("ExitCode") == "0:0", info
    assert "--use-torch-distributed-ckpt" in out and "dcp backend" in out, out[-3000:]
    first = out.split("requeued run (SLURM_RESTART_COUNT=1)", 1)[0]
    step = assert_same_step_on_all_ranks(stop_steps(first), first)
    shards = sorted(p.name for p in (job.run_dir / f"step-{STEPS:08d}").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"], shards
    assert_resumed_and_finished(job, out, step, campaign.result("reference"), runs=2)


def read_floats(path: Path) -> list[float]:
    return [float(x) for x in path.read_text().split()] if path.exists() else []


def test_time_limit_warning_signal_then_kill(campaign):
    """--signal=[B:]USR1@50 with --time=1: the warning arrives before the time-limit kill, to the batch shell only with
    ``B:``, to the srun tasks only without (drive_warning_then_kill)."""
    r = campaign.result("test_time_limit_warning_signal_then_kill")
    info_a, info_b, a_dir, b_dir = r["info_a"], r["info_b"], r["a_dir"], r["b_dir"]
    start_a, usr1_a, term_a = (read_floats(a_dir / n) for n in ("start", "usr1", "term"))
    assert start_a and len(usr1_a) == 1 and len(term_a) == 1, (start_a, usr1_a, term_a, info_a)
    assert start_a[0] < usr1_a[0] < term_a[0]
    timing(
        f"--time=1 --signal=B:USR1@50: warning {usr1_a[0] - start_a[0]:.1f}s after start, "
        f"SIGTERM {term_a[0] - start_a[0]:.1f}s after start ({term_a[0] - usr1_a[0]:.1f}s after the warning)"
    )

    start_b = read_floats(b_dir / "start")
    step_usr1, step_term = read_floats(b_dir / "step_usr1"), read_floats(b_dir / "step_term")
    assert not (b_dir / "batch_usr1").exists(), "without B: the batch shell must not get the warning signal"
    # At the time limit the srun task's SIGTERM can come twice, milliseconds apart: from its slurmstepd and again from
    # srun, which forwards the SIGTERM it got with the batch step (CI saw 2.5 ms; the trap's `exit 0` usually wins the
    # race). So a job's SIGTERM handler must be idempotent (checkpoint/policy.py: a set of received signals).
    assert len(step_usr1) == 1 and len(step_term) in (1, 2), (step_usr1, step_term, info_b)
    assert step_term[-1] - step_term[0] < 5, step_term
    assert start_b[0] < step_usr1[0] < step_term[0]
    timing(
        f"--time=1 --signal=USR1@50 (steps): warning {step_usr1[0] - start_b[0]:.1f}s after start, "
        f"SIGTERM {step_term[0] - start_b[0]:.1f}s after start"
    )
    # The warning has no lower bound: sbatch(1) says it "may be sent up to 60 seconds earlier than specified", and the
    # first 30 s check can come right after the start. The kill is measured from SLURM's own StartTime (whole seconds;
    # the script's first `date` can run seconds later on a loaded machine): never before the 60 s limit.
    for info, start, warn, term in ((info_a, start_a[0], usr1_a[0], term_a[0]),
                                    (info_b, start_b[0], step_usr1[0], step_term[0])):
        slurm_start = time.mktime(time.strptime(info["StartTime"], "%Y-%m-%dT%H:%M:%S"))
        assert warn - start <= 45, (warn - start)
        assert 59 <= term - slurm_start <= 100, (term - slurm_start, info["StartTime"])  # 1 s: StartTime resolution
