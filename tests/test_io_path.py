"""The byte path of a checkpoint, end to end through the real CLI: O_DIRECT where the filesystem takes it, buffered where
it does not (decided once, said in one log line), and checkpoints written by the previous version (crc32 manifests,
zip records with crc32) still verify, load and resume bit-exactly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from helpers import PY, ROOT, TINY, check_weights, env_for_tests, in_ci, kill_run_at_row, loss_rows, run_train

pytestmark = pytest.mark.slow  # end-to-end runs: `make test`, not `make test-fast`

STEPS = 16
FREQ = 4
#: The last commit whose checkpoints carry crc32 manifests and zip crcs (before the xxh3 / O_DIRECT byte path).
CRC32_COMMIT = "80c9f24"


def _args(corpus: str, ckdir: Path, backend: str, *, current: bool = True) -> list[str]:
    """The run every test here compares. The current version trains on every window (--eval-windows 0), as the crc32
    version, which had no held-out data, did: so all of them follow one trajectory."""
    return TINY + ["--dataset", corpus, "--training-steps", str(STEPS), "--checkpoint-frequency", str(FREQ),
                   "--log-loss-to-csv", "--checkpoint-dir", str(ckdir), "--checkpoint-backend", backend] + (
                   ["--eval-windows", "0"] if current else [])


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """Uninterrupted runs of the current version, per backend."""
    refs = {}
    for backend in ("vanilla", "concurrent", "dcp"):
        ck = tmp_path_factory.mktemp(f"ref-{backend}")
        proc = run_train(_args(corpus, ck, backend), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        refs[backend] = ck / "default"
    return refs


def _same_as(ref: Path, run: Path) -> None:
    cmp = check_weights(ref, run, "--tolerance", "0", "--optimizer")
    assert cmp.returncode == 0 and "bitwise" in cmp.stdout, cmp.stdout + cmp.stderr
    assert loss_rows(run / "loss.csv") == loss_rows(ref / "loss.csv")


def _kill_then_resume(cmd_prefix: list[str], args: list[str], run: Path, row: int, cwd: Path = ROOT,
                      env: dict | None = None) -> subprocess.CompletedProcess:
    kill_run_at_row(cmd_prefix + args, run / "loss.csv", row, cwd=cwd, env=env_for_tests(env))
    return run_train(args + ["--resume-from-checkpoint", "latest"], env=env, timeout=300)


# --- O_DIRECT and its fallback --------------------------------------------------------------------------------------


@pytest.fixture
def mounts(tmp_path):
    """A tmpfs and a ramfs of our own (root only). This kernel's tmpfs takes O_DIRECT (Linux >= 6.6); ramfs refuses
    it, as tmpfs did before 6.6 and as some network filesystems do."""
    made = []
    if os.geteuid() != 0 or shutil.which("mount") is None:
        reason = "mounting a tmpfs and a ramfs needs root and mount(8)"
        if in_ci():
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        for fs, opts in (("tmpfs", "size=512m"), ("ramfs", "")):
            mnt = tmp_path / fs
            mnt.mkdir()
            cmd = ["mount", "-t", fs] + (["-o", opts] if opts else []) + [fs, str(mnt)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                reason = f"cannot mount a {fs}: {proc.stderr.strip()}"
                if in_ci():
                    pytest.fail(reason)
                pytest.skip(reason)
            made.append(mnt)
        yield {m.name: m for m in made}
    finally:
        for mnt in made:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _direct_io_probe(folder: Path) -> bool:
    code = "import sys; from pathlib import Path; from checkpoint import fsio; print(fsio.direct_io(Path(sys.argv[1])))"
    out = subprocess.run([PY, "-c", code, str(folder)], capture_output=True, text=True, cwd=ROOT, env=env_for_tests())
    return out.stdout.strip() == "True"


@pytest.mark.parametrize("backend", ["concurrent", "vanilla"])
def test_kill_and_resume_on_tmpfs_and_on_a_filesystem_that_refuses_o_direct(corpus, reference, mounts, backend):
    """Killed mid-run and resumed on each filesystem: bit-exact with the uninterrupted run on disk, and the run says in
    one line which I/O it chose there."""
    expected = {"tmpfs": _direct_io_probe(mounts["tmpfs"]), "ramfs": False}
    for fs, mnt in mounts.items():
        args = _args(corpus, mnt / backend, backend)
        proc = _kill_then_resume([PY, str(ROOT / "train.py")], args, mnt / backend / "default", row=10)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = [line for line in proc.stdout.splitlines() if "checkpoint I/O:" in line]
        assert len(lines) == 1, proc.stdout[-2000:]
        if expected[fs]:
            assert "O_DIRECT writes in" in lines[0]
        else:
            assert "buffered writes in" in lines[0] and "refuses O_DIRECT" in lines[0]
        _same_as(reference[backend], mnt / backend / "default")


def test_direct_io_can_be_switched_off(corpus, reference, tmp_path):
    args = _args(corpus, tmp_path, "concurrent")
    env = {"PYRECOVER_DIRECT_IO": "off"}
    proc = _kill_then_resume([PY, str(ROOT / "train.py")], args, tmp_path / "default", row=10, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint I/O: buffered writes in" in proc.stdout and "PYRECOVER_DIRECT_IO=off" in proc.stdout
    _same_as(reference["concurrent"], tmp_path / "default")


# --- checkpoints of the previous version ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def crc32_version(tmp_path_factory) -> Path:
    """The source tree of the last version that wrote crc32 checkpoints, from this repository's history."""
    out = tmp_path_factory.mktemp("crc32-version")
    proc = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", CRC32_COMMIT], capture_output=True)
    if proc.returncode != 0:
        reason = f"commit {CRC32_COMMIT} is not in this clone ({proc.stderr.decode().strip()[:200]})"
        if in_ci():
            pytest.fail(reason)
        pytest.skip(reason)
    tar = out / "src.tar"
    tar.write_bytes(proc.stdout)
    with tarfile.open(tar) as t:
        t.extractall(out, filter="data")
    return out


