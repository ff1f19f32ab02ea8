"""Smoke test of the goodput benchmark harness (benchmarks/goodput.py, `make goodput`): it runs end to end and writes
its report. It measures nothing: one configuration (the node-local tier, whose flags the harness sets apart, with a
warm standby), the ranks started as srun starts them (benchmarks/launch.py), a few steps, one kill at step 12 of 16
(at a step, so the machine's speed cannot let the run finish before it; past the first save at any interval a quick
calibration gives, which on a cold machine has come out at 6); the restart is served by the standby (no imports) and
resumes from the local tier in /dev/shm, which the harness removes. One round: the rounds of --repeats (a failure-free
run before, between and after them, the median round with the spread) are the harness's bookkeeping around the same
runs, proved on made-up runs in tests/unit/test_goodput_rounds.py. The calibration measures the save cost inside its
own run (saves in every other stretch of steps); with --delta-from blocked the interval stays below the kill's step.
Shorter than --quick's own sizes (the `small` model's steps are most of this test's time): a save every step in the
calibration, so its stretches are 2 steps and it and the failure-free base run take 10 steps (--quick: 26), and a
kill run of 16 steps (--quick: 20); the kill at 12 still leaves the restart steps to train."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from helpers import PY, ROOT, env_for_tests


STEPS, CALIB_EVERY = 16, 1  # the kill run's steps; the calibration's save interval (stretches of 2 x that)


@pytest.mark.benchmark_smoke
def test_goodput_harness_smoke(corpus, tmp_path):
    proc = subprocess.run([PY, "-m", "benchmarks.goodput", "--quick", "--configs", "tiered-warm", "--kill-steps", "12",
                           "--steps", str(STEPS), "--calib-every", str(CALIB_EVERY), "--launcher", "direct",
                           "--delta-from", "blocked",  # the interval stays short of the kill at step 12
                           "--dataset", corpus, "--out", str(tmp_path)],
                          cwd=ROOT, env=env_for_tests(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for name in ("goodput.md", "goodput.json", "goodput.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    report = json.loads((tmp_path / "goodput.json").read_text())
    assert report["rounds"] == [{"t0_s": report["t0_s"]}] and report["t0_s"] > 0, report["rounds"]  # the base run's
    tiered = next(c for c in report["configs"] if c["name"] == "tiered-warm")
    assert tiered["status"] == "ok" and [r["round"] for r in tiered["rounds"]] == [1], tiered["status"]
    run = tiered["run"]
    row = next(line for line in (tmp_path / "goodput.md").read_text().splitlines() if line.startswith("| tiered-warm |"))
    # The figure is t0 x steps / wall, t0 from failure-free runs beside the kill run: on a loaded test machine (other
    # workers' ranks) the two can see different loads, so only its arithmetic is checked here, not a range
    assert run["goodput"] == STEPS * report["t0_s"] / run["wall_s"] and run["goodput"] > 0, (run, report["t0_s"])
    assert row.split("|")[3].strip() == f"**{run['goodput']:.3f}**", row
    assert run["kills"] == 1, run
    first, restart = tiered["incarnations"]
    assert first["killed"] and first["reached"] >= 12, first
    assert first["resumed_from"] == 0, first  # the kill run never finds the calibration's checkpoint
    assert restart["resumed_from"] > 0 and "imports 0.00s" in restart["recovery_line"], restart
    assert not restart["killed"] and restart["reached"] == STEPS, restart
    cal = tiered["calibration"]  # measured inside the run (--quick: 2 pairs of stretches of 2 x CALIB_EVERY steps,
    # pair 1 counts)
    assert cal["stretch"] == 2 * CALIB_EVERY and cal["steps"] == 10 and report["base"]["steps"] == 10, (cal, report)
    assert len(cal["save_cost_pairs"]) == 1 and cal["save_cost_s"] >= cal["blocked_s"], cal
    assert not list(Path("/dev/shm").glob("pyrecover-goodput-*")), "a local tier was left behind"


def test_calibration_measures_the_save_cost_against_quiet_stretches_of_the_same_run():
    """benchmarks.goodput.stretch_costs on a made-up run: steps of 0.2 s that drift slowly (as this machine's speed
    does), saves every 5 steps in every other stretch of 10, each adding 0.06 s to the step after it and 0.01 s to the
    two after that (a background persist). The drift would swamp a comparison against another run; the pairs recover
    0.08 s per save, counting the 3 steps a save reaches."""
    from benchmarks.goodput import stretch_costs

    stretch, steps, every = 10, 82, 5
    saves = {s for s in range(every, steps, every) if (s - 1) // stretch % 2 == 0}
    rows, t = {}, 0.0
    for s in range(1, steps + 1):
        t += 0.2 * (1 + s / 1000) + 0.06 * (s - 1 in saves) + 0.01 * (s - 2 in saves) + 0.01 * (s - 3 in saves)
        rows[s] = t
    costs = stretch_costs(rows, saves, stretch, steps, reach=3)
    assert len(costs) == 3  # pairs 1, 2 and 3; pair 0 pays the one-off costs of a first save, 4 reaches the final step
    assert all(abs(c - 0.08) < 1e-9 for c in costs), costs  # the quiet halves on both sides cancel the drift


def test_node_loss_wipes_a_nodes_own_folder_and_the_peer_copies_it_holds(tmp_path):
    """benchmarks.goodput.wipe_node (--node-loss, one rank per node): node 1 of 3 holds rank-00001/ and the peer copies
    of node 0's steps (peer/rank-00000/); the copies of node 1's own steps are on node 2 (peer/rank-00001/) and stay.
    Node 0's predecessor is the last node."""
    from benchmarks.goodput import wipe_node

    run = tmp_path / "run-0123abcd"
    for rel in ("rank-00000/step-00000004", "rank-00001/step-00000002", "rank-00001/step-00000004",
                "rank-00001/.staging-x", "rank-00002/step-00000004", "peer/rank-00000/step-00000004",
                "peer/rank-00001/step-00000004", "peer/rank-00002/step-00000002"):
        (run / rel).mkdir(parents=True)
    assert wipe_node(tmp_path, 1, 3) == {"node": 1, "own": [2, 4], "peer": [4]}
    assert sorted(str(p.relative_to(run)) for p in run.glob("**/rank-*")) == [
        "peer/rank-00001", "peer/rank-00002", "rank-00000", "rank-00002"]
    assert wipe_node(tmp_path, 0, 3) == {"node": 0, "own": [4], "peer": [2]}
    assert wipe_node(tmp_path, 1, 3) == {"node": 1, "own": [], "peer": []}  # nothing left: nothing to lose


