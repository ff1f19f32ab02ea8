"""The node-local tier drained to S3 (SeaweedFS): the run killed while a step is being copied to S3 commits nothing
partial there, resumes from its local tier, and ends bitwise equal to an uninterrupted run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ (helpers)
from helpers import PY, ROOT, TINY, env_for_tests, kill_run_at_row, loss_rows  # noqa: E402

pytestmark = pytest.mark.s3


def test_a_drain_to_s3_killed_midway_commits_nothing_partial_and_resumes_bitwise(corpus, s3_server, tmp_path):
    env = s3_server.full_env(env_for_tests())
    base = TINY + ["--dataset", corpus, "--training-steps", "12", "--log-loss-to-csv", "--checkpoint-backend",
                   "concurrent"]
    ref = tmp_path / "ref"
    subprocess.run([PY, str(ROOT / "train.py"), *base, "--checkpoint-frequency", "4", "--checkpoint-dir", str(ref)],
                   check=True, capture_output=True, env=env, cwd=tmp_path, timeout=300)

    uri = s3_server.uri("tiered")
    args = base + ["--checkpoint-frequency", "4", "--checkpoint-dir", uri, "--local-checkpoint-dir",
                   str(tmp_path / "local"), "--local-checkpoint-frequency", "2", "--resume-from-checkpoint", "latest"]
    csv = tmp_path / "logs" / "default" / "loss.csv"  # s3:// checkpoints: the loss CSV goes to ./logs/<experiment>/
    # each file of the drain to S3 takes 2 s more: step 4's drain is still copying when step 6 is logged
    kill_run_at_row([PY, str(ROOT / "train.py"), *args], csv, 6, env={**env, "PYRECOVER_DRAIN_DELAY_S": "2"},
                    cwd=tmp_path)
    keys = s3_server.list_keys("tiered/default/")
    assert not [k for k in keys if k.endswith("/COMMITTED")], keys  # nothing was committed in the shared tier
    assert [k for k in keys if k.startswith("tiered/default/step-00000004/")], keys  # the drain had begun
    from checkpoint.tier import tier_root

    local = tier_root(tmp_path / "local", "default", f"{uri}/default") / "rank-00000"
    newest = max(int(p.name[5:]) for p in local.glob("step-*") if (p / "COMMITTED").exists())

    out = subprocess.run([PY, str(ROOT / "train.py"), *args], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert f"(step {newest}, concurrent backend; 1 of 1 ranks from their local tier" in text, text[-3000:]
    assert f"checkpoint step {newest} committed in the shared tier {uri}/default" in text  # the restored step
    committed = sorted(k.split("/")[2] for k in s3_server.list_keys("tiered/default/") if k.endswith("/COMMITTED"))
    assert committed[-1] == "step-00000012", committed
    assert loss_rows(csv) == loss_rows(ref / "default" / "loss.csv")
    cmp = subprocess.run([PY, str(ROOT / "tests" / "check_weights_equality.py"), f"{uri}/default/step-00000012",
                          str(ref / "default" / "step-00000012"), "--optimizer"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr
