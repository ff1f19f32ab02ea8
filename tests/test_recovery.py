"""In-process recovery (issue 56) through the real CLI: launcher.py starts 2 gloo ranks of train.py and a spare on
this machine; a rank is SIGKILLed, or raises, in a training step; the survivor keeps its process, the spare takes the
dead rank, every rank reloads the newest step they all reach (the node-local tier), and the run ends bitwise an
uninterrupted torchrun run's: weights, optimizer state, loss rows."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from helpers import PY, ROOT, TINY, check_weights, env_for_tests, loss_rows, run_torchrun

pytestmark = pytest.mark.slow

STEPS = 12


def _args(corpus: str, ck: Path, local: Path) -> list[str]:
    return TINY + ["--dataset", corpus, "--checkpoint-dir", str(ck), "--training-steps", str(STEPS),
                   "--checkpoint-frequency", "4", "--local-checkpoint-dir", str(local), "--local-checkpoint-frequency",
                   "2", "--log-loss-to-csv"]


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


def _assert_bitwise(run: Path, reference: Path) -> None:
    cmp = check_weights(run / f"step-{STEPS:08d}", reference / f"step-{STEPS:08d}", "--tolerance", "0", "--optimizer")
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr
    assert loss_rows(run / "loss.csv") == loss_rows(reference / "loss.csv")


@pytest.mark.parametrize("mode,rank", [("kill", 1), ("raise", 1), ("kill", 0)])
def test_a_rank_killed_or_raising_in_a_step_recovers_in_process_and_ends_bitwise(tmp_path, corpus, reference, mode,
                                                                                   rank):
    """Rank 0 killed: the spare becomes rank 0 (the lease, the loss CSV, the shared state's counters are its)."""
    ck, local = tmp_path / "ck", tmp_path / "local"
    out = _launch(_args(corpus, ck, local), env={"PYRECOVER_CRASH_AT_STEP": f"7:{rank}:{mode}",
                                                  "PYRECOVER_CRASH_ONCE": str(tmp_path / "crashed")})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    members = _members(text)
    assert members[0][1] == "rank 0" and members[1][1] == "rank 1" and members[2][1] == "spare", text[-3000:]
    # one recovery, in process: the spare takes rank 1 if it died; a rank that raised keeps its rank
    line = re.search(r"launcher: generation 1: (.*)", text).group(1)
    if mode == "kill":
        assert f"rank {rank} (member {rank}" in line and "died (SIGKILL)" in line, line
        assert f"member 2 (spare) takes rank {rank}" in line, line
    else:
        assert "failed (RuntimeError: injected crash of rank 1 at step 7)" in line and "takes" not in line, line
    recovered = re.search(r"^recovery: (.*) failed; generation 1 resumed step (\d+) from (.*) in-process; (.*)$", text,
                          re.M)
    assert recovered and int(recovered.group(2)) == 6, text[-4000:]
    assert "local tier" in recovered.group(3), recovered.group(0)
    # no member was started again: the launcher started three processes, once each
    assert len(re.findall(r"launcher: member \d+ pid", text)) == 3
    assert "generation 2" not in text
    _assert_bitwise(ck / "default", reference)
    assert [r[3] for r in loss_rows(ck / "default" / "loss.csv")] == [str(256 * s) for s in range(1, STEPS + 1)]


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
    _assert_bitwise(ck / "default", reference)


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


def test_without_a_spare_the_ranks_end_and_a_restart_resumes_bitwise(tmp_path, corpus, reference):
    """No spare left for the dead rank: the survivor ends (exit 3, as a requeue), and the next start resumes from the
    last committed step: today's path, which in-process recovery only shortens."""
    ck, local = tmp_path / "ck", tmp_path / "local"
    out = _launch(_args(corpus, ck, local), spares=0, env={"PYRECOVER_CRASH_AT_STEP": "7:1:kill"})
    text = out.stdout + out.stderr
    assert out.returncode == 3, text[-4000:]
    assert re.search(r"no spare left for rank 1 \(member 1, pid \d+: SIGKILL\)", text), text[-3000:]
    again = _launch(_args(corpus, ck, local) + ["--resume-from-checkpoint", "latest"], spares=0)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    _assert_bitwise(ck / "default", reference)
