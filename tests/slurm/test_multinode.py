"""Two SLURM nodes, one rank on each: submit-training-simple.sh across real TCP between network namespaces, and what
happens when a whole node is lost or cut off.

The cluster (fixture ``slurm_multinode``, ``cluster.sh start --nodes 17``) emulates each node by a slurmd in its own
network, UTS and mount namespace: its own hostname and IP on a private bridge, its own node-local $TMPDIR; the
checkpoint directory is on the shared filesystem. The scenarios run side by side, each on its own nodes (a node loss
must hit only its own job), each driven by a thread; the uninterrupted reference run (torchrun, 2 ranks) runs beside
them. Every scenario ends bitwise equal to the reference (weights, optimizer, loss rows).

Node faults are whole-node: ``kill-node`` SIGKILLs every process of the node's namespace (slurmd, slurmstepd, the rank),
``cut-node`` takes its link down (its processes keep running, unreachable); ``wipe-scratch`` after ``kill-node`` loses
the node's disk too. SLURM notices a silent node after SlurmdTimeout (10 s here; ~30 s until it is DOWN), ends the job
with NODE_FAIL and requeues it (--requeue) -- onto a spare node where the job may run on any 2 of 3.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import PY, csv_rows  # noqa: E402
from test_training import (  # noqa: E402  one job class and one set of assertions for 1 and 2 nodes
    STEPS,
    Job,
    _reference,
    assert_resumed_and_finished,
    assert_same_step_on_all_ranks,
    stop_steps,
    timing,
)

pytestmark = pytest.mark.slurm

ONE_RANK_PER_NODE = ("--nodes=2", "--ntasks-per-node=1")
KILL_AT_ROW = 30  # after the periodic checkpoint of step 25 (test_training.TRAIN_FLAGS), well before step 50
# node and scratch loss: past the shared tier's step 20, between two local saves (every 2 steps)
SCRATCH_LOSS_AT_ROW = 27
MINE: list[int] = []

# PYTHON for the node-loss jobs: train.py as usual (output to the job), plus its exit code and a copy of its output in
# the shared work dir, so the test can read them for a rank whose node is cut off (its output never reaches srun).
WRAPPER = """#!/bin/bash
trap : USR1 USR2 TERM
n=${{SLURM_RESTART_COUNT:-0}}-${{SLURM_PROCID}}
if [ "${{SLURM_RESTART_COUNT:-0}}" -ge 1 ]; then set -- "$@" {requeued_args}; fi
"{py}" "$@" > >(trap '' USR1 USR2 TERM; exec tee -a "{work}/rank-$n.log") 2>&1
rc=$?
echo $rc > "{work}/rc-$n"
exit $rc
"""


def submit(cluster, base: Path, name: str, corpus: str, *sbatch_args: str, sleep: float,
           train_args: tuple[str, ...] = (), script_flags: tuple[str, ...] = (), wrap: bool = False,
           requeued_args: tuple[str, ...] = ()) -> Job:
    """submit-training-simple.sh --distributed on 2 nodes, 1 rank each (test_training.Job, whose `--ntasks-per-node=2`
    the later option overrides). With `wrap`, each rank runs through a wrapper that logs it and keeps its exit code;
    `requeued_args` are appended to train.py's arguments in requeued runs only (the last occurrence of a flag wins)."""
    extra: tuple[str, ...] = ()
    ranks = base / f"{name}-ranks"
    if wrap:
        ranks.mkdir()
        wrapper = ranks / "python.sh"
        wrapper.write_text(WRAPPER.format(py=PY, work=ranks, requeued_args=" ".join(map(shlex.quote, requeued_args))))
        wrapper.chmod(0o755)
        extra = (f"--export=ALL,PYTHON={wrapper}",)  # wins over the PYTHON that Job puts in the environment
    job = Job(cluster, base, name, corpus, *ONE_RANK_PER_NODE, *extra, *sbatch_args, sleep=sleep,
              train_args=train_args, script_flags=script_flags)
    job.ranks = ranks
    MINE.append(job.id)
    return job