def test_node_loss_counts_each_kills_redone_steps_from_where_the_next_restart_resumed():
    """benchmarks.goodput.node_loss_account: a kill loses the newest step done (a start killed before its first step:
    the step it resumed from) less the step the next start that said where it resumed from resumed from; a start
    killed before saying so loses nothing itself."""
    from benchmarks.goodput import Incarnation, Job, node_loss_account

    def start(resumed_from=None, reached=None, killed=True, notes=()):
        return Incarnation(start=0.0, end=1.0, killed=killed, rc=-9 if killed else 0, resumed_from=resumed_from,
                           reached=reached, first_step=None if reached is None else 0.5, recovery_line=None,
                           notes=list(notes))

    job = Job(0.0, 100.0, "finished", [
        start(0, 25),
        start(24, 31, notes=["peer copy: step 24 for rank(s) 1 from a copy on another node"]),
        start(),  # killed before it said where it resumed from
        start(20, notes=["peer copy: step 30 is lost for rank(s) 0 (its node and its buddy's); resuming from an "
                         "older step"]),  # killed before its first step: it had done step 20
        start(20, 40, killed=False)])
    r = node_loss_account(job, 40, 0.5)
    assert r["lost_steps"] == [1, 11, 0, 0] and r["kills"] == 4 and r["lost_steps_max"] == 11
    assert r["goodput"] == 0.2 and r["peer_copy_served"] == 1 and r["peer_copy_lost"] == 1, r


def test_rank_failures_find_the_process_holding_a_rank_from_the_launchers_lines():
    """benchmarks.goodput_failures.launcher_holders (--failure rank, in-process): the start lines give each member's
    pid and rank, and each generation's line the spares that took ranks; a spare that died while waiting changes
    nothing."""
    from benchmarks.goodput_failures import launcher_holders

    lines = ["launcher: store 127.0.0.1:4000; 2 ranks, 2 spares: python train.py",
             "launcher: member 0 pid 100 rank 0", "launcher: member 1 pid 101 rank 1",
             "launcher: member 2 pid 102 spare", "launcher: member 3 pid 103 spare",
             "launcher: generation 1: rank 1 (member 1, pid 101) died (SIGKILL); member 2 (spare) takes rank 1; "
             "1 spares left",
             "launcher: spare member 3 (pid 103) died (SIGKILL) while waiting; 0 spares left"]
    assert launcher_holders(lines) == ({0: 0, 1: 2}, {0: 100, 1: 101, 2: 102, 3: 103})
    lines.append("launcher: generation 2: rank 0 (member 0, pid 100) died (SIGKILL); member 3 (spare) takes rank 0; "
                 "0 spares left")
    assert launcher_holders(lines)[0] == {0: 3, 1: 2}


