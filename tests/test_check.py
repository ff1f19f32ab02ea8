"""`train.py --check` (alias --dry-run) through the real CLI: the pre-flight checks alone -- exit 0 with a summary that
says what a resume would load, or 2 with one error line -- training nothing, writing nothing, taking no lease. And
--model-dtype auto (the default): a checkpoint saved with an explicit fp32 on CPU resumes under auto, which is fp32
there, without being refused."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from helpers import TINY, run_train


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: size and mtime (a check must change none and add none)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file()} if root.exists() else {}


def test_check_says_what_a_resume_would_load_and_writes_nothing(tmp_path, corpus):
    ck = tmp_path / "ck"
    flags = TINY + ["--dataset", corpus, "--checkpoint-dir", str(ck), "--checkpoint-frequency", "2"]
    run_train(flags + ["--training-steps", "4", "--model-dtype", "fp32"], check=True)
    before = tree(ck)

    ok = run_train(flags + ["--training-steps", "6", "--resume-from-checkpoint", "latest", "--check"])
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.splitlines()
    assert all(line.startswith("check: ") for line in lines), ok.stdout
    assert "check: device cpu, --model-dtype fp32, 1 rank(s)" in lines, ok.stdout  # auto resolved, not refused
    assert lines[-1].startswith("check: OK: would resume from step 4 "), ok.stdout
    assert tree(ck) == before  # nothing trained, saved, leased or rewritten

    val = tmp_path / "own-val.parquet"  # a file of its own: a training file is refused as validation data
    pq.write_table(pq.read_table(corpus, columns=["text"]).slice(0, 4), val)
    fresh = run_train(flags + ["--experiment_name", "new", "--dry-run",  # the alias; a run folder not there yet
                               "--val-dataset", str(val), "--eval-every", "2"])
    assert fresh.returncode == 0 and "would start fresh (no --resume-from-checkpoint)" in fresh.stdout, fresh
    assert f"check: --val-dataset {val}: 1 file(s), readable" in fresh.stdout, fresh.stdout  # its files looked at
    assert not (ck / "new").exists()

    for extra, needle in [(["--dataset", str(tmp_path / "nope.parquet")], "nope.parquet"),
                          (["--val-dataset", str(tmp_path / "val.parquet")], "val.parquet"),
                          (["--resume-from-checkpoint", "latest", "--model-dtype", "bf16"], "--model-dtype bf16 differs")]:
        bad = run_train(flags + ["--training-steps", "6", "--check", *extra])
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and bad.stderr.startswith("error: "), bad
        assert needle in bad.stderr and "check: OK" not in bad.stdout, bad.stderr
    assert tree(ck) == before

    resumed = run_train(flags + ["--training-steps", "6", "--resume-from-checkpoint", "latest"])  # auto = fp32 here
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "done: 6 steps" in resumed.stdout, resumed.stdout[-2000:]
