"""In-process recovery (issue 56) through the real CLI: launcher.py starts 2 gloo ranks of train.py and spares on
this machine; a rank is SIGKILLed, or raises, in each phase of a step, in an evaluation, with copies in flight, during
a recovery; the survivors keep their processes, a spare takes each dead rank, every rank reloads the newest step they
all reach (the node-local tier), and the run ends bitwise an uninterrupted torchrun run's: weights, optimizer state,
loss and val rows. Several failures share one run."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from helpers import PY, ROOT, TINY, check_weights, env_for_tests, loss_rows, run_torchrun, val_rows

pytestmark = pytest.mark.slow

STEPS = 12


def _args(corpus: str, ck: Path, local: Path) -> list[str]:
    return TINY + ["--dataset", corpus, "--checkpoint-dir", str(ck), "--training-steps", str(STEPS),
                   "--checkpoint-frequency", "4", "--local-checkpoint-dir", str(local), "--local-checkpoint-frequency",
                   "2", "--eval-every", "5", "--log-loss-to-csv"]


def _launch(args: list[str], *, spares: int = 1, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PY, str(ROOT / "launcher.py"), "--nproc", "2", "--spares", str(spares), str(ROOT / "train.py"),
                           "--distributed", *args], capture_output=True, text=True, timeout=600,
                          env=env_for_tests(env), cwd=ROOT)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """The same run, uninterrupted, under torchrun."""
    tmp = tmp_path_factory.mktemp("reference")
    run_torchrun(2, _args(corpus, tmp / "ck", tmp / "local"), check=True, timeout=600)
    return tmp / "ck" / "default"


def _members(out: str) -> dict[int, tuple[int, str]]:
    """launcher.py's start lines: member -> (pid, "rank R" or "spare")."""
    return {int(m): (int(pid), role) for m, pid, role in re.findall(r"launcher: member (\d+) pid (\d+) (rank \d+|spare)",
                                                                    out)}


def _assert_bitwise(run: Path, reference: Path, *, val: bool = True) -> None:
    cmp = check_weights(run / f"step-{STEPS:08d}", reference / f"step-{STEPS:08d}", "--tolerance", "0", "--optimizer")
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr
    assert loss_rows(run / "loss.csv") == loss_rows(reference / "loss.csv")
    assert [r[3] for r in loss_rows(run / "loss.csv")] == [str(256 * s) for s in range(1, STEPS + 1)]
    if val:  # the same evaluations (every 5 steps and at each save: the same saves as the reference's)
        assert val_rows(run / "val.csv") == val_rows(reference / "val.csv")


def _recovered(tmp_path: Path, corpus: str, reference: Path, crashes: str, *, spares: int, resumed: list,
               env: dict | None = None, extra: tuple[str, ...] = ()) -> str:
    """One run through ``crashes`` (PYRECOVER_CRASH_AT_STEP, each once): it ends bitwise the reference, recovering in
    process only (the launcher started each member once), resuming ``resumed`` in turn; every rank that left a
    process group and was not killed later ends the run in the same process."""
    ck, local = tmp_path / "ck", tmp_path / "local"
    out = _launch(_args(corpus, ck, local) + list(extra), spares=spares,
                  env={"PYRECOVER_CRASH_AT_STEP": crashes, "PYRECOVER_CRASH_ONCE": str(tmp_path / "crashed"),
                       **(env or {})})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-8000:]
    started = {pid for pid, _ in _members(text).values()}
    assert len(started) == 2 + spares and len(re.findall(r"launcher: member \d+ pid", text)) == 2 + spares, text[-4000:]
    lines = re.findall(r"^recovery: .* failed; generation (\d+) resumed step (\d+) from (.*) in-process; ", text, re.M)
    assert len(lines) == len(resumed) and all(int(step) in (want if isinstance(want, set) else {want})
                                              for (_, step, _), want in zip(lines, resumed)), text[-6000:]
    generations = [int(g) for g, _, _ in lines]
    assert generations == sorted(set(generations)) and generations[0] >= 1, lines
    # the survivors' PIDs: each process that left a group lived on, unless a later failure killed it
    forked = {int(child): int(pid) for pid, child in
              re.findall(r"^member \d+ \(pid (\d+)\) runs in pid (\d+), forked by the warm standby", text, re.M)}
    assert len(forked) == spares, text[-4000:]  # the spares, forked from the node's standby; the ranks start cold
    left = {forked.get(pid, pid) for pid in map(int, re.findall(r"^recovery \(rank \d+, pid (\d+)\): ", text, re.M))}
    killed = {int(pid) for pid in re.findall(r"\(member \d+, pid (\d+)\) died \(SIGKILL\)", text)}
    ended = {int(pid) for pid in re.findall(r"exit 0 \(member \d+, pid (\d+)\)", text)}
    assert left and left <= started and left - killed <= ended, (left, killed, ended, text[-4000:])
    assert len(ended) == 2
    _assert_bitwise(ck / "default", reference)
    return text


