"""The node-local tier drained to S3 (SeaweedFS): the run killed while a step is being copied to S3 commits nothing
partial there, resumes from its local tier, and ends bitwise equal to an uninterrupted run; a run whose node was
replaced reads its step from S3 while it sets up and ends bitwise too."""

from __future__ import annotations

import re
import shutil
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
    from checkpoint.places import tier_root

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


def test_a_replaced_node_reads_its_step_from_s3_while_it_sets_up_and_resumes_bitwise(corpus, s3_server, tmp_path):
    """Killed after step 4 reached S3, its local tier then wiped (a new node): the restart downloads, verifies and
    parses step 4 from S3 on a background thread during its setup, loads it from the shared tier, and ends bitwise
    equal to an uninterrupted run."""
    env = s3_server.full_env(env_for_tests())
    base = TINY + ["--dataset", corpus, "--training-steps", "8", "--log-loss-to-csv", "--checkpoint-backend",
                   "concurrent", "--checkpoint-frequency", "4"]
    ref = tmp_path / "ref"
    subprocess.run([PY, str(ROOT / "train.py"), *base, "--checkpoint-dir", str(ref)], check=True, capture_output=True,
                   env=env, cwd=tmp_path, timeout=300)
    uri, local = s3_server.uri("swapped"), tmp_path / "local"
    args = base + ["--checkpoint-dir", uri, "--local-checkpoint-dir", str(local), "--local-checkpoint-frequency", "2",
                   "--resume-from-checkpoint", "latest"]
    csv = tmp_path / "logs" / "default" / "loss.csv"
    kill_run_at_row([PY, str(ROOT / "train.py"), *args], csv, 6, env=env, cwd=tmp_path,
                    ready=lambda: "swapped/default/step-00000004/COMMITTED" in s3_server.list_keys("swapped/default/"))
    shutil.rmtree(local)  # the node is replaced

    out = subprocess.run([PY, str(ROOT / "train.py"), *args], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    step4 = f"{uri}/default/step-00000004"
    ahead = re.search(rf"^read ahead ([\d.]+) of ([\d.]+) MiB of {re.escape(step4)} while setting up"
                      r"(?:, (\d+) files verified and parsed)?$", text, re.M)
    assert ahead and 0 < float(ahead.group(2)), text[-3000:]
    assert ahead.group(3) and int(ahead.group(3)) >= 2, ahead.group(0)  # downloaded, verified and parsed ahead
    assert f"resumed from {step4} (step 4, concurrent backend; 0 of 1 ranks from their local tier" in text, text[-3000:]
    assert loss_rows(csv) == loss_rows(ref / "default" / "loss.csv")
    cmp = subprocess.run([PY, str(ROOT / "tests" / "check_weights_equality.py"), f"{uri}/default/step-00000008",
                          str(ref / "default" / "step-00000008"), "--optimizer"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr


def test_an_object_read_ahead_is_taken_once_and_verified_like_any_other(s3_server, monkeypatch):
    """In process, the S3 medium itself: what prefetch keeps serves the next read_checked of that object once (the
    object deleted meanwhile: still served), is verified against the record like a download (bytes that do not
    match are refused), and nothing is kept of a prefetch stopped midway."""
    import os

    from checkpoint.errors import CheckpointError
    from checkpoint.fsio import CHECKSUM_ALGORITHM, checksum_bytes
    from checkpoint.storage import s3

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(s3, "_client", None)  # a client of this server, dropped again at the end
    medium, path = s3.S3(), s3.S3Path.from_uri(s3_server.uri("read-ahead/a.bin"))
    data = os.urandom(3 << 20)
    path.write_bytes(data)
    record = (len(data), CHECKSUM_ALGORITHM, checksum_bytes(data))

    assert medium.prefetch(path, len(data), lambda: False) == len(data)
    path.unlink()
    assert bytes(medium.read_checked(path, *record)) == data  # from memory: the object is gone
    with pytest.raises(FileNotFoundError):
        medium.read_checked(path, *record)  # taken once: this one asks S3, where it is gone

    path.write_bytes(data)
    assert medium.prefetch(path, len(data), lambda: False) == len(data)
    other = bytes([data[0] ^ 1]) + data[1:]  # the manifest's record says other bytes
    with pytest.raises(CheckpointError, match="checksum"):
        medium.read_checked(path, len(data), CHECKSUM_ALGORITHM, checksum_bytes(other))

    assert medium.prefetch(path, len(data), lambda: True) == 0  # stopped: nothing kept, the object is read
    path.unlink()
    with pytest.raises(FileNotFoundError):
        medium.read_checked(path, *record)
