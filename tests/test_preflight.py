"""Pre-flight checks through the real CLI: bad numbers and configurations that cannot fit in memory are refused in one
`error:` line with exit code 2 before any training time is spent, and the printed memory estimate agrees with the
measured peak within the margin docs/training.md states."""

from __future__ import annotations

import re
import subprocess
import time

import pytest
import torch

from helpers import ROOT, TINY, csv_rows, run_train


def readme_margin() -> tuple[float, float]:
    """The margin docs/training.md states for the memory estimate: (below, above) the measured peak, in percent."""
    text = (ROOT / "docs" / "training.md").read_text()
    m = re.search(r"the estimate is within -(\d+(?:\.\d+)?)%/\+(\d+(?:\.\d+)?)% of the measured peak", text)
    assert m, "docs/training.md must state the memory estimate's margin"
    return float(m.group(1)), float(m.group(2))


def mib(line: str, label: str) -> float:
    m = re.search(rf"^{label}: ([\d,.]+) MiB", line)
    assert m, line
    return float(m.group(1).replace(",", ""))


@pytest.mark.parametrize("model, batch, seq", [("tiny", 4, 32), ("small", 2, 64)])
def test_memory_estimate_agrees_with_measured_peak(tmp_path, corpus, model, batch, seq):
    proc = run_train(["--model", model, "--batch-size", str(batch), "--sequence-length", str(seq),
                      "--training-steps", "20", "--checkpoint-frequency", "0", "--dataset", corpus,
                      "--checkpoint-dir", str(tmp_path / "ck")], check=True)
    lines = proc.stdout.splitlines()
    estimate_lines = [line for line in lines if line.startswith("memory estimate:")]
    measured_lines = [line for line in lines if line.startswith("memory measured:")]
    assert len(estimate_lines) == 1 and len(measured_lines) == 1, proc.stdout
    assert lines.index(estimate_lines[0]) < min(i for i, line in enumerate(lines) if line.startswith("step ")), \
        "the estimate is printed at startup, before the first step"
    estimate, measured = mib(estimate_lines[0], "memory estimate"), mib(measured_lines[0], "memory measured")
    for part in ("parameters", "optimizer state", "activations", "logits", "gradients"):
        assert part in estimate_lines[0]
    below, above = readme_margin()
    error = 100 * (estimate - measured) / measured
    assert -below <= error <= above, (f"{model} {batch}x{seq}: estimate {estimate} MiB vs measured {measured} MiB "
                                      f"({error:+.1f}%), docs/training.md margin -{below}%/+{above}%")


def test_estimate_counts_every_parameter():
    from model import PRESETS, Transformer, estimate_peak_memory, get_config

    for preset in PRESETS:
        config = get_config(preset, vocab_size=32000, max_seq_len=64)
        with torch.device("meta"):
            n = Transformer(config).num_params()
        estimate = estimate_peak_memory(config, 1, 64, "fp32")
        assert estimate.parameters == 4 * n and estimate.gradients == 4 * n and estimate.optimizer == 8 * n, preset
        assert estimate_peak_memory(config, 1, 64, "fp64").parameters == 8 * n


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    return lines[0]


def test_configuration_too_large_for_memory_is_refused_before_training(tmp_path, corpus):
    csv = tmp_path / "loss.csv"
    t0 = time.monotonic()
    try:  # before the fix this computed for ~7 minutes and then died with a traceback (102 GB of logits)
        proc = run_train(["--model", "tiny", "--sequence-length", "100000", "--training-steps", "2",
                          "--dataset", corpus, "--checkpoint-dir", str(tmp_path / "ck"), "--log-loss-to-csv", str(csv)],
                         timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("--sequence-length 100000 was not refused within 60 s: it went on to train")
    elapsed = time.monotonic() - t0
    line = one_error_line(proc)
    assert "--sequence-length 100000" in line and "MiB" in line and "logits" in line, line
    estimate = float(re.search(r"needs an estimated ([\d,.]+) MiB", line).group(1).replace(",", ""))
    assert estimate > 24 * 1024, line  # the logits alone: 8 x 100,000 x 32,000 x 4 B x 4 (logits, log-softmax, grads)
    assert "--batch-size" in line and "fits" in line, line  # what to change
    assert "step" not in proc.stdout and csv_rows(csv) == 0, proc.stdout
    assert elapsed < 60


BAD_NUMBERS = [
    (["--learning-rate", "nan"], "--learning-rate"),
    (["--learning-rate", "-1"], "--learning-rate"),
    (["--learning-rate", "0"], "--learning-rate"),
    (["--checkpoint-frequency", "-1"], "--checkpoint-frequency"),
    (["--grad-max-norm", "inf"], "--grad-max-norm"),
    (["--lr-warmup-steps", "-1"], "--lr-warmup-steps"),
    (["--max-kept-checkpoints", "-1"], "--max-kept-checkpoints"),
    (["--walltime-margin-seconds", "nan"], "--walltime-margin-seconds"),
    (["--logging-frequency", "0"], "--logging-frequency"),
    (["--max-async", "0"], "--max-async"),
    (["--pg-timeout-seconds", "-5"], "--pg-timeout-seconds"),
]


@pytest.mark.parametrize("bad, flag", BAD_NUMBERS, ids=[" ".join(b) for b, _ in BAD_NUMBERS])
def test_bad_number_is_one_line_exit_2(tmp_path, corpus, bad, flag):
    # TINY and 2 steps so that a build that accepts the number finishes quickly (and fails this test by exit code).
    proc = run_train(TINY + ["--training-steps", "2", "--dataset", corpus, "--checkpoint-dir", str(tmp_path / "ck"),
                             *bad], timeout=180)
    line = one_error_line(proc)
    assert flag in line and bad[1] in line and "give a number" in line, line
    assert "memory estimate" not in proc.stdout  # refused before anything else ran
