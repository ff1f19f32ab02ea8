"""train.py with --checkpoint-dir s3://bucket/prefix (dcp backend) against the local SeaweedFS server: kill -9, resume
`latest` from S3 bit-exact, retention on S3, the loss CSV on local disk, conversion from S3, and the one-line startup
errors for a missing bucket and wrong credentials."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ (helpers)
from helpers import PY, ROOT, TINY, env_for_tests, loss_rows, torchrun_cmd  # noqa: E402
from test_dcp import kill_run_at_row  # noqa: E402  (kills torchrun AND its ranks)

pytestmark = pytest.mark.s3

STEPS = 12
FREQ = 4


def _args(corpus: str, ckdir: str, *extra: str) -> list[str]:
    return TINY + ["--dataset", corpus, "--training-steps", str(STEPS), "--checkpoint-frequency", str(FREQ),
                   "--checkpoint-dir", ckdir, "--use-torch-distributed-ckpt", "--distributed", *extra]


def _run(cmd: list[str], env: dict, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}"
    return proc


def _steps_on_s3(server, prefix: str) -> dict[str, set[str]]:
    """{step folder: file names} of every object under prefix/."""
    out: dict[str, set[str]] = {}
    for key in server.list_keys(prefix + "/"):
        rest = key[len(prefix) + 1:]
        folder, _, name = rest.partition("/")
        out.setdefault(folder, set()).add(name)
    return out


def test_train_kill_resume_latest_from_s3_is_bit_exact_with_retention(corpus, s3_server, tmp_path):
    env = s3_server.full_env(env_for_tests())
    # the reference: the same run, uninterrupted, on local disk
    ref = tmp_path / "ref"
    _ok(_run(torchrun_cmd(2, _args(corpus, str(ref), "--log-loss-to-csv", "--max-kept-checkpoints", "0")), env, ROOT))
    ref_root = ref / "default"

    uri = s3_server.uri("train-kill")
    args = _args(corpus, uri, "--log-loss-to-csv", "--max-kept-checkpoints", "2")
    csv = tmp_path / "logs" / "default" / "loss.csv"  # s3:// checkpoints: the loss CSV goes to ./logs/<experiment>/
    kill_run_at_row(torchrun_cmd(2, args), csv, FREQ + 3, env=env, cwd=tmp_path)  # kill -9 torchrun and both ranks
    steps = _steps_on_s3(s3_server, "train-kill/default")
    assert "COMMITTED" in steps["step-00000004"] and "COMMITTED" not in steps.get("step-00000008", set())

    # resume from S3 (async saves this time: same bytes), finish
    out = _ok(_run(torchrun_cmd(2, args + ["--resume-from-checkpoint", "latest", "--async-checkpoint"]), env, tmp_path))
    assert f"resumed from {uri}/default/step-00000004 (step 4, dcp backend" in out.stdout, out.stdout[-2000:]
    assert loss_rows(csv) == loss_rows(ref_root / "loss.csv")
    assert not (tmp_path / "s3:").exists() and not (ROOT / "s3:").exists()  # nothing written to a local "s3:" folder

    # retention on S3: the newest 2 committed checkpoints, nothing of the deleted ones, no probe/tmp objects; beside
    # them the run's resolved flags (--config), an object of the run directory like any other file of it
    steps = _steps_on_s3(s3_server, "train-kill/default")
    assert sorted(steps) == ["config.resolved.json", "places.json", "step-00000008", "step-00000012"], sorted(steps)
    for record in ("config.resolved.json", "places.json"):
        assert steps.pop(record) == {""}  # one object at the run's top level
    for names in steps.values():
        assert {"COMMITTED", "manifest.json", ".metadata", "__0_0.distcp", "__1_0.distcp", "part-rank-00000.json",
                "part-rank-00001.json", "rank-00000.pt", "rank-00001.pt", "train_state.pt"} <= names, names
        assert not [n for n in names if n.endswith(".tmp")]

    # the tools read s3:// too: weights + optimizer bitwise equal to the local reference; list; convert to local
    def tool(*a: str) -> subprocess.CompletedProcess:
        return _run([PY, *a], env, ROOT, timeout=300)

    cmp = tool(str(ROOT / "tests/check_weights_equality.py"), f"{uri}/default", str(ref_root), "--tolerance", "0",
               "--optimizer")
    assert cmp.returncode == 0 and "bitwise" in cmp.stdout, cmp.stdout + cmp.stderr
    listing = _ok(tool("-m", "checkpoint", "list", f"{uri}/default")).stdout
    assert "<- latest" in listing and "dcp" in listing and "step-00000004" not in listing
    _ok(tool("-m", "checkpoint", "convert", f"{uri}/default", str(tmp_path / "van"), "--to", "vanilla"))
    cmp = tool(str(ROOT / "tests/check_weights_equality.py"), str(tmp_path / "van"), str(ref_root), "--tolerance", "0",
               "--optimizer")
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr


def _startup_error(corpus: str, s3_server, tmp_path: Path, uri: str, **creds) -> str:
    env = s3_server.full_env(env_for_tests(), **creds)
    args = [a for a in _args(corpus, uri) if a != "--distributed"]
    proc = _run([PY, str(ROOT / "train.py"), *args], env, tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "step 1" not in proc.stdout and "model tiny" not in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def test_missing_bucket_and_wrong_credentials_fail_in_one_line_before_training(corpus, s3_server, tmp_path):
    line = _startup_error(corpus, s3_server, tmp_path, "s3://no-such-bucket/x")
    assert "bucket 'no-such-bucket' does not exist" in line, line
    line = _startup_error(corpus, s3_server, tmp_path, s3_server.uri("x"), secret_key="wrong-secret")
    assert "rejected the credentials" in line and "AWS_SECRET_ACCESS_KEY" in line, line
    line = _startup_error(corpus, s3_server, tmp_path, s3_server.uri("x"), access_key="NOSUCHKEY")
    assert "rejected the credentials" in line, line
    assert not s3_server.list_keys("x/")  # nothing was written