def test_rank_failures_cost_the_time_until_the_next_new_step_less_one_step():
    """benchmarks.goodput_failures.failure_costs: a failure at newest step s (done at w_s) costs the first time step
    s + 1 is done after it, less w_s and one step; two failures before that step share the window; a failure after
    the last step has no such step (None). Rows are every (step, time) seen, redone steps included."""
    from benchmarks.goodput_failures import Kill, failure_costs

    origin, t = 1000.0, 1.0
    rows = {(s, origin + s) for s in range(1, 11)}  # steps 1..10 at 1 s each, then a kill at 10.5 (step 10 done)
    rows |= {(s, origin + 20 + s - 8) for s in range(9, 13)}  # resumed from 8: step 9 again at 21, 11 first at 23
    rows |= {(s, origin + 40 + s - 14) for s in range(15, 31)}  # after two kills at step 14 (30.2 and 33.0)
    rows |= {(s, origin + s + 11) for s in range(13, 15)}  # steps 13, 14 at 24, 25
    kills = [Kill(10.5, "rank", 1, 11, 1, 0, 10, 10.0), Kill(30.2, "rank", 0, 12, 0, 0, 14, 25.0),
             Kill(33.0, "rank", 1, 13, 2, 0, 14, 25.0), Kill(60.0, "job", 0, None, None, 0, 30, 56.0)]
    costs = failure_costs(kills, rows, origin, t, steps=30)
    assert [c["cost_s"] for c in costs] == [23 - 10 - t, (41 - 25 - t) / 2, (41 - 25 - t) / 2, None], costs
    assert [c["shared_with"] for c in costs] == [0, 1, 1, 0]


def test_rank_failures_meet_the_same_ranks_and_kinds_in_every_configuration():
    """benchmarks.goodput_failures.schedule: the seeded times of the job-kill schedule, each with its rank (and with
    --failure mixed its kind) drawn from the seed, so cold and in-process meet the same failures."""
    import itertools

    from benchmarks.goodput import kill_schedule
    from benchmarks.goodput_failures import schedule

    def first(failure, n=40):
        return list(itertools.islice(schedule(0, 40.0, failure, 2), n))

    rank, mixed = first("rank"), first("mixed")
    assert rank == first("rank") and [p.at for p in rank] == list(itertools.islice(kill_schedule(0, 40.0), 40))
    assert {p.kind for p in rank} == {"rank"} and {p.rank for p in rank} == {0, 1}
    assert {p.kind for p in mixed} == {"rank", "job"} and [p.rank for p in mixed] == [p.rank for p in rank]
    assert [p.step for p in schedule(0, 40.0, "rank", 2, steps=[9, 12])] == [9, 12]


def test_rank_failures_read_the_in_process_recovery_line():
    """The parts of train.py's in-process recovery line (recovery_line) and of a restart's (metrics.recovery_line)."""
    from benchmarks.goodput_failures import parse_inprocess, parse_restart

    line = ("recovery: rank 1 (member 1, pid 4242, SIGKILL) failed; generation 1 resumed step 8 from the node-local "
            "tier in-process; detect 0.03s, tear down 0.26s, agree 0.32s, load 0.48s, first step 1.09s; 2.31s in all")
    got = parse_inprocess(line)
    assert got["resumed_step"] == 8 and got["generation"] == 1 and "pid 4242," in got["what"], got
    assert [got[k] for k in ("detect", "teardown", "agree", "load", "first_step", "total")] == [
        0.03, 0.26, 0.32, 0.48, 1.09, 2.31]
    restart = parse_restart("recovery: first step after resume 10.50s after process start (python start-up 0.47s, "
                            "imports 3.49s, setup 4.66s, checkpoint load 0.09s, first step 1.79s)")
    assert restart == {"total": 10.5, "python start-up": 0.47, "imports": 3.49, "setup": 4.66, "checkpoint load": 0.09,
                       "first step": 1.79}


def test_rank_failures_refuse_a_node_in_one_line(capsys):
    """--failure node on one machine: one line saying why (a node is the whole job here), exit 2."""
    from benchmarks.goodput import main

    with pytest.raises(SystemExit) as e:
        main(["--failure", "node"])
    assert e.value.code == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--failure node: on one machine a node is the whole job" in said, said
