"""Who may write where, through the real CLI (issue 21): a holder whose lease record is deleted under it stops; a
mirror that is the primary under another name (a bind mount) is refused; a full disk at start-up leaves no probe.

The mount-based tests need root (``mount``); under CI=true they fail rather than skip.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import PY, ROOT, env_for_tests, in_ci, run_train, start_train
from test_single_writer import _args, _no_traceback, _part_run_ids

pytestmark = pytest.mark.slow  # end-to-end runs: `make test`, not `make test-fast`

STEPS, FREQ = 20, 5


def _mount(*argv: str) -> None:
    """Mount, or skip (fail under CI) saying why: these tests need real mounts, hence root."""
    done = subprocess.run(["mount", *argv], capture_output=True, text=True)
    if done.returncode != 0:
        why = f"cannot mount ({' '.join(argv)}: {done.stderr.strip()}); needs root"
        if in_ci():
            pytest.fail(why)
        pytest.skip(why)


def _wait_until(condition, proc: subprocess.Popen, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"run ended (rc {proc.returncode}) before {what}: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _holder_pid(owner_dir: Path, gen: int) -> int | None:
    try:
        return json.loads((owner_dir / f"gen-{gen:08d}.json").read_text()).get("pid")
    except (OSError, ValueError):
        return None


def _one_error_line(proc_stderr: str) -> str:
    lines = [ln for ln in proc_stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc_stderr[-3000:]
    return lines[0]


# --- 7. the lease record deleted mid-run ------------------------------------------------------------------------------


def test_deleted_lease_record_fences_the_holder_when_a_new_start_reuses_its_generation(corpus, tmp_path):
    """A holds generation 1. Its `.owner` is deleted while it is frozen, and B starts: B finds no lease and takes
    generation 1 too. When A runs again it must see that the generation-1 record is not its own, stop fenced (exit 6,
    one line), and commit nothing more: every checkpoint after B's resume point is B's alone."""
    root = tmp_path / "default"
    args = _args(corpus, tmp_path, "--resume-from-checkpoint", "latest", steps=STEPS, freq=FREQ)
    pace = {"PYRECOVER_STEP_SLEEP": "0.2"}
    a = start_train(args, pace)
    b = None
    try:
        _wait_until(lambda: (root / "step-00000005" / "COMMITTED").exists(), a, "A's step 5 committed")
        os.kill(a.pid, signal.SIGSTOP)
        a_ids = _part_run_ids(root)[FREQ]
        shutil.rmtree(root / ".owner")
        b = start_train(args, pace)
        _wait_until(lambda: _holder_pid(root / ".owner", 1) == b.pid, b, "B holding generation 1")
        os.kill(a.pid, signal.SIGCONT)
        a_out, a_err = a.communicate(timeout=300)
        b_out, b_err = b.communicate(timeout=300)
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.communicate()
    _no_traceback(a_out, a_err, b_out, b_err)
    assert b.returncode == 0, b_err[-3000:]
    assert a.returncode == 6, a_out[-2000:] + a_err[-2000:]
    line = _one_error_line(a_err)
    assert "fenced" in line and ".owner/gen-00000001.json" in line and f"pid {b.pid}" in line, line
    resumed = int(b_out.split("resumed from")[1].split("(step ")[1].split(",")[0])
    owners = _part_run_ids(root)
    after = {step: ids for step, ids in owners.items() if step > resumed}
    assert sorted(after) == list(range(resumed + FREQ, STEPS + 1, FREQ)), owners
    assert {frozenset(ids) for ids in after.values()} == {frozenset(owners[STEPS])} and not a_ids & owners[STEPS]
    check = subprocess.run([PY, "-m", "checkpoint", "verify", str(root)], cwd=ROOT, env=env_for_tests(),
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_deleted_lease_record_stops_the_holder_even_if_nobody_takes_over(corpus, tmp_path):
    root = tmp_path / "default"
    proc = start_train(_args(corpus, tmp_path, steps=STEPS, freq=FREQ), {"PYRECOVER_STEP_SLEEP": "0.2"})
    try:
        _wait_until(lambda: (root / "step-00000005" / "COMMITTED").exists(), proc, "step 5 committed")
        shutil.rmtree(root / ".owner")
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    _no_traceback(out, err)
    assert proc.returncode == 6, out[-2000:] + err[-2000:]
    line = _one_error_line(err)
    assert "lost its lease: .owner/gen-00000001.json was deleted" in line and "holds it now" not in line, line
    assert [p.name for p in root.glob("step-*")] == ["step-00000005"]  # nothing written once the lease was gone
    assert not (root / ".owner").exists()  # and the lease not silently re-created


# --- 10. a mirror that is the primary through a bind mount ------------------------------------------------------------


@pytest.fixture(scope="module")
def bind_mounted(tmp_path_factory):
    """(primary, alias): two names of one folder, the second a bind mount of the first."""
    base = tmp_path_factory.mktemp("bind")
    primary, alias = base / "primary", base / "alias"
    primary.mkdir()
    alias.mkdir()
    _mount("--bind", str(primary), str(alias))
    try:
        yield primary, alias
    finally:
        subprocess.run(["umount", str(alias)], capture_output=True)


@pytest.mark.parametrize("mirror_under, refusal", [("", "is the --checkpoint-dir itself under another name"),
                                                   ("default/inner", "hold one another")])
def test_a_mirror_that_is_the_primary_through_a_bind_mount_is_refused(corpus, bind_mounted, mirror_under, refusal):
    primary, alias = bind_mounted
    mirror = alias / mirror_under
    proc = run_train(_args(corpus, primary, "--mirror-dir", str(mirror), steps=STEPS, freq=FREQ))
    _no_traceback(proc.stdout, proc.stderr)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = _one_error_line(proc.stderr)
    assert line.startswith(f"error: --mirror-dir {mirror} ") and refusal in line, line
    assert not list(primary.iterdir())  # refused before anything was written


# --- 11. ENOSPC at start-up -------------------------------------------------------------------------------------------


def test_a_full_checkpoint_dir_at_start_is_one_line_and_leaves_no_probe(corpus, tmp_path):
    mnt = tmp_path / "full"
    mnt.mkdir()
    _mount("-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt))
    try:
        try:
            with open(mnt / "fill", "wb") as f:
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()
        except OSError:
            pass
        proc = run_train(_args(corpus, mnt, steps=STEPS, freq=FREQ))
        _no_traceback(proc.stdout, proc.stderr)
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        line = _one_error_line(proc.stderr)
        assert f"checkpoint directory {mnt / 'default'}" in line and "No space left on device" in line, line
        assert not list(mnt.rglob(".write-probe-*")), list(mnt.rglob("*"))
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