@pytest.mark.parametrize("backend", ["vanilla", "concurrent", "dcp"])
def test_a_checkpoint_written_with_crc32_by_the_previous_version_resumes_bit_exactly(corpus, reference, tmp_path,
                                                                                    crc32_version, backend):
    run = tmp_path / "default"
    args = _args(corpus, tmp_path, backend, current=False)
    kill_run_at_row([PY, str(crc32_version / "train.py")] + args, run / "loss.csv", 10, cwd=crc32_version,
                    env=env_for_tests({"PYTHONPATH": str(crc32_version)}))
    old = sorted(run.glob("step-*/manifest.json"))
    assert old, "the previous version saved nothing before the kill"
    assert json.loads(old[-1].read_text())["checksum"] == "crc32"
    assert "manifest_crc32" in json.loads((old[-1].parent / "COMMITTED").read_text())
    verify = subprocess.run([PY, "-m", "checkpoint", "verify", str(old[-1].parent)], capture_output=True, text=True,
                            cwd=ROOT, env=env_for_tests())
    assert verify.returncode == 0, verify.stdout + verify.stderr
    # That version had no held-out data (it trained on every window): resuming it with the default --eval-windows is
    # refused in one line naming the fix, and with --eval-windows 0 it continues bit-exactly.
    refused = run_train(args + ["--resume-from-checkpoint", "latest"], timeout=300)
    assert refused.returncode == 2 and "resume with --eval-windows 0" in refused.stderr, refused.stderr[-3000:]
    proc = run_train(args + ["--eval-windows", "0", "--resume-from-checkpoint", "latest"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {old[-1].parent}" in proc.stdout
    _same_as(reference[backend], run)
    newest = sorted(run.glob("step-*/manifest.json"))[-1]
    assert json.loads(newest.read_text())["checksum"] == "xxh3_64"
