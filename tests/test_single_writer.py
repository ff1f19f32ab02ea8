"""One writer per run directory, no un-commit window, `latest` follows the resumed line, save errors at mkdir.

Real train.py processes on real files: two incarnations on one run directory, kills at named points of the save path,
a tmpfs that runs out of inodes. Every run is compared bitwise with one uninterrupted reference run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import PY, ROOT, TINY, check_weights, env_for_tests, in_ci, loss_rows, run_train, start_train, wait_rows

sys.path.insert(0, str(ROOT))
from checkpoint import layout  # noqa: E402

pytestmark = pytest.mark.slow  # end-to-end runs: `make test`, not `make test-fast`

STEPS = 12


def _args(corpus: str, ckpt: Path, *more: str, steps: int = STEPS, freq: int = 4) -> list[str]:
    return TINY + ["--dataset", corpus, "--training-steps", str(steps), "--checkpoint-frequency", str(freq),
                   "--checkpoint-dir", str(ckpt), "--log-loss-to-csv", "--max-kept-checkpoints", "0", *more]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    """An uninterrupted run: every interrupted one below must end bitwise equal to it."""
    ckpt = tmp_path_factory.mktemp("reference")
    run_train(_args(corpus, ckpt), check=True)
    return ckpt / "default"


def _assert_same_as_reference(reference: Path, root: Path) -> None:
    assert loss_rows(root / "loss.csv") == loss_rows(reference / "loss.csv")
    final = layout.step_dir_name(STEPS)
    diff = check_weights(reference / final, root / final, "--tolerance", "0", "--optimizer")
    assert diff.returncode == 0, diff.stdout + diff.stderr


def _no_traceback(*texts: str) -> None:
    for t in texts:
        assert "Traceback" not in t, t[-3000:]


def _part_run_ids(root: Path) -> dict[int, set[str]]:
    """step -> the run ids (incarnations) whose part records make up that committed checkpoint."""
    out = {}
    for info in layout.list_checkpoints(root):
        out[info.step] = {json.loads(p.read_text())["run_id"] for p in info.path.glob("part-rank-*.json")}
    return out


# --- 1. one writer ----------------------------------------------------------------------------------------------------


def test_second_launch_on_a_live_run_directory_is_refused_in_one_line(corpus, tmp_path, reference):
    args = _args(corpus, tmp_path, "--resume-from-checkpoint", "latest")
    first = start_train(args, {"PYRECOVER_STEP_SLEEP": "0.1"})
    wait_rows(tmp_path / "default/loss.csv", 3, first)
    os.kill(first.pid, signal.SIGSTOP)  # alive, holding the run directory, whatever the machine's speed
    try:
        second = run_train(args)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert second.returncode == 2, second.stdout + second.stderr
    lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), second.stderr
    assert "in use by" in lines[0] and f"pid {first.pid}" in lines[0] and "--force-takeover" in lines[0]
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    _no_traceback(out, err, second.stderr)
    # The refused start touched nothing: every step once in the loss CSV, the same result as without it.
    _assert_same_as_reference(reference, tmp_path / "default")


def test_takeover_fences_the_old_incarnation_which_changes_nothing_after(corpus, tmp_path, reference):
    """A concurrent-backend run is taken over while it trains and saves (a stale incarnation, as after a requeue):
    it stops with exit 6 without committing, retiring or deleting anything; the new one ends bitwise exact."""
    root = tmp_path / "default"
    args = _args(corpus, tmp_path, "--resume-from-checkpoint", "latest", "--checkpoint-backend", "concurrent", freq=2)
    old = start_train(args, {"PYRECOVER_STEP_SLEEP": "0.1"})
    wait_rows(root / "loss.csv", 5, old)
    os.kill(old.pid, signal.SIGSTOP)  # frozen mid-run (its background save may be half written), as a stale node
    try:
        new = start_train(args + ["--force-takeover"])
        wait_rows(root / "loss.csv", 9, new)
    finally:
        os.kill(old.pid, signal.SIGCONT)  # it wakes up while the new one trains and saves
    new_out, new_err = new.communicate(timeout=300)
    old_out, old_err = old.communicate(timeout=300)
    assert new.returncode == 0, new_err[-3000:]
    assert "taking over from --force-takeover" in new_out
    resumed = int(new_out.split("resumed from")[1].split("(step ")[1].split(",")[0])
    assert old.returncode == 6, old_out[-2000:] + old_err[-2000:]
    assert "fenced" in old_err and old_err.strip().count("\n") == 0, old_err
    _no_traceback(new_out, new_err, old_out, old_err)
    # Every checkpoint after the takeover was written by the new incarnation alone, and all of them verify.
    owners = _part_run_ids(root)
    assert len({frozenset(ids) for step, ids in owners.items() if step > resumed}) == 1
    assert all(len(ids) == 1 for ids in owners.values())
    assert subprocess.run([PY, "-m", "checkpoint", "verify", str(root)], cwd=ROOT, env=env_for_tests(),
                          capture_output=True).returncode == 0
    _assert_same_as_reference(reference, root)
    assert not list(root.glob(".staging-*")) and not list(root.glob(".trash-*"))


# --- 2 and 6. no un-commit window; `latest` follows the resumed line --------------------------------------------------


def test_resume_from_older_step_keeps_the_newer_checkpoint_through_a_kill(corpus, tmp_path, reference):
    """Steps 4, 8, 12 valid; resume from 4 and die right after the new step 8's files are written: the old step 8
    (and 12) must still exist and verify (moved aside, named), and `latest` is 4 of the line the run follows."""
    root = tmp_path / "default"
    run_train(_args(corpus, tmp_path), check=True)
    proc = run_train(_args(corpus, tmp_path, "--resume-from-checkpoint", "4"),
                     env={"PYRECOVER_FAULT": "after_manifest_before_commit:1"})
    assert proc.returncode != 0
    assert "moved the newer checkpoints of the abandoned line (8, 12)" in proc.stdout
    retired = list((root / layout.RETIRED_DIR).glob("*-after-step-4"))
    assert len(retired) == 1
    assert (retired[0] / "config.resolved.json").is_file()  # the abandoned line keeps the flags that produced it
    for step in (8, 12):
        ok = subprocess.run([PY, "-m", "checkpoint", "verify", str(retired[0] / layout.step_dir_name(step))],
                            cwd=ROOT, env=env_for_tests(), capture_output=True, text=True)
        assert ok.returncode == 0, ok.stdout + ok.stderr
    assert [i.step for i in layout.list_checkpoints(root)] == [4]
    assert layout.resolve(root, "latest").step == 4
    proc = run_train(_args(corpus, tmp_path, "--resume-from-checkpoint", "latest"), check=True)
    assert "step 4" in proc.stdout.split("resumed from")[1].splitlines()[0]
    _assert_same_as_reference(reference, root)
    assert not list(root.glob(".staging-*")) and not list(root.glob(".trash-*"))


def test_latest_never_jumps_back_to_an_abandoned_line(corpus, tmp_path, reference):
    """Steps 4, 8, 12 (12 also a --keep-every snapshot); resume from 4, commit 6, crash: `latest` is 6, not 12."""
    root = tmp_path / "default"
    run_train(_args(corpus, tmp_path, "--keep-every", "12"), check=True)
    run = start_train(_args(corpus, tmp_path, "--resume-from-checkpoint", "4", freq=2), {"PYRECOVER_STEP_SLEEP": "0.2"})
    deadline = time.monotonic() + 240
    while not (root / layout.step_dir_name(6) / layout.COMMITTED).exists():
        assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()[-2000:]
        time.sleep(0.01)
    run.kill()  # a crash once step 6 of the new line has committed (and before step 8 can)
    run.communicate()
    listing = subprocess.run([PY, "-m", "checkpoint", "list", str(root)], cwd=ROOT, env=env_for_tests(),
                             capture_output=True, text=True).stdout
    latest = [ln for ln in listing.splitlines() if "<- latest" in ln]
    assert len(latest) == 1 and latest[0].split()[0] == "6", listing
    assert [i.step for i in layout.list_checkpoints(root)] == [4, 6]
    kept = list((root / layout.RETIRED_DIR).glob(f"*/{layout.step_dir_name(12)}/{layout.COMMITTED}"))
    assert len(kept) == 1  # the keep-every snapshot is kept, aside
    proc = run_train(_args(corpus, tmp_path, "--resume-from-checkpoint", "latest"), check=True)
    assert "(step 6," in proc.stdout
    _assert_same_as_reference(reference, root)


def test_kill_between_the_two_renames_of_a_replacement_is_finished_atstart_train(corpus, tmp_path, reference):
    """Replacing a committed step-N is rename(old -> trash), rename(new -> step-N). Killed between the two, neither
    copy is lost: the next start publishes the committed new one and removes the trash."""
    root = tmp_path / "default"
    run_train(_args(corpus, tmp_path), check=True)
    # A committed copy of step 12 staged by an incarnation that is replacing step-12 (as JIT does for a broken one).
    staged = root / ".staging-0123456789ab" / layout.step_dir_name(STEPS)
    shutil.copytree(root / layout.step_dir_name(STEPS), staged)
    code = (f"from checkpoint import layout; from pathlib import Path; "
            f"layout.publish(Path({str(staged)!r}), Path({str(root)!r}), {STEPS}, tag='test')")
    proc = subprocess.run([PY, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env=env_for_tests({"PYRECOVER_FAULT": "between_replace_renames"}))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not (root / layout.step_dir_name(STEPS)).exists() and len(list(root.glob(".trash-*"))) == 1
    proc = run_train(_args(corpus, tmp_path, "--resume-from-checkpoint", "latest"), check=True)
    assert f"published {layout.step_dir_name(STEPS)}" in proc.stdout
    assert f"(step {STEPS}," in proc.stdout  # resumed from the published copy: nothing left to train
    assert not list(root.glob(".trash-*")) and not list(root.glob(".staging-*"))
    _assert_same_as_reference(reference, root)


# --- 3. a save that fails creating its folder -------------------------------------------------------------------------


def _mount_tmpfs(path: Path, options: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode == 0


def test_out_of_inodes_at_mkdir_is_one_line_and_honours_on_save_error(corpus, tmp_path, reference):
    mnt = tmp_path / "tmpfs"
    if not _mount_tmpfs(mnt, "size=512m,nr_inodes=400"):
        if in_ci():
            pytest.fail("cannot mount a tmpfs (needs root): the out-of-inodes test cannot run")
        pytest.skip("cannot mount a tmpfs (needs root)")
    try:
        root = mnt / "default"
        proc = start_train(_args(corpus, mnt, "--on-save-error", "continue", freq=2), {"PYRECOVER_STEP_SLEEP": "0.3"})
        wait_rows(root / "loss.csv", 3, proc)  # step 2 is committed
        fill = mnt / "fill"
        fill.mkdir()
        n = 0
        try:
            while True:
                (fill / str(n)).touch()
                n += 1
        except OSError:
            pass
        wait_rows(root / "loss.csv", 7, proc)  # the saves of steps 4 and 6 hit the full inode table
        shutil.rmtree(fill)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        _no_traceback(out, err)
        warnings = [ln for ln in err.splitlines() if ln.startswith("warning: saving step")]
        assert warnings and all("no space left on device" in w and "training continues" in w for w in warnings), err
        assert layout.resolve(root, "latest").step == STEPS
        _assert_same_as_reference(reference, root)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
