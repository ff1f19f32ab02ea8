"""--mirror-dir: committed checkpoints copied to a second location in the background (checkpoint/mirror.py), through
the real CLI: every/keep, resume from the mirror with the primary deleted (bitwise), SIGKILL mid-copy, a mirror that
fails, and the refusals. The S3 mirror is tests/s3/test_s3_mirror.py."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import PY, ROOT, TINY, check_weights, env_for_tests, loss_rows, run_train

pytestmark = pytest.mark.slow  # end-to-end runs: `make test`, not `make test-fast`

STEPS = 8


def flags(corpus: str, primary: Path, mirror: Path | str, *extra: str, steps: int = STEPS) -> list[str]:
    return TINY + ["--dataset", corpus, "--training-steps", str(steps), "--checkpoint-dir", str(primary),
                   "--mirror-dir", str(mirror), *extra]


def ok(proc: subprocess.CompletedProcess) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-4000:]}"
    assert "Traceback" not in out, out[-4000:]
    return out


def committed(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if (p / "COMMITTED").exists())


def verify(path: Path | str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "checkpoint", "verify", str(path)], capture_output=True, text=True, timeout=120,
                          env=env or env_for_tests(), cwd=ROOT)


def mirrored_steps(out: str) -> list[int]:
    return [int(s) for s in re.findall(r"^mirror: step (\d+) copied", out, re.M)]


def test_local_mirror_every_keep_and_final(tmp_path, corpus):
    # saves at 2, 4, 6, 8, 10; mirrored: the multiples of 4 and the final step 10; the mirror keeps the newest 2
    out = ok(run_train(flags(corpus, tmp_path / "p", tmp_path / "m", "--checkpoint-frequency", "2", "--mirror-every",
                             "4", "--mirror-keep", "2", "--max-kept-checkpoints", "0", steps=10)))
    copied = mirrored_steps(out)
    assert copied[-1] == 10 and set(copied) <= {4, 8, 10}, out[-3000:]  # 8 may be skipped if 10 came while 4 copied
    mirror = tmp_path / "m" / "default"
    assert committed(mirror) == copied[-2:], out[-3000:]
    assert committed(tmp_path / "p" / "default") == [2, 4, 6, 8, 10]  # the primary's own retention is unchanged
    assert not [p for p in mirror.iterdir() if p.name.startswith(".")], list(mirror.iterdir())  # no staging left
    check = verify(mirror)
    assert check.returncode == 0 and check.stdout.count(": OK (") == len(copied[-2:]), check.stdout + check.stderr
    assert re.search(rf"^mirror: {len(copied)} copied, 0 failed, .*last mirrored step 10, ", out, re.M), out[-2000:]
    # the mirror's files are the primary's, byte for byte (manifest and marker included)
    for name in ("manifest.json", "COMMITTED", "model.pt"):
        primary = tmp_path / "p" / "default" / "step-00000010" / name
        assert (mirror / "step-00000010" / name).read_bytes() == primary.read_bytes()


def test_primary_deleted_resumes_from_the_mirror_bitwise(tmp_path, corpus):
    common = ["--checkpoint-frequency", "2"]
    ref = tmp_path / "ref"
    ok(run_train(TINY + ["--dataset", corpus, "--training-steps", str(STEPS), "--checkpoint-dir", str(ref),
                         "--log-loss-to-csv", str(ref / "loss.csv"), *common]))
    csv = tmp_path / "loss.csv"  # outside the primary: it survives the primary's loss
    run = flags(corpus, tmp_path / "p", tmp_path / "m", "--log-loss-to-csv", str(csv), *common)
    # killed (SIGKILL) after the forward pass of step 7: the primary has 2, 4, 6; the mirror what it copied by then
    # (steps paced so that it copied at least one)
    crashed = run_train(run, env={"PYRECOVER_CRASH_AT_STEP": "7", "PYRECOVER_STEP_SLEEP": "0.4"})
    assert crashed.returncode == -signal.SIGKILL, crashed.stdout[-2000:] + crashed.stderr[-2000:]
    in_mirror = committed(tmp_path / "m" / "default")
    assert in_mirror and set(in_mirror) <= {2, 4, 6}, in_mirror
    shutil.rmtree(tmp_path / "p")  # the node and its local disk are gone

    out = ok(run_train(run + ["--resume-from-checkpoint", "latest"]))
    newest = in_mirror[-1]
    said = [line for line in out.splitlines() if line.startswith("resume: ")]
    assert said == [f"resume: the primary {tmp_path / 'p' / 'default'} has no valid checkpoint at or after step "
                    f"{newest}; using the mirror's {tmp_path / 'm' / 'default' / f'step-{newest:08d}'}"], out[-3000:]
    assert f"resumed from {tmp_path / 'm' / 'default' / f'step-{newest:08d}'} (step {newest}," in out
    same = check_weights(tmp_path / "p" / "default", ref / "default", "--tolerance", "0", "--optimizer")
    assert same.returncode == 0, same.stdout + same.stderr
    assert loss_rows(csv) == loss_rows(ref / "loss.csv")
    assert committed(tmp_path / "p" / "default")[-1] == STEPS  # the primary works again from there
    assert committed(tmp_path / "m" / "default")[-1] == STEPS


@pytest.mark.parametrize("backend", ["dcp"])  # vanilla above; concurrent writes the same files
def test_every_backend_mirrors_and_resumes_from_the_mirror(tmp_path, corpus, backend):
    """The mirror copies what the manifest lists, whatever the layout of the backend's files (dcp: its own file names
    and metadata): the mirror's checkpoint is the primary's, and a resume with the primary gone loads it."""
    run = flags(corpus, tmp_path / "p", tmp_path / "m", "--checkpoint-frequency", "2", "--checkpoint-backend", backend,
                steps=4)
    ok(run_train(run))
    primary, mirror = tmp_path / "p" / "default", tmp_path / "m" / "default"
    assert committed(mirror) == [4] or committed(mirror) == [2, 4], committed(mirror)
    same = check_weights(primary / "step-00000004", mirror / "step-00000004", "--tolerance", "0", "--optimizer")
    assert same.returncode == 0, same.stdout + same.stderr
    assert verify(mirror).returncode == 0
    shutil.rmtree(tmp_path / "p")
    out = ok(run_train(run + ["--resume-from-checkpoint", "latest", "--training-steps", "6"]))
    assert f"resumed from {mirror / 'step-00000004'} (step 4, {backend} backend" in out, out[-3000:]
    assert committed(primary)[-1] == 6 and committed(mirror)[-1] == 6


def test_sigkill_while_mirroring_leaves_no_committed_partial(tmp_path, corpus):
    mirror = tmp_path / "m" / "default"
    run = flags(corpus, tmp_path / "p", tmp_path / "m", "--checkpoint-frequency", "2", steps=4)
    # each mirrored file takes 1 s more: the copy of step 2 is still running when the run is killed
    proc = subprocess.Popen([PY, str(ROOT / "train.py"), *run], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env_for_tests({"PYRECOVER_MIRROR_DELAY_S": "1"}), cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 120
    try:
        while not any(mirror.glob(".staging-mirror-*/step-*/*.pt")):
            assert proc.poll() is None, f"run ended (rc {proc.returncode}) before the mirror started copying"
            assert time.monotonic() < deadline, "the mirror never started copying"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert committed(mirror) == [] and not list(mirror.glob("step-*")), list(mirror.iterdir())
    assert list(mirror.glob(".staging-mirror-*/step-*")), "the kill came after the copy: nothing was tested"

    out = ok(run_train(run + ["--resume-from-checkpoint", "latest"]))
    swept = r"run directory: removed what interrupted saves left \(\.staging-mirror-\w+/step-00000002\)"
    assert re.search(swept, out), out[-3000:]
    assert not [p for p in mirror.iterdir() if p.name.startswith(".staging-")]
    # the copy the kill cut short is made again (the resumed step, or a newer one), and verifies
    assert committed(mirror) and committed(mirror)[-1] == committed(tmp_path / "p" / "default")[-1], out[-3000:]
    check = verify(mirror)
    assert check.returncode == 0 and "FAILED" not in check.stdout, check.stdout + check.stderr


def test_a_failing_mirror_warns_once_and_training_finishes(tmp_path, corpus):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the mirror's folder should be")
    out = ok(run_train(flags(corpus, tmp_path / "p", blocker, "--checkpoint-frequency", "2", steps=4)))
    warnings = [line for line in out.splitlines() if line.startswith("warning: mirror:")]
    assert len(warnings) == 1, out[-3000:]
    assert "copying step 2 to the mirror" in warnings[0] and "retried" in warnings[0], warnings
    assert re.search(r"^mirror: 0 copied, 2 failed \(steps 2, 4\), last mirrored step none", out, re.M), out[-3000:]
    assert committed(tmp_path / "p" / "default") == [2, 4]


def test_refusals(tmp_path, corpus):
    same = run_train(flags(corpus, tmp_path / "p", tmp_path / "p", steps=2))
    assert same.returncode == 2 and same.stderr.strip().splitlines() == [
        f"error: --mirror-dir {tmp_path / 'p'} is the --checkpoint-dir itself; give the mirror another location "
        "(e.g. the shared filesystem or s3://bucket/prefix)"], same.stderr
    every = run_train(flags(corpus, tmp_path / "p", tmp_path / "m", "--mirror-every", "0", steps=2))
    assert every.returncode == 2 and every.stderr.strip().splitlines() == [
        "error: --mirror-every 0 is out of range; give a number >= 1"], every.stderr


def test_the_walltime_stop_counts_the_mirror_time():
    """A clean exit waits for the final checkpoint to reach the mirror: the time-aware stop needs save + mirror."""
    from checkpoint.manager import SaveRecord
    from checkpoint.policy import IntervalPolicy, StepBoundary
    from checkpoint.walltime import WalltimePolicy

    wt = WalltimePolicy(lambda: (1000.0, "test"), margin_s=0, step_factor=0, clock=lambda: 0.0, background=False)
    wt.start()
    history = [SaveRecord(step=10, blocking_s=1.0, durable_s=5.0, mirror_s=30.0)]
    StepBoundary(IntervalPolicy(0, 100), agree=lambda v: v, walltime=wt, save_history=history).local_vote()
    assert wt.needed() == 35.0
