"""Smoke test of `make bench` (benchmarks/targets.py --quick): every section runs end to end through the real
train.py and writes its report, so a change that breaks the README's benchmark command fails the suite. It measures
nothing (one repeat of a tiny state and a tiny model)."""

from __future__ import annotations

import json
import subprocess

import pytest

from helpers import PY, ROOT, env_for_tests


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
    for name in ("concurrent", "dcp async (thread)", "local tier (/dev/shm)"):  # the resume phase (it once failed
        # on a flag the card recorded); the local tier's restart reads /dev/shm
        assert res["resume"][name]["recovery_s"]["median"] > 0, res["resume"]
    assert "## Against the targets" in (tmp_path / "out" / "bench_targets.md").read_text()