def test_a_rank_killed_in_each_phase_of_a_step_or_raising_recovers_in_process_and_ends_bitwise(tmp_path, corpus,
                                                                                               reference):
    """Rank 1 SIGKILLed in step 3's backward (DDP's all-reduce under way on rank 0); rank 0 in the evaluation after
    step 5 (the spare becomes rank 0: the lease, the loss and val CSVs, the shared counters are its); rank 1 in step
    8's optimizer step (after the all-reduce: rank 0 finishes step 8 and saves its part of it, which no load may use);
    rank 0 raising in step 11's forward (it keeps its rank and its process)."""
    text = _recovered(tmp_path, corpus, reference, "3:1:kill:backward,5:0:kill:eval,8:1:kill:optimizer,11:0:raise",
                      spares=3, resumed=[2, 4, 6, 10])
    for crash in ("1: kill in the backward phase of step 3", "0: kill in the eval phase of step 5",
                  "1: kill in the optimizer phase of step 8", "0: raise after the forward pass of step 11"):
        assert text.count(f"[crash] rank {crash}") == 1, crash
    said = re.findall(r"launcher: generation (\d+): (.*)", text)
    assert "rank 1 (member 1" in said[0][1] and "died (SIGKILL)" in said[0][1], said
    assert "member 2 (spare) takes rank 1" in said[0][1] and "member 3 (spare) takes rank 0" in said[1][1], said
    assert "member 4 (spare) takes rank 1" in said[2][1], said
    assert "failed (RuntimeError: injected crash of rank 0 at step 11)" in said[3][1] and "takes" not in said[3][1]
    assert "local tier" in re.search(r"^recovery: .* generation 1 resumed step 2 from (.*) in-process", text,
                                     re.M).group(1)


def test_a_rank_lost_with_a_drain_and_a_peer_copy_in_flight_recovers_in_process_and_ends_bitwise(tmp_path, corpus,
                                                                                                 reference):
    """Two emulated nodes with --peer-checkpoint, a slow drain to the shared tier and a slow peer copy: rank 1 is
    SIGKILLed in step 6 and raises in step 10, each time while the drain of the step before last (4, 8) and a peer
    copy are in flight on every rank."""
    text = _recovered(tmp_path, corpus, reference, "6:1:kill,10:1:raise", spares=1, resumed=[4, 8],
                      env={"PYRECOVER_TEST_RANKS_PER_NODE": "1", "PYRECOVER_DRAIN_DELAY_S": "1.0",
                           "PYRECOVER_PEER_DELAY_S": "1.5"}, extra=("--peer-checkpoint",))
    killed = text.index("[crash] rank 1: kill")
    drained = re.search(r"checkpoint step 4 committed in the shared tier", text)
    assert drained is None or drained.start() > killed, text[-6000:]  # the drain of step 4 was in flight
    # and a peer copy each time: the failed group's connections are shut down, so a transfer in flight fails at once
    raised = text.index("[crash] rank 1: raise")
    stopped = [m.start() for m in re.finditer(r"warning: peer copy stopped at step \d+: .*Connection (reset|closed) "
                                              r"by peer", text)]
    assert any(killed < at < raised for at in stopped) and any(at > raised for at in stopped), text[-6000:]


def test_a_lost_node_s_rank_is_recovered_in_process_from_its_peer_copy(tmp_path, corpus, reference):
    """Two emulated nodes with --peer-checkpoint and no shared save before the end: rank 1's node is lost in step 7
    (its folder in the node-local tier removed, the process SIGKILLed). The spare takes rank 1 on that node, whose
    tier holds nothing: its part comes from the copy its buddy (node 0) kept, verified, in process -- step 6, or step 4
    when the copy of 6 was still in flight at the loss."""
    text = _recovered(tmp_path, corpus, reference, "7:1:lose", spares=1, resumed=[{4, 6}],
                      env={"PYRECOVER_TEST_RANKS_PER_NODE": "1", "PYRECOVER_STEP_SLEEP": "0.3",
                           "PYRECOVER_CRASH_LOSE": str(tmp_path / "local" / "*" / "rank-00001")},
                      extra=("--peer-checkpoint", "--checkpoint-frequency", "12"))
    assert re.search(r"^recovery: .* resumed step [46] from 2 of 2 ranks from their local tier \(1 from a peer copy\) "
                     r"in-process", text, re.M), text[-6000:]


