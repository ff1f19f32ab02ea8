"""--mirror-dir s3://... against the local SeaweedFS server: a local primary, the mirror on S3, committed and verified
there (`python -m checkpoint verify s3://...`), and a resume from it with the primary deleted, bitwise."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ (helpers)
from helpers import PY, ROOT, TINY, check_weights, env_for_tests, loss_rows, run_train  # noqa: E402

pytestmark = pytest.mark.s3

STEPS = 8


def _ok(proc: subprocess.CompletedProcess) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-4000:]}"
    assert "Traceback" not in out, out[-4000:]
    return out


def _committed_on_s3(server, prefix: str) -> list[int]:
    return sorted(int(k[len(prefix) + 1:].split("/")[0][5:]) for k in server.list_keys(prefix + "/")
                  if k.endswith("/COMMITTED") and k[len(prefix) + 1:].startswith("step-"))


def test_s3_mirror_verifies_and_resumes_with_the_primary_deleted(corpus, s3_server, tmp_path):
    env = s3_server.full_env(env_for_tests())
    common = TINY + ["--dataset", corpus, "--training-steps", str(STEPS), "--checkpoint-frequency", "2"]
    ref = tmp_path / "ref"
    _ok(run_train(common + ["--checkpoint-dir", str(ref), "--log-loss-to-csv", str(ref / "loss.csv")], env=env))

    uri = s3_server.uri("mirror")
    csv = tmp_path / "loss.csv"
    run = common + ["--checkpoint-dir", str(tmp_path / "p"), "--mirror-dir", uri, "--log-loss-to-csv", str(csv)]
    crashed = run_train(run, env={**env, "PYRECOVER_CRASH_AT_STEP": "7", "PYRECOVER_STEP_SLEEP": "0.4"})
    assert crashed.returncode == -signal.SIGKILL, crashed.stdout[-2000:] + crashed.stderr[-2000:]
    in_mirror = _committed_on_s3(s3_server, "mirror/default")
    assert in_mirror and set(in_mirror) <= {2, 4, 6}, in_mirror

    def verify() -> subprocess.CompletedProcess:
        return subprocess.run([PY, "-m", "checkpoint", "verify", f"{uri}/default"], capture_output=True, text=True,
                              timeout=120, env=env, cwd=ROOT)

    # every committed copy verifies; a copy the kill cut short (written in place) is only ever uncommitted
    check = verify()
    lines = check.stdout.splitlines()
    assert sum(": OK (" in line for line in lines) == len(in_mirror), check.stdout + check.stderr
    assert all(": OK (" in line or line.endswith(": not committed") for line in lines), check.stdout

    shutil.rmtree(tmp_path / "p")  # the node and its local disk are gone
    out = _ok(run_train(run + ["--resume-from-checkpoint", "latest"], env=env))
    newest = f"{uri}/default/step-{in_mirror[-1]:08d}"
    assert [line for line in out.splitlines() if line.startswith("resume: ")] == [
        f"resume: the primary {tmp_path / 'p' / 'default'} has no valid checkpoint at or after step {in_mirror[-1]}; "
        f"using the mirror's {newest}"], out[-3000:]
    assert f"resumed from {newest} (step {in_mirror[-1]}," in out
    same = check_weights(tmp_path / "p" / "default", ref / "default", "--tolerance", "0", "--optimizer")
    assert same.returncode == 0, same.stdout + same.stderr
    assert loss_rows(csv) == loss_rows(ref / "loss.csv")
    assert _committed_on_s3(s3_server, "mirror/default")[-1] == STEPS  # retention: the default keeps 3
    assert len(_committed_on_s3(s3_server, "mirror/default")) <= 3
    check = verify()  # the interrupted copy was swept at the start
    assert check.returncode == 0 and "not committed" not in check.stdout, check.stdout + check.stderr
