"""checkpoint/policy.py with a fake clock (no SLURM): walltime margins, agreement across ranks, double signals, requeue
decisions; plus one real 2-rank run where only one rank gets the signal."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import PY, ROOT, TINY, LogLines, check_weights, env_for_tests, loss_rows, torchrun_cmd

sys.path.insert(0, str(ROOT))
from checkpoint import policy, slurm  # noqa: E402
from checkpoint.policy import (INTERVAL, SIGNAL, TERM, WALLTIME, IntervalPolicy, RequeueSettings,  # noqa: E402
                               SignalWatcher, StepBoundary, WallClockInterval, When, step_boundary)
from checkpoint.walltime import DeadlineReader, WalltimePolicy, parse_walltime  # noqa: E402


class FakeClock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


Log = LogLines  # what the policy logged


@pytest.fixture
def restore_signals():
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def _deliver(sig: int) -> None:
    """Send a real signal to this process and let the Python-level handler run."""
    os.kill(os.getpid(), sig)
    for _ in range(100):
        time.sleep(0.001)  # handlers run between bytecodes of the main thread


# ----------------------------------------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------------------------------------


def test_parse_signal_and_walltime():
    assert policy.parse_signal("USR1") == policy.parse_signal("SIGUSR1") == signal.SIGUSR1
    assert policy.parse_signal(str(int(signal.SIGUSR2))) == signal.SIGUSR2
    assert policy.parse_signal("none") is None
    for bad in ("FOO", "KILL", "999"):
        with pytest.raises(ValueError):
            policy.parse_signal(bad)
    assert parse_walltime("90") == 90 * 60  # SLURM: a bare number is minutes
    assert parse_walltime("1:30") == 90
    assert parse_walltime("01:02:03") == 3723
    assert parse_walltime("2-00") == 2 * 86400
    assert parse_walltime("1-01:00:05") == 86400 + 3600 + 5
    for bad in ("", "0", "1:2:3:4", "x", "-5"):
        with pytest.raises(ValueError):
            parse_walltime(bad)


def test_squeue_end_time_is_parsed_as_utc():
    assert slurm.parse_utc_time("1970-01-01T01:00:00") == 3600.0
    assert slurm.parse_utc_time("2026-11-21T23:38:50") == 1795304330.0
    for none in ("NONE", "N/A", "Unknown", ""):
        assert slurm.parse_utc_time(none) is None


# ----------------------------------------------------------------------------------------------------------------------
# Walltime: margins, moving step time, longest save, refresh, sources
# ----------------------------------------------------------------------------------------------------------------------


def _walltime(clock: FakeClock, left: float, **kw) -> tuple[WalltimePolicy, Log]:
    log = Log()
    deadline = clock() + left
    wt = WalltimePolicy(lambda: (deadline, "fake-squeue"), clock=clock, background=False, **kw)
    wt.start()
    return wt, log


def test_walltime_stops_exactly_below_save_plus_k_steps_plus_margin():
    clock = FakeClock()
    wt, log = _walltime(clock, left=1000, margin_s=30, step_factor=3)
    assert log.has("from fake-squeue") and log.has("1000s from now")
    wt.observe_step(10.0)
    wt.observe_save(40.0)
    wt.observe_save(25.0)  # the longest save counts
    assert wt.needed() == pytest.approx(40 + 3 * 10 + 30)
    clock.advance(1000 - 100.5)  # 100.5 s left, 100 needed
    assert not wt.due()
    clock.advance(1.0)  # 99.5 s left
    assert wt.due()
    assert "99.5s left" in wt.explain() and "longest save 40.00s" in wt.explain() and "margin 30s" in wt.explain()


def test_walltime_step_time_is_a_moving_estimate():
    clock = FakeClock()
    wt, _ = _walltime(clock, left=1000, margin_s=0, step_factor=1, ema=0.5)
    wt.observe_step(100.0)  # first step (warm-up) dominates at first ...
    assert wt.needed() == 100.0
    for _ in range(20):  # ... then the estimate follows the steady state
        wt.observe_step(2.0)
    assert 2.0 <= wt.needed() < 2.1


def test_walltime_deadline_is_re_read_and_extension_is_honoured():
    clock = FakeClock()
    log = Log()
    ends = [clock() + 100.0]
    wt = WalltimePolicy(lambda: (ends[0], "fake-squeue"), margin_s=50, step_factor=0, refresh_s=60, clock=clock,
                        background=False)
    wt.start()
    clock.advance(40)  # 60 s left < 50? no
    assert not wt.due()
    ends[0] += 3600  # an admin extends the limit
    clock.advance(15)  # 45 s left on the old deadline, but 55 s since the last read: not re-read yet
    assert wt.due()
    clock.advance(10)  # 65 s since the read: re-read, 3635 s left
    assert not wt.due()
    assert log.has("deadline changed")


def test_deadline_sources_in_order_and_the_earliest_wins():
    calls = []

    def query(job):
        calls.append(job)
        return 5000.0, "squeue"

    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_END_TIME": "4000"}
    reader = DeadlineReader(env, walltime_s=None, start=0.0, query=query)
    assert reader() == (4000.0, "SLURM_JOB_END_TIME")  # the variable first (SLURM 23.02+) ...
    assert calls == []
    assert reader() == (5000.0, "squeue (job 42)")  # ... then re-read from squeue (limits may change)
    assert calls == ["42"]
    reader = DeadlineReader({"SLURM_JOB_ID": "42"}, walltime_s=600, start=4000.0, query=query)
    assert reader() == (4600.0, "when.walltime_s=600s")  # earlier than squeue's
    reader = DeadlineReader({}, walltime_s=600, start=100.0, query=query)
    assert reader() == (700.0, "when.walltime_s=600s")
    when, why = DeadlineReader({}, walltime_s=None, query=query)()
    assert when is None and "no when.walltime_s" in why
    when, why = DeadlineReader({"SLURM_JOB_ID": "7"}, query=lambda j: (None, "squeue gave no end time (NONE)"))()
    assert when is None and "NONE" in why


def test_slurm_end_time_via_fake_squeue_and_scontrol(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text('#!/bin/sh\necho "$TZ $*" >> "$(dirname "$0")/calls"\necho NONE\n')
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 'JobId=9 EndTime=1970-01-02T00:00:00 Reason=None'\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    assert slurm.end_time("9") == (86400.0, "scontrol")  # squeue said NONE: fall back to scontrol
    assert (bin_dir / "calls").read_text().split() == ["UTC", "-h", "-j", "9", "-o", "%e"]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    when, why = slurm.end_time("9")
    assert when is None and "squeue not found" in why and "scontrol not found" in why


# ----------------------------------------------------------------------------------------------------------------------
# Agreement across ranks
# ----------------------------------------------------------------------------------------------------------------------


def _ranks(n: int, log: Log, **per_rank) -> list[StepBoundary]:
    return [StepBoundary(IntervalPolicy(every_steps=0, final_step=100), agree=lambda v: v, rank=r,
                         **{k: v[r] for k, v in per_rank.items()}) for r in range(n)]


def _step(boundaries: list[StepBoundary], step: int):
    """One step boundary of a world: each rank votes, the all-reduce MAX, each rank resolves."""
    votes = [b.local_vote() for b in boundaries]
    return [b.resolve(max(votes), step) for b in boundaries]


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step():
    log = Log()
    watchers = [SignalWatcher(signal.SIGUSR1) for _ in range(4)]
    ranks = _ranks(4, log, signals=watchers)
    for step in range(1, 6):
        assert all(d == policy.Decision() for d in _step(ranks, step))
    watchers[2].received.append(signal.SIGUSR1)  # what the handler does on rank 2 only
    decisions = _step(ranks, 6)
    assert all(d.save and d.stop and d.vote == SIGNAL for d in decisions)
    assert [b.stop_step for b in ranks] == [6, 6, 6, 6]
    assert log.has("rank 2: received SIGUSR1") and log.has("rank 2: saving and stopping at step 6: received SIGUSR1")
    assert log.has("rank 0: saving and stopping at step 6: another rank received a stop signal")


def test_walltime_on_rank_0_stops_every_rank_and_sigterm_outranks_it():
    log = Log()
    clock = FakeClock()
    wt, _ = _walltime(clock, left=100, margin_s=10, step_factor=0)
    watchers = [SignalWatcher(signal.SIGUSR1) for _ in range(2)]
    ranks = _ranks(2, log, signals=watchers, walltime=[wt, None])
    assert [d.stop for d in _step(ranks, 1)] == [False, False]
    clock.advance(95)
    assert [(d.stop, d.vote) for d in _step(ranks, 2)] == [(True, WALLTIME)] * 2
    assert log.has("rank 0: saving and stopping at step 2: walltime: 5.0s left") and \
        log.has("rank 1: saving and stopping at step 2: walltime (decided on rank 0)")
    watchers[1].received.append(signal.SIGTERM)
    assert [d.vote for d in _step(ranks, 3)] == [TERM, TERM]  # TERM wins the MAX: no requeue after it


def test_wall_clock_interval_saves_on_every_rank_without_stopping():
    log = Log()
    mono = FakeClock(0.0)
    ranks = _ranks(2, log, every_minutes=[WallClockInterval(10, clock=mono), None])
    mono.advance(599)
    assert [d.save for d in _step(ranks, 1)] == [False, False]
    mono.advance(1)
    assert [(d.save, d.stop, d.vote) for d in _step(ranks, 2)] == [(True, False, INTERVAL)] * 2
    mono.advance(300)
    assert [d.save for d in _step(ranks, 3)] == [False, False]  # the interval restarts at the save


def test_step_interval_and_final_step_need_no_vote():
    b = StepBoundary(IntervalPolicy(every_steps=5, final_step=12), agree=lambda v: v)
    b.start()
    assert [s for s in range(1, 13) if b(s).save] == [5, 10, 12]
    assert not any(b(s).stop for s in range(1, 13))


def test_save_stretch_knob_saves_only_in_every_other_stretch_and_always_at_the_end():
    """PYRECOVER_SAVE_STRETCH (benchmarks/goodput.py's calibration): saves in steps 1-10, 21-30, not 11-20, 31-34."""
    b = step_boundary(When(every_steps=5, final_step=35), rank=0, agree=lambda v: v, signals=None,
                      environ={"PYRECOVER_SAVE_STRETCH": "10"})
    b.start()
    assert [s for s in range(1, 36) if b(s).save] == [5, 10, 25, 30, 35]
    assert IntervalPolicy(every_steps=5, final_step=35, stretch=0).due(15)  # off: every 5th step


# ----------------------------------------------------------------------------------------------------------------------
# Real signals: the handler only records; a second signal or SIGTERM neither saves twice nor interrupts
# ----------------------------------------------------------------------------------------------------------------------


def test_double_signal_and_sigterm_during_the_save_neither_save_again_nor_abort(restore_signals):
    log = Log()
    watcher = policy.install_signal_handlers("USR1")
    b = StepBoundary(IntervalPolicy(every_steps=0, final_step=50), agree=lambda v: v, signals=watcher,
                     environ={})
    b.start()
    saves, step = [], 0
    while step < 50:  # the shape of train.py's loop
        step += 1
        if step == 7:
            _deliver(signal.SIGUSR1)
        d = b(step)
        if d.save:
            saves.append(step)
            # during the save: the same signal again, then SIGTERM (e.g. SLURM's kill after the warning)
            _deliver(signal.SIGUSR1)
            _deliver(signal.SIGTERM)
            time.sleep(0.01)  # "the save" carries on undisturbed
        if d.stop:
            break
    assert saves == [7] and step == 7 and b.stop_step == 7
    assert b.stopped.vote == SIGNAL  # the first reason stands: SIGTERM after SIGUSR1 does not downgrade the requeue
    assert sum("saving and stopping" in m for m in log) == 1
    assert b.finish(step, 50) == policy.STOPPED  # not under SLURM: no requeue
    assert log.has("also received SIGUSR1, SIGTERM while stopping: ignored")


def test_sigterm_before_the_loop_exits_at_once_and_in_the_loop_saves(restore_signals):
    watcher = policy.install_signal_handlers("none")
    assert not watcher.owner.owns(signal.SIGUSR1)
    with pytest.raises(SystemExit) as e:
        _deliver(signal.SIGTERM)  # setup: nothing to save yet
    assert e.value.code == 128 + signal.SIGTERM
    log = Log()
    b = StepBoundary(IntervalPolicy(0, 10), agree=lambda v: v, signals=watcher, environ={})
    b.start()
    _deliver(signal.SIGTERM)
    d = b(3)
    assert d.save and d.stop and d.vote == TERM
    assert b.finish(3, 10) == policy.STOPPED and log.has("not requeueing: stopped by SIGTERM")


# ----------------------------------------------------------------------------------------------------------------------
# Requeue decisions (a fake scontrol records what it was asked)
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_scontrol(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text('#!/bin/sh\necho "$*" >> "$(dirname "$0")/requeued"\nexit ${FAKE_SCONTROL_RC:-0}\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return bin_dir / "requeued"


def _stopped(environ: dict, log: Log, requeue: RequeueSettings | None = None, vote: int = SIGNAL,
             final: int = 100) -> StepBoundary:
    b = StepBoundary(IntervalPolicy(0, final), agree=lambda v: v, environ=environ, requeue=requeue)
    b.resolve(vote, 40)
    return b


def test_requeue_after_a_stop_array_aware_and_bounded(fake_scontrol, monkeypatch):
    log = Log()
    job = {"SLURM_JOB_ID": "1234"}
    assert _stopped(job, log).finish(40, 100) == policy.REQUEUED
    assert fake_scontrol.read_text().split("\n")[0] == "requeue 1234"
    assert log.has("requeued job 1234 (restart 1 of at most 100)")

    array = {"SLURM_JOB_ID": "1240", "SLURM_ARRAY_JOB_ID": "1238", "SLURM_ARRAY_TASK_ID": "2"}
    assert _stopped(array, log).finish(40, 100) == policy.STOPPED  # auto: the next array task resumes
    assert log.has("job array task")
    assert _stopped(array, log, RequeueSettings(enabled=True)).finish(40, 100) == policy.REQUEUED
    assert fake_scontrol.read_text().splitlines()[-1] == "requeue 1238_2"

    calls = len(fake_scontrol.read_text().splitlines())
    assert _stopped(job | {"SLURM_RESTART_COUNT": "3"}, log, RequeueSettings(max_restarts=3)).finish(40, 100) == \
        policy.STOPPED
    assert log.has("already restarted 3 times (when.max_restarts=3)")
    assert _stopped(job, log, RequeueSettings(enabled=False)).finish(40, 100) == policy.STOPPED
    assert _stopped(job, log, vote=TERM).finish(40, 100) == policy.STOPPED
    assert _stopped(job, log, vote=WALLTIME).finish(100, 100) == policy.FINISHED  # complete: never requeue
    assert _stopped({}, log).finish(40, 100) == policy.STOPPED  # not in a SLURM job
    assert len(fake_scontrol.read_text().splitlines()) == calls  # none of these ran scontrol

    monkeypatch.setenv("FAKE_SCONTROL_RC", "1")
    assert _stopped(job, log).finish(40, 100) == policy.REQUEUE_FAILED
    assert log.has("cannot requeue job 1234: `scontrol requeue 1234` failed (exit 1)")


def test_scontrol_missing_is_said_and_gets_its_own_outcome(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    log = Log()
    assert _stopped({"SLURM_JOB_ID": "5"}, log).finish(40, 100) == policy.REQUEUE_FAILED
    assert log.has("cannot requeue job 5: scontrol not found on PATH")


def test_outcome_is_rank_0s_on_every_rank(fake_scontrol):
    """Only rank 0 requeues; the others contribute 0 to the MAX and so return rank 0's outcome."""
    log = Log()
    job = {"SLURM_JOB_ID": "77"}
    sent = {}
    rank0, rank1 = _stopped(job, log), _stopped(job, log)
    rank1.rank = 1
    rank0.agree = lambda v: sent.setdefault(0, v)
    assert rank0.finish(40, 100) == policy.REQUEUED
    rank1.agree = lambda v: max(sent.setdefault(1, v), sent[0])
    assert rank1.finish(40, 100) == policy.REQUEUED
    assert sent[1] == 0 and fake_scontrol.read_text().splitlines() == ["requeue 77"]  # one scontrol, by rank 0


# ----------------------------------------------------------------------------------------------------------------------
# The real CLI, no SLURM: 2 ranks, SIGUSR1 to rank 1 only -> both save the same step, exit 4, resume bit-exact
# ----------------------------------------------------------------------------------------------------------------------

STEPS = 16


def _worker_pids(torchrun_pid: int) -> dict[int, int]:
    """rank -> pid of torchrun's worker processes (from /proc)."""
    out = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != torchrun_pid:
                continue
            env = dict(kv.split("=", 1) for kv in (p / "environ").read_text().split("\0") if "=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in env:
            out[int(env["RANK"])] = int(p.name)
    return out


@pytest.mark.slow
def test_signal_to_one_rank_only_stops_both_at_the_same_step_then_resume_is_bit_exact(corpus, tmp_path):
    args = TINY + ["--dataset", corpus, "--training-steps", str(STEPS), "--checkpoint-frequency", "0",
                   "--log-loss-to-csv"]
    ref = subprocess.Popen(torchrun_cmd(2, args + ["--checkpoint-dir", str(tmp_path / "ref")]), cwd=ROOT,
                           env=env_for_tests(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_args = args + ["--checkpoint-dir", str(tmp_path / "run")]
    proc = subprocess.Popen(torchrun_cmd(2, run_args), cwd=ROOT, env=env_for_tests({"PYRECOVER_STEP_SLEEP": "0.2"}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    csv = tmp_path / "run/default/loss.csv"
    deadline = time.monotonic() + 240
    while not (csv.exists() and len(csv.read_text().splitlines()) > 4):
        assert proc.poll() is None and time.monotonic() < deadline, "run ended or stalled before step 4"
        time.sleep(0.05)
    pids = _worker_pids(proc.pid)
    assert sorted(pids) == [0, 1], pids
    os.kill(pids[1], signal.SIGUSR1)
    out, _ = proc.communicate(timeout=120)
    # stopped, state saved, no requeue (not a SLURM job): exit 4 (torchrun reports the first worker's, then exits 1)
    assert proc.returncode != 0 and re.search(r"exitcode\s*:\s*4\b", out), out[-3000:]
    assert "not requeueing: not running in a SLURM job" in out
    stops = {int(r): int(s) for r, s in re.findall(r"rank (\d): saving and stopping at step (\d+)", out)}
    assert sorted(stops) == [0, 1] and len(set(stops.values())) == 1, out[-3000:]
    step = stops[0]
    assert 4 <= step < STEPS, out[-3000:]
    assert "rank 1: received SIGUSR1" in out and "rank 0: received" not in out
    assert "rank 0: saving and stopping at step %d: another rank received a stop signal" % step in out
    assert f"checkpoint step {step} committed" in out

    resumed = subprocess.run(torchrun_cmd(2, run_args + ["--resume-from-checkpoint", "latest"]), cwd=ROOT,
                             env=env_for_tests(), capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"step {step}" in resumed.stdout and "resumed from" in resumed.stdout
    ref_out, _ = ref.communicate(timeout=240)
    assert ref.returncode == 0, ref_out[-3000:]
    cmp = check_weights(tmp_path / "ref/default", tmp_path / "run/default", "--tolerance", "0", "--optimizer")
    assert cmp.returncode == 0 and "bitwise" in cmp.stdout, cmp.stdout + cmp.stderr
    rows = loss_rows(csv)
    assert rows == loss_rows(tmp_path / "ref/default/loss.csv")
    assert [int(r[0]) for r in rows] == list(range(1, STEPS + 1))


def _blocked_signals(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            return int(line.split()[1], 16)
    return 0


def test_stop_signal_during_startup_imports_is_held_not_fatal(corpus, tmp_path):
    """SLURM's warning can come while train.py still imports torch (seconds, tens on a busy node); SIGUSR1's default
    action would kill the process. train.py holds USR1/USR2 from its first lines; the policy's handler gets the held
    signal once installed, and the run saves and stops at its first step instead of dying unsaved."""
    args = TINY + ["--dataset", corpus, "--training-steps", "8", "--checkpoint-dir", str(tmp_path)]
    proc = subprocess.Popen([PY, str(ROOT / "train.py"), *args], cwd=ROOT, env=env_for_tests(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    held = 1 << (signal.SIGUSR1 - 1)
    deadline = time.monotonic() + 30
    while not _blocked_signals(proc.pid) & held:  # held: train.py is importing; only install() of its handler releases
        assert proc.poll() is None and time.monotonic() < deadline, "train.py never held SIGUSR1"
        time.sleep(0.001)
    os.kill(proc.pid, signal.SIGUSR1)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 4, out[-3000:]  # stopped and saved; not a SLURM job, so no requeue
    assert "rank 0: received SIGUSR1" in out and "saving and stopping at step 1: received SIGUSR1" in out, out[-3000:]
    assert "checkpoint step 1 committed" in out, out[-3000:]


def test_signal_owner_composes_listeners_and_restores_the_previous_handlers(restore_signals):
    """One owner per process (checkpoint/signals.py): listeners of one signal all run, in order, and restore() puts
    back exactly the handlers found before -- here a handler of the test's own, which gets the next signal again."""
    from checkpoint.signals import SignalOwner

    seen: list[str] = []
    mine = lambda signum, frame: seen.append("previous")  # noqa: E731
    signal.signal(signal.SIGUSR2, mine)
    owner = SignalOwner()
    owner.listen(signal.SIGUSR2, lambda s: seen.append("first"))
    owner.listen(signal.SIGUSR2, lambda s: seen.append("second"))
    assert owner.owns(signal.SIGUSR2)
    _deliver(signal.SIGUSR2)
    assert seen == ["first", "second"]
    owner.restore()
    assert signal.getsignal(signal.SIGUSR2) is mine
    _deliver(signal.SIGUSR2)
    assert seen == ["first", "second", "previous"]


def test_the_stop_policy_restores_the_handlers_it_found(restore_signals):
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)}
    watcher = policy.install_signal_handlers("USR1")
    assert all(watcher.owner.owns(s) for s in before)
    watcher.restore()
    assert {s: signal.getsignal(s) for s in before} == before