def wait_for(cond, what: str, timeout: float = 300, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(poll)


def restarts(cluster, job: Job) -> int:
    return int(cluster.job_info(job.id).get("Restarts", "0") or 0)


def nodes_of(cluster, job: Job) -> list[str]:
    """The job's nodes in rank order (one rank per node: rank r runs on the r-th node of the list)."""
    nodelist = cluster.job_info(job.id).get("NodeList", "")
    return cluster.run("scontrol", "show", "hostnames", nodelist).stdout.split()


# ----------------------------------------------------------------------------------------------------------------------
# Scenario drivers
# ----------------------------------------------------------------------------------------------------------------------


def drive_time_limit(cluster, base: Path, corpus: str, name: str, flags: tuple[str, ...] = ()) -> dict:
    """--time=1 --signal=USR1@15 on pyr-node[1-2]: the warning reaches both ranks, they save the same step, the job
    requeues itself and the rerun resumes across both nodes again."""
    job = submit(cluster, base, name, corpus, "--nodelist=pyr-node[1-2]", "--time=1", "--signal=USR1@15", sleep=0.8,
                 script_flags=flags)
    cluster.wait_for_state(job.id, "RUNNING", timeout=600)
    first_nodes = nodes_of(cluster, job)
    t0 = time.monotonic()
    wait_for(lambda: restarts(cluster, job) >= 1, f"{name}: the requeue\n{job.output()[-3000:]}")
    t_requeued = time.monotonic() - t0
    cluster.run("scontrol", "update", f"JobId={job.id}", "TimeLimit=5")  # the rerun is not warned again
    info = cluster.wait_for_state(job.id, "COMPLETED", timeout=600)
    timing(f"2 nodes, time limit ({name}): requeued {t_requeued:.1f}s after start, done "
           f"{time.monotonic() - job.t_submit:.1f}s after submit")
    return {"job": job, "info": info, "nodes": first_nodes}


def drive_node_loss(cluster, base: Path, corpus: str, name: str, nodes: str, jit: bool) -> dict:
    """Kill every process of the second node mid-run; SLURM requeues the job (NODE_FAIL); the node comes back; the
    rerun resumes -- from the JIT save of the last completed step, or without JIT from the last periodic one."""
    job = submit(cluster, base, name, corpus, f"--nodelist={nodes}", "--time=5", sleep=0.3, wrap=True,
                 train_args=("--jit-checkpoint",) if jit else ())
    job.wait_rows(KILL_AT_ROW, timeout=600)
    victim = nodes_of(cluster, job)[1]
    cluster.node_sh("kill-node", victim)
    killed_at = job.rows()
    t0 = time.monotonic()
    wait_for(lambda: restarts(cluster, job) >= 1, f"{name}: SLURM to requeue after the node loss", timeout=300)
    t_requeued = time.monotonic() - t0
    cluster.node_sh("start-node", victim)
    info = cluster.wait_for_state(job.id, "COMPLETED", timeout=600)
    timing(f"node loss ({name}): job requeued {t_requeued:.1f}s after the node died, done "
           f"{time.monotonic() - job.t_submit:.1f}s after submit")
    return {"job": job, "info": info, "victim": victim, "killed_at": killed_at}


def drive_tiered_whole_job_kill(cluster, base: Path, corpus: str) -> dict:
    """A node-local tier in each node's own scratch folder (the same path, another disk on every node): local saves
    every 2 steps, shared every 20. First rank 1's process is SIGKILLed at a seeded row before the first shared save
    (a crash, the nodes stay): the script runs the ranks again in the same allocation, and they resume from their local
    tiers. Later both nodes lose every process (a whole-job SIGKILL); SLURM requeues the job onto them; each rank
    resumes from its own node's local tier again."""
    seed = int(os.environ.get("PYRECOVER_TEST_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    crash_row, row = rng.randint(5, 15), rng.randint(25, 40)
    local = cluster.state_dir / "scratch" / "tier"
    job = submit(cluster, base, "mn-tiered", corpus, "--nodelist=pyr-node[10-11]", "--time=5", sleep=0.3,
                 train_args=("--local-checkpoint-dir", str(local), "--local-checkpoint-frequency", "2",
                             "--checkpoint-frequency", "20"))
    job.wait_rows(crash_row, timeout=600)
    nodes = nodes_of(cluster, job)
    _signal(wait_for(lambda: cluster.task_pids(nodes[1], job.id), "rank 1's process"), signal.SIGKILL)
    crashed_at = job.rows()
    wait_for(lambda: "restarting in this allocation" in job.output(), f"the in-allocation restart\n"
             f"{job.output()[-3000:]}", timeout=120)
    job.wait_rows(row, timeout=600)
    for node in nodes:
        cluster.node_sh("kill-node", node)
    killed_at = job.rows()
    for node in nodes:
        cluster.node_sh("start-node", node)
    info = cluster.wait_for_state(job.id, "COMPLETED", timeout=600)
    timing(f"tiered crash (row {crash_row}) and whole-job kill (row {row}), seed {seed}: done "
           f"{time.monotonic() - job.t_submit:.1f}s after submit")
    return {"job": job, "info": info, "crashed_at": crashed_at, "killed_at": killed_at, "seed": seed}


def drive_node_and_scratch_loss(cluster, base: Path, corpus: str, name: str, nodes: list[str], peer: bool) -> dict:
    """A local tier in each node's scratch (every 2 steps; the shared tier every 20), the job free to run on any 2 of
    its 3 `nodes`. After the shared step 20, rank 1's node loses every process and its scratch (a dead node, disk and
    all); SLURM requeues the job onto the survivor and the spare -- the dead node stays down until the job is done.
    With `peer` (--peer-checkpoint) the survivor holds a copy of the dead node's local steps, so the rerun resumes from
    the newest local step; without, from the shared tier's step 20."""
    others = [n for n in cluster.nodes if n not in nodes]
    local = cluster.state_dir / "scratch" / "tier"
    job = submit(cluster, base, name, corpus, f"--exclude={','.join(others)}", "--time=5", sleep=0.3,
                 train_args=("--local-checkpoint-dir", str(local), "--local-checkpoint-frequency", "2",
                             "--checkpoint-frequency", "20", *(("--peer-checkpoint",) if peer else ())))
    job.wait_output(r"checkpoint step 20 committed in the shared tier", timeout=600)
    job.wait_rows(SCRATCH_LOSS_AT_ROW, timeout=600)
    first_nodes = nodes_of(cluster, job)
    victim = first_nodes[1]
    try:
        cluster.node_sh("kill-node", victim)
        killed_at = job.rows()
        scratch = cluster.scratch(victim)
        held = sorted(str(p.relative_to(scratch)) for p in scratch.rglob("rank-*") if p.is_dir())
        cluster.node_sh("wipe-scratch", victim)
        left = sorted(p.name for p in scratch.iterdir())
        t0 = time.monotonic()
        wait_for(lambda: restarts(cluster, job) >= 1, f"{name}: SLURM to requeue after the node loss", timeout=300)
        t_requeued = time.monotonic() - t0
        # what survived the loss, taken while the requeued job is held (~11 s) and the first run's ranks are gone
        survivor = first_nodes[0]
        wait_for(lambda: not cluster.task_pids(survivor, job.id), f"{name}: the survivor's rank to end", timeout=60)
        survived = _committed_parts(cluster.scratch(survivor))
        info = cluster.wait_for_state(job.id, "COMPLETED", timeout=600)
        new_nodes = nodes_of(cluster, job)
    finally:
        cluster.node_sh("start-node", victim)
    timing(f"node and scratch loss ({name}): killed at row {killed_at}, requeued {t_requeued:.1f}s after the node "
           f"died, done {time.monotonic() - job.t_submit:.1f}s after submit")
    return {"job": job, "info": info, "victim": victim, "killed_at": killed_at, "pool": nodes, "nodes": first_nodes,
            "new_nodes": new_nodes, "held": held, "left": left, "survived": survived}


def _committed_parts(scratch: Path) -> dict[int, set[int]]:
    """Rank -> the steps of that rank's part committed in a node's scratch: its own local tier folders and the peer
    copies it keeps for other nodes (checkpoint/tier.py, checkpoint/peer.py)."""
    parts: dict[int, set[int]] = {}
    for marker in scratch.glob("tier/*/**/rank-*/step-*/COMMITTED"):
        step_dir = marker.parent
        parts.setdefault(int(step_dir.parent.name.split("-")[1]), set()).add(int(step_dir.name.split("-")[1]))
    return parts


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.lstat().st_size if p.is_file() else 0, p.lstat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def drive_partition(cluster, base: Path, corpus: str) -> dict:
    """Cut the link of rank 1's node; its rank keeps running but is frozen (SIGSTOP) so that it wakes only once the
    requeued job (on the two other nodes of pyr-node[7-9]) has taken the run directory over and committed a checkpoint.
    Then the new incarnation is frozen and the stale rank woken: its collective times out, --jit-checkpoint makes it
    try to save -- it must be fenced (exit 6) and leave the run directory exactly as it was."""
    # The stale rank's 60 s collective timeout has long passed when it wakes. The requeued incarnation sits frozen
    # while the stale rank wakes, fails and is fenced; on a loaded machine that took over 60 s, so the requeued runs
    # get a longer timeout of their own: with 60 s their frozen collective timed out too and a third run appeared.
    # --time=10: the frozen incarnation must not reach its own USR1 warning either.
    # pyr-node[7-9] only: the tiered scenario kills pyr-node[10-11], which must not take this job's ranks with them
    job = submit(cluster, base, "partition", corpus, "--exclude=pyr-node[1-6,10-11]", "--time=10", sleep=0.3, wrap=True,
                 train_args=("--jit-checkpoint", "--pg-timeout-seconds", "60"),
                 requeued_args=("--pg-timeout-seconds", "900"))
    job.wait_rows(KILL_AT_ROW, timeout=600)
    nodes = nodes_of(cluster, job)
    cut = nodes[1]
    stale = wait_for(lambda: cluster.task_pids(cut, job.id), "rank 1's processes")
    _signal(stale, signal.SIGSTOP)
    cluster.node_sh("cut-node", cut)
    t0 = time.monotonic()
    new_pids: list[int] = []
    try:
        wait_for(lambda: restarts(cluster, job) >= 1, "SLURM to requeue after the partition", timeout=300)
        t_requeued = time.monotonic() - t0
        info = cluster.wait_for_state(job.id, "RUNNING", timeout=300)
        new_nodes = nodes_of(cluster, job)
        job.wait_output(r"checkpoint step 50 committed", timeout=300)
        new_pids = [p for n in new_nodes for p in cluster.task_pids(n, job.id)]
        _signal(new_pids, signal.SIGSTOP)
        before = _snapshot(job.run_dir)
        _signal(stale, signal.SIGCONT)
        rc_file = job.ranks / "rc-0-1"
        wait_for(lambda: rc_file.exists() and rc_file.read_text().strip(), "the stale rank to exit", timeout=120)
        after = _snapshot(job.run_dir)
    finally:
        _signal(stale, signal.SIGCONT)
        _signal(new_pids, signal.SIGCONT)
        cluster.node_sh("mend-node", cut)
    info = cluster.wait_for_state(job.id, "COMPLETED", timeout=600)
    timing(f"partition: requeued {t_requeued:.1f}s after the cut, done {time.monotonic() - job.t_submit:.1f}s after "
           f"submit")
    return {"job": job, "info": info, "nodes": nodes, "new_nodes": new_nodes, "before": before, "after": after,
            "stale_rc": rc_file.read_text().strip(), "stale_log": (job.ranks / "rank-0-1.log").read_text()}


SCENARIOS = {
    "test_two_nodes_time_limit_requeue_resume_bit_exact":
        lambda c, b, k: drive_time_limit(c, b, k, "mn-limit"),
    "test_two_nodes_dcp_time_limit_requeue_resume_bit_exact":
        lambda c, b, k: drive_time_limit(c, b, k, "mn-limit-dcp", ("--use_torch_distributed_ckpt",)),
    "test_node_loss_with_jit_resumes_from_the_last_completed_step":
        lambda c, b, k: drive_node_loss(c, b, k, "mn-loss-jit", "pyr-node[3-4]", jit=True),
    "test_node_loss_without_jit_resumes_from_the_last_periodic_checkpoint":
        lambda c, b, k: drive_node_loss(c, b, k, "mn-loss", "pyr-node[5-6]", jit=False),
    "test_partitioned_rank_is_fenced_and_changes_nothing": drive_partition,
    "test_whole_job_kill_with_a_local_tier_per_node_resumes_from_the_local_tiers": drive_tiered_whole_job_kill,
    "test_lost_node_and_scratch_peer_copy_resumes_from_the_newest_local_step_on_the_spare":
        lambda c, b, k: drive_node_and_scratch_loss(c, b, k, "mn-peer", ["pyr-node12", "pyr-node13", "pyr-node14"],
                                                    peer=True),
    "test_lost_node_and_scratch_without_peer_copy_resumes_from_the_shared_step_on_the_spare":
        lambda c, b, k: drive_node_and_scratch_loss(c, b, k, "mn-nopeer", ["pyr-node15", "pyr-node16", "pyr-node17"],
                                                    peer=False),
}
# Scenarios that start only once another has finished: the partition scenario freezes a fresh incarnation for the
# stale rank's whole collective timeout, and the extra load of the tiered scenario's kills and restarts beside it
# pushed that frozen incarnation past its own timeout (a third run).
AFTER = {"test_whole_job_kill_with_a_local_tier_per_node_resumes_from_the_local_tiers":
         "test_partitioned_rank_is_fenced_and_changes_nothing"}


@pytest.fixture(scope="module")
def campaign(slurm_multinode, corpus, tmp_path_factory, request):
    selected = {item.name for item in request.session.items if item.module.__name__ == __name__}
    base = tmp_path_factory.mktemp("slurm-multinode")
    base.chmod(0o755)
    pool = ThreadPoolExecutor(max_workers=len(SCENARIOS) + 1)
    futures = {"reference": pool.submit(_reference, base, corpus)}
    for name, drive in SCENARIOS.items():
        if name in selected and name not in AFTER:
            futures[name] = pool.submit(drive, slurm_multinode, base, corpus)

    def after(first: str, drive):
        if first in futures:
            futures[first].exception()  # finished, however it ended
        return drive(slurm_multinode, base, corpus)

    for name, first in AFTER.items():
        if name in selected:
            futures[name] = pool.submit(after, first, SCENARIOS[name])
    yield lambda name: futures[name].result(timeout=900)
    for job_id in MINE:  # whatever a failed test left running or pending
        slurm_multinode.run("scancel", str(job_id), check=False)
    pool.shutdown(wait=False, cancel_futures=True)


# ----------------------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------------------


def test_node_local_scratch_and_hostnames(slurm_multinode, tmp_path):
    """Each node has its own hostname and IP, and its own $TMPDIR that the other node's tasks cannot see."""
    tmp_path.chmod(0o755)
    script = ('srun bash -c \'touch "$TMPDIR/mine-$SLURM_PROCID"; sleep 1; '
              'echo "task $SLURM_PROCID host $(hostname) ip $(hostname -i) tmp $TMPDIR has $(ls $TMPDIR | tr "\\n" " ")"; '
              'rm "$TMPDIR/mine-$SLURM_PROCID"\'\n')
    job = slurm_multinode.sbatch(script, *ONE_RANK_PER_NODE, "--nodelist=pyr-node[1-2]", f"--output={tmp_path}/o",
                                 cwd=tmp_path)
    MINE.append(job)
    slurm_multinode.wait_for_state(job, "COMPLETED", timeout=300)
    lines = sorted(re.findall(r"task (\d) host (\S+) ip (\S+) tmp (\S+) has (.*)", (tmp_path / "o").read_text()))
    assert [(t, h) for t, h, *_ in lines] == [("0", "pyr-node1"), ("1", "pyr-node2")], lines
    assert lines[0][2] != lines[1][2], lines  # two addresses
    assert lines[0][3] == lines[1][3] and lines[0][3] != "/tmp", lines  # same path, and not the machine's /tmp ...
    assert [x[4].split() for x in lines] == [["mine-0"], ["mine-1"]], lines  # ... but each node sees only its own


def test_two_nodes_time_limit_requeue_resume_bit_exact(campaign):
    r = campaign("test_two_nodes_time_limit_requeue_resume_bit_exact")
    _check_time_limit(r, campaign("reference"))


def test_two_nodes_dcp_time_limit_requeue_resume_bit_exact(campaign):
    r = campaign("test_two_nodes_dcp_time_limit_requeue_resume_bit_exact")
    out = _check_time_limit(r, campaign("reference"))
    assert "dcp backend" in out, out[-3000:]
    shards = sorted(p.name for p in (r["job"].run_dir / f"step-{STEPS:08d}").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"], shards  # each node's rank wrote its own shard


def _check_time_limit(r: dict, reference: Path) -> str:
    job, info = r["job"], r["info"]
    out = job.output()
    assert info.get("Restarts") == "1" and info.get("ExitCode") == "0:0", info
    assert r["nodes"] == ["pyr-node1", "pyr-node2"], r["nodes"]
    # the rendezvous comes from the node list: the master is the first node, reached from the second over TCP
    assert re.search(r"job \d+: 2 ranks on 2 node\(s\), master pyr-node1:\d+", out), out[:2000]
    first, second = out.split("requeued run (SLURM_RESTART_COUNT=1): resuming from latest", 1)
    for rank in range(2):  # SLURM's warning (no B:) reached both nodes' ranks (maybe after the others agreed)
        assert re.search(rf"rank {rank}: (also )?received SIGUSR1", first), first[-4000:]
    stops = stop_steps(first)
    step = assert_same_step_on_all_ranks(stops, first)
    assert {why for _, _, why in stops} <= {"received SIGUSR1", "another rank received a stop signal"}, stops
    assert "received SIGUSR1" in {why for _, _, why in stops}, stops
    assert re.search(rf"stopped at step {step} of {STEPS}, checkpoint committed; requeued job {job.id} "
                     r"\(restart 1 of at most \d+\)", first), first[-3000:]
    assert not stop_steps(second)  # the rerun (its limit raised) is not warned again
    assert re.search(r"job \d+: 2 ranks on 2 node\(s\), master pyr-node1:\d+", second), second[:2000]
    assert_resumed_and_finished(job, out, step, reference, runs=2)
    return out


def _node_lost_then_requeued(campaign, name: str):
    """The scenario's result, its job and output, and the output before the requeue: the job ended well after one
    requeue, and SLURM saw the node fail."""
    r = campaign(name)
    job, info = r["job"], r["info"]
    out = job.output()
    assert info.get("ExitCode") == "0:0" and int(info.get("Restarts", 0)) >= 1, info
    first = out.split("requeued run (SLURM_RESTART_COUNT=1)", 1)[0]
    assert re.search(rf"Node failure on {r['victim']}|NODE FAILURE", first), first[-3000:]
    return r, job, out, first


def test_node_loss_with_jit_resumes_from_the_last_completed_step(campaign):
    r, job, out, first = _node_lost_then_requeued(campaign, "test_node_loss_with_jit_resumes_from_the_last_completed_step")
    m = re.search(r"jit: rank 0 saved step (\d+) to \S+", first)
    assert m, first[-4000:]
    saved = int(m.group(1))
    # the survivor saved the last step completed when the node died: at most the step in flight is replayed
    assert KILL_AT_ROW <= r["killed_at"] <= saved + 1 and saved < STEPS, (r["killed_at"], saved)
    assert_resumed_and_finished(job, out, saved, campaign("reference"), runs=2)


def test_node_loss_without_jit_resumes_from_the_last_periodic_checkpoint(campaign):
    _, job, out, first = _node_lost_then_requeued(
        campaign, "test_node_loss_without_jit_resumes_from_the_last_periodic_checkpoint")
    assert "jit:" not in first and "checkpoint step 25 committed" in first, first[-3000:]
    # the steps after the periodic checkpoint are redone; the loss CSV keeps each step once
    assert_resumed_and_finished(job, out, 25, campaign("reference"), runs=2)


def test_partitioned_rank_is_fenced_and_changes_nothing(campaign):
    r = campaign("test_partitioned_rank_is_fenced_and_changes_nothing")
    job, info = r["job"], r["info"]
    assert info.get("ExitCode") == "0:0" and int(info.get("Restarts", 0)) >= 1, info
    assert r["nodes"][1] not in r["new_nodes"], (r["nodes"], r["new_nodes"])  # the rerun ran without the cut node
    before, after = r["before"], r["after"]
    assert after == before, {k: (before.get(k), after.get(k)) for k in set(before) | set(after)
                             if before.get(k) != after.get(k)}
    log = r["stale_log"]
    assert "fenced" in log.lower() and "Traceback" not in log, log[-3000:]
    assert r["stale_rc"] == "6", log[-3000:]
    out = job.output()
    assert re.search(rf"requeued SLURM job {job.id} \(restart 1\) fences generation", out), out[-3000:]
    # from the periodic checkpoint, or from a JIT save if rank 0's collective timed out before SLURM ended it
    resumed = int(re.search(r"resumed from \S*step-0*(\d+) \(step", out).group(1))
    assert 25 <= resumed < 50, resumed
    assert_resumed_and_finished(job, out, resumed, campaign("reference"), runs=2)
    assert csv_rows(job.csv) == STEPS


def test_whole_job_kill_with_a_local_tier_per_node_resumes_from_the_local_tiers(campaign):
    r = campaign("test_whole_job_kill_with_a_local_tier_per_node_resumes_from_the_local_tiers")
    job, info = r["job"], r["info"]
    out = job.output()
    assert info.get("ExitCode") == "0:0" and int(info.get("Restarts", 0)) >= 1, info
    crash, kill = out.split("requeued run (SLURM_RESTART_COUNT=1)", 1)
    # the crash: no requeue, the same allocation, both ranks from their local tiers (no shared step before 20)
    before, again = crash.split("a rank failed: restarting in this allocation from latest (1 of 2)", 1)
    assert "train.py exit code 0" not in before, before[-3000:]
    m = re.search(r"resumed from \S+ \(step (\d+), vanilla backend; 2 of 2 ranks from their local tier", again)
    assert m, (r["seed"], again[-4000:])
    first = int(m.group(1))
    assert first < 20 and 0 <= r["crashed_at"] - first <= 3, (r["seed"], first, r["crashed_at"])
    # the whole-job kill: requeued onto the same nodes, the newest local step (every 2), newer than the shared tier's
    m = re.search(r"resumed from \S+ \(step (\d+), vanilla backend; 2 of 2 ranks from their local tier", kill)
    assert m, (r["seed"], kill[-4000:])
    step = int(m.group(1))
    assert 20 < step <= r["killed_at"] and r["killed_at"] - step <= 3, (r["seed"], step, r["killed_at"])
    assert f"checkpoint step {step} committed in the shared tier" in kill  # drained right after the restore
    assert_resumed_and_finished(job, out, first, campaign("reference"), runs=3)


def _lost_node_and_scratch(campaign, name: str) -> tuple[dict, str, str]:
    """The scenario's result, the output before and after the requeue: the dead node's scratch held its rank's local
    tier and was emptied, the job was requeued once onto the survivor and the spare, and it ended well."""
    r = campaign(name)
    job, info = r["job"], r["info"]
    out = job.output()
    assert info.get("ExitCode") == "0:0" and int(info.get("Restarts", 0)) >= 1, info
    assert any(h.endswith("rank-00001") for h in r["held"]) and r["left"] == [], (r["held"], r["left"])
    # the rerun: the survivor and the spare
    assert set(r["new_nodes"]) == set(r["pool"]) - {r["victim"]}, (r["nodes"], r["victim"], r["new_nodes"])
    first, rerun = out.split("requeued run (SLURM_RESTART_COUNT=1)", 1)
    assert re.search(rf"Node failure on {r['victim']}|NODE FAILURE", first), first[-3000:]
    return r, first, rerun


def test_lost_node_and_scratch_peer_copy_resumes_from_the_newest_local_step_on_the_spare(campaign):
    r, first, rerun = _lost_node_and_scratch(
        campaign, "test_lost_node_and_scratch_peer_copy_resumes_from_the_newest_local_step_on_the_spare")
    job, killed_at = r["job"], r["killed_at"]
    held = r["held"]
    assert any(re.search(r"/peer/rank-00000$", h) for h in held), held  # the dead node held its buddy's steps too
    m = re.search(r"resumed from \S+ \(step (\d+), vanilla backend; 2 of 2 ranks from their local tier \(1 from a peer "
                  r"copy\)", rerun)
    assert m, rerun[-4000:]
    step = int(m.group(1))
    # the newest step whose every part survived on the survivor (the spare has nothing): its own local tier and the
    # peer copies of the dead node's rank, which, sent in the background, may be a save behind the dead node's own
    newest = max(set.intersection(*(r["survived"].get(rank, set()) for rank in range(2))), default=None)
    assert step == newest and 20 < step <= killed_at, (step, killed_at, r["survived"])
    assert re.search(rf"peer copy: step {step} for rank\(s\) [\d, ]+ from a copy on another node", rerun), rerun[-4000:]
    assert f"checkpoint step {step} committed in the shared tier" in rerun  # drained right after the restore
    assert_resumed_and_finished(job, job.output(), step, campaign("reference"), runs=2)


def test_lost_node_and_scratch_without_peer_copy_resumes_from_the_shared_step_on_the_spare(campaign):
    r, first, rerun = _lost_node_and_scratch(
        campaign, "test_lost_node_and_scratch_without_peer_copy_resumes_from_the_shared_step_on_the_spare")
    assert not any("/peer/" in h for h in r["held"]) and "peer copy" not in r["job"].output(), r["held"]
    # the survivor's newer local steps are no use without the dead node's: the shared tier's step 20, as before
    assert re.search(r"resumed from \S+ \(step 20, vanilla backend; \d of 2 ranks from their local tier, \d from the "
                     r"shared tier", rerun), rerun[-4000:]
    assert_resumed_and_finished(r["job"], r["job"].output(), 20, campaign("reference"), runs=2)
