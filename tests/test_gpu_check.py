"""`make gpu-check ARGS=--cpu`: the GPU check (benchmarks/gpu.py) end to end on CPU with tiny sizes, so the script a
GPU session runs cannot rot between the sessions that get a device. It measures nothing here: every section must be in
the report, and every bitwise row -- `tiny` killed and resumed against an uninterrupted run: single process by default,
FSDP + DCP under torchrun with --deterministic (a GPU run does all four) -- must hold."""

from __future__ import annotations

import json
import subprocess

import pytest

from pathlib import Path

from helpers import PY, ROOT, env_for_tests

VENV = Path(PY).parent.parent

SECTIONS = ["environment", "bitwise", "stall", "throughput", "memory", "restart"]


@pytest.mark.benchmark_smoke
def test_gpu_check_runs_end_to_end_on_cpu(corpus, tmp_path):
    out = tmp_path / "report"
    # through make, as a user runs it; -o: the dataset is there already (never rebuilt from a test)
    args = f"--cpu --out {out} --dataset {corpus} --budget-s 400"
    proc = subprocess.run(["make", "-C", str(ROOT), "-o", corpus, "gpu-check", f"VENV={VENV}", f"DATA={corpus}",
                           f"ARGS={args}"], cwd=ROOT, env=env_for_tests(), capture_output=True, text=True,
                          timeout=600)
    log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:] + log[-5000:]
    report = json.loads((out / "gpu_check.json").read_text())
    sections = {s["key"]: s for s in report["sections"]}
    assert list(sections) == SECTIONS
    md = (out / "gpu_check.md").read_text()
    for i, s in enumerate(report["sections"], 1):
        assert f"## {i}. {s['title']}" in md
        assert s["rows"], s["key"]
        assert not s["status"].startswith("FAILED"), (s, log[-3000:])
    bitwise = sections["bitwise"]["rows"]
    assert [r["config"] for r in bitwise] == ["single default", "fsdp-dcp deterministic"]  # --cpu: each once
    for r in bitwise:
        assert r["status"] == "OK", r
        assert "bitwise" in r["weights + optimizer"] and r["loss rows"] == "12 equal", r
        assert 0 < r["resumed from"] <= 7, r  # a checkpoint of the killed run, not a fresh start
    assert "cpu" in report["meta"] and report["meta"]["cpu"] is True
    rows = {r["what"]: r for r in sections["restart"]["rows"]}
    assert any(w.startswith("cold restart (") for w in rows), rows
    assert rows["warm standby serves a CPU rank"]["status"] == "OK", rows
    assert len(list(out.iterdir())) <= 8