def test_a_rank_killed_during_a_recovery_is_replaced_in_the_next(tmp_path, corpus, reference):
    """Rank 1 is SIGKILLed in step 5; rank 0, the survivor, is SIGKILLed while it recovers (in generation 1's new
    group, before the load): generation 2 gives it the second spare, and all resume step 4."""
    text = _recovered(tmp_path, corpus, reference, "5:1:kill", spares=2, resumed=[4],
                      env={"PYRECOVER_CRASH_IN_RECOVERY": "1:0"})
    assert "[crash] rank 0: kill while recovering into generation 1" in text
    assert re.search(r"launcher: generation 2: .*rank 0 \(member 0, pid \d+\) died \(SIGKILL\).*member 3 \(spare\) "
                     r"takes rank 0", text), text[-4000:]


def test_a_rank_killed_inside_a_save_does_not_hold_rank_0_in_its_commit(tmp_path, corpus, reference):
    """Rank 1 SIGKILLed in the save of step 8 (shared tier, no local tier), its file written but its part record
    not: rank 0, waiting for that record (no collective), stops at once (the launcher marks the generation down)
    instead of at its commit timeout; step 4 is resumed in process and the run ends bitwise."""
    ck = tmp_path / "ck"
    args = TINY + ["--dataset", corpus, "--checkpoint-dir", str(ck), "--training-steps", str(STEPS),
                   "--checkpoint-frequency", "4", "--log-loss-to-csv"]
    # rank 1's renames per save: its rank file, its part record; the 3rd is inside the save of step 8
    out = _launch(args, env={"PYRECOVER_FAULT": "after_fsync_before_rename:3", "PYRECOVER_FAULT_RANK": "1"})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    assert "[fault] SIGKILL at after_fsync_before_rename" in text and "member 2 (spare) takes rank 1" in text, text
    assert re.search(r"^recovery: .* resumed step 4 from .* in-process", text, re.M), text[-4000:]
    _assert_bitwise(ck / "default", reference, val=False)  # no local tier: evaluations at other saves


def test_a_waiting_spare_killed_costs_one_line(tmp_path, corpus, reference):
    """The spare dies while it waits: the ranks are not disturbed and the run ends as an uninterrupted one."""
    ck, local = tmp_path / "ck", tmp_path / "local"
    proc = subprocess.Popen([PY, str(ROOT / "launcher.py"), "--nproc", "2", "--spares", "1", str(ROOT / "train.py"),
                             "--distributed", *_args(corpus, ck, local)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env_for_tests(), cwd=ROOT)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if (m := re.match(r"launcher: member 2 pid (\d+) spare", line)):
            import os
            import signal
            os.kill(int(m.group(1)), signal.SIGKILL)
    assert proc.wait(timeout=600) == 0, "".join(lines)[-4000:]
    text = "".join(lines)
    assert re.search(r"launcher: spare member 2 \(pid \d+\) died \(SIGKILL\) while waiting; 0 spares left", text), text
    assert "generation 1:" not in text and "recovery:" not in text.replace("recovery (rank", "")
    _assert_bitwise(ck / "default", reference)


def test_without_a_spare_or_a_checkpoint_the_ranks_end_and_a_restart_resumes_bitwise(tmp_path, corpus, reference):
    """A rank dies before the first save: the survivor's weights moved on and no checkpoint holds the start, so the
    ranks end (exit 3, as a requeue) and the next start begins afresh. Then no spare left for a dead rank: the survivor
    ends the same way, and the next start resumes from the last committed step: today's path, which in-process
    recovery only shortens."""
    ck, local = tmp_path / "ck", tmp_path / "local"
    early = _launch(_args(corpus, ck, local), spares=1, env={"PYRECOVER_CRASH_AT_STEP": "2:1:kill"})
    text = early.stdout + early.stderr
    assert early.returncode == 3, text[-4000:]
    assert "error: the failure came before the run's first checkpoint: nothing to recover in process" in text, text
    out = _launch(_args(corpus, ck, local), spares=0, env={"PYRECOVER_CRASH_AT_STEP": "7:1:kill"})
    text = out.stdout + out.stderr
    assert out.returncode == 3, text[-4000:]
    assert re.search(r"no spare left for rank 1 \(member 1, pid \d+: SIGKILL\)", text), text[-3000:]
    again = _launch(_args(corpus, ck, local) + ["--resume-from-checkpoint", "latest"], spares=0)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    _assert_bitwise(ck / "default", reference)
