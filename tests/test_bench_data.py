"""Smoke test of the sharded-data benchmark (benchmarks/data.py, `make bench-data`): it runs end to end on a slice of
the corpus and writes its report. It measures nothing beyond what the report must hold."""

from __future__ import annotations

import json
import subprocess

import pytest

from helpers import PY, ROOT, env_for_tests


@pytest.mark.benchmark_smoke
def test_bench_data_harness_smoke(corpus, tmp_path):
    proc = subprocess.run([PY, "-m", "benchmarks.data", "--quick", "--dataset", corpus, "--out", str(tmp_path)],
                          cwd=ROOT, env=env_for_tests(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads((tmp_path / "bench_data.json").read_text())
    t = res["throughput"]
    for key in ("tokenizer_1_thread_tokens_per_s", "prepare_1_workers_tokens_per_s", "prepare_2_workers_tokens_per_s"):
        assert t[key] > 0, key
    assert res["rss"]["10x"]["tokens"] == 10 * res["rss"]["1x"]["tokens"]
    assert abs(res["rss_anon_growth_10x_vs_1x_mib"]) < 16  # the tokens stay in the memory maps
    md = (tmp_path / "bench_data.md").read_text()
    assert "prepare --workers 2" in md and "10x corpus" in md
