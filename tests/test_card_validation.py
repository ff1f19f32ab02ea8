"""Documented and validated checkpoints (evaluation.py), through the real CLI:

* every checkpoint carries a card (model, data fingerprint, hyperparameters, progress, time, versions, note) that
  `python -m checkpoint list` and `inspect` show;
* validation by prediction: the probe loss recorded at save is recomputed bitwise, offline (`python evaluation.py
  validate`) and on resume (--validate-on-resume); two swapped tensors of the same shape pass every checksum and are
  still caught;
* --keep-best K: retention also keeps the K checkpoints with the lowest held-out loss, and `list` marks them.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import PY, ROOT, TINY, env_for_tests, run_torchrun, run_train

pytestmark = pytest.mark.slow  # end-to-end runs: `make test`, not `make test-fast`

SWAP = "layers.0.attention.wq.weight,layers.0.attention.wo.weight"  # both dim x dim in the tiny preset


def ckpt_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "checkpoint", *args], capture_output=True, text=True, timeout=180,
                          env=env_for_tests(), cwd=ROOT)


def validate_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, str(ROOT / "evaluation.py"), "validate", *args], capture_output=True, text=True,
                          timeout=180, env=env_for_tests(), cwd=ROOT)


def manifest(step_dir: Path) -> dict:
    return json.loads((step_dir / "manifest.json").read_text())


def committed(exp: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in exp.glob("step-*") if (p / "COMMITTED").exists())


def test_card_list_inspect_and_offline_validation(tmp_path, corpus):
    args = TINY + ["--dataset", corpus, "--checkpoint-dir", str(tmp_path), "--experiment_name", "card",
                   "--training-steps", "6", "--checkpoint-frequency", "3", "--checkpoint-note", "baseline run A"]
    run_train(args, check=True)
    exp = tmp_path / "card"
    card = manifest(exp / "step-00000006")["meta"]["card"]
    assert card["model"]["preset"] == "tiny" and card["model"]["params"] == 4194624
    assert card["model"]["config"]["dim"] == 64
    assert card["data"]["dataset"] == str(Path(corpus).resolve())
    assert re.fullmatch(r"xxh3:[0-9a-f]{16}", card["data"]["fingerprint"])
    assert card["data"]["tokenizer"] == "mistral-sp-32k" and card["data"]["eval_windows"] == 2
    assert card["hyperparameters"]["learning_rate"] == 1e-3 and card["hyperparameters"]["batch_size_per_rank"] == 4
    assert card["layout"] == {"device": "cpu", "dtype": "fp32", "attention": "sdpa", "world_size": 1,
                              "parallel": "none", "hardware": platform.machine(), "torch": str(torch.__version__)}
    progress = card["progress"]
    assert progress["step"] == 6 and progress["tokens_seen"] == 6 * 4 * 32 and progress["loss_steps"] == 3
    assert min(1e9, progress["loss_mean"]) > 0 and progress["learning_rate"] > 0
    assert card["versions"]["torch"] == str(torch.__version__) and card["note"] == "baseline run A"
    assert card["time"]["run_wall_s"] > 0 and card["versions"]["git_commit"]
    assert len(card["eval"]["probe_tokens"]) == 2 and len(card["eval"]["probe_tokens"][0]) == 33
    # The card is in the manifest, so the manifest checksum covers it: `verify` still passes.
    assert ckpt_cli("verify", str(exp)).returncode == 0

    listing = ckpt_cli("list", str(exp))
    assert listing.returncode == 0, listing.stderr
    header, row3, row6 = listing.stdout.splitlines()
    assert header.split()[:5] == ["step", "tokens", "loss", "eval", "saved"]
    assert row6.split()[:2] == ["6", "768"] and "<- latest" in row6 and "valid" in row3
    assert f"{progress['loss_last']:.4f}" in row6 and f"{card['eval']['eval_loss']:.4f}" in row6
    shown = ckpt_cli("inspect", str(exp / "step-00000006"))
    assert shown.returncode == 0, shown.stderr
    assert "card:" in shown.stdout and "note: baseline run A" in shown.stdout
    assert f"data.fingerprint: {card['data']['fingerprint']}" in shown.stdout
    assert "xxh3_64" in shown.stdout  # the files' checksums named by their real algorithm

    ok = validate_cli(str(exp))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for step in (3, 6):
        recorded = manifest(exp / f"step-{step:08d}")["meta"]["card"]["eval"]["probe_loss"]
        assert f"probe loss {recorded!r} recomputed, {recorded!r} recorded" in ok.stdout
    assert ok.stdout.count("bitwise on the saving layout cpu/fp32/sdpa/1/none") == 2

    # A wrong checkpoint that every checksum passes: a writer that swapped two tensors of the same shape and then
    # (correctly) checksummed what it wrote. verify says OK; validate by prediction says FAILED.
    bad = tmp_path / "tampered" / "step-00000006"
    shutil.copytree(exp / "step-00000006", bad)
    sys.path.insert(0, str(ROOT))
    from checkpoint import layout
    from checkpoint.fsio import checksum_file

    weights_file = bad / "model.pt"
    state = torch.load(weights_file, weights_only=True)
    a, b = SWAP.split(",")
    state[a], state[b] = state[b], state[a]
    torch.save(state, weights_file)
    m = manifest(bad)
    size, digest = checksum_file(weights_file, m["checksum"])
    m["files"]["model.pt"] = {"size": size, m["checksum"]: digest}
    (bad / "COMMITTED").unlink()
    (bad / "manifest.json").unlink()
    layout.commit(bad, 6, 1, m["backend"], [{"files": m["files"]}], meta=m["meta"])
    assert ckpt_cli("verify", str(bad)).returncode == 0
    caught = validate_cli(str(bad))
    assert caught.returncode == 1 and "FAILED: probe loss" in caught.stdout, caught.stdout + caught.stderr


def test_validate_on_resume_passes_bitwise_and_catches_a_swapped_load(tmp_path, corpus):
    args = TINY + ["--dataset", corpus, "--checkpoint-dir", str(tmp_path), "--experiment_name", "v",
                   "--training-steps", "4", "--checkpoint-frequency", "2"]
    run_train(args + ["--training-steps", "2"], check=True)
    # A load that every checksum passes but puts two tensors in each other's place: refused before any step.
    swapped = run_train(args + ["--resume-from-checkpoint", "latest", "--validate-on-resume"],
                        env={"PYRECOVER_SWAP_AFTER_LOAD": SWAP})
    assert swapped.returncode == 2, swapped.stdout + swapped.stderr
    errors = [line for line in swapped.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "failed validation: probe loss" in errors[0] and "Traceback" not in swapped.stderr
    assert committed(tmp_path / "v") == [2]  # nothing trained, nothing saved
    # The honest load validates bitwise and the run goes on.
    good = run_train(args + ["--resume-from-checkpoint", "latest", "--validate-on-resume"], check=True)
    assert "validate-on-resume: step 2 OK" in good.stdout + good.stderr
    assert "bitwise on the saving layout" in good.stdout + good.stderr
    assert committed(tmp_path / "v") == [2, 4]


def test_validation_of_a_two_rank_fsdp_checkpoint(tmp_path, corpus):
    """Sharded (dcp, FSDP2 over 2 gloo ranks): the resume on the same layout is bitwise; the offline check in one
    process is another layout, compared within the stated tolerance."""
    args = TINY + ["--dataset", corpus, "--checkpoint-dir", str(tmp_path), "--experiment_name", "f",
                   "--parallel", "fsdp", "--checkpoint-backend", "dcp", "--training-steps", "4",
                   "--checkpoint-frequency", "2"]
    run_torchrun(2, args + ["--training-steps", "2"], check=True)
    resumed = run_torchrun(2, args + ["--resume-from-checkpoint", "latest", "--validate-on-resume"], check=True)
    assert "validate-on-resume: step 2 OK" in resumed.stdout + resumed.stderr
    assert "bitwise on the saving layout cpu/fp32/sdpa/2/fsdp" in resumed.stdout + resumed.stderr
    card = manifest(tmp_path / "f" / "step-00000004")["meta"]["card"]
    assert card["layout"]["world_size"] == 2 and card["layout"]["parallel"] == "fsdp"
    offline = validate_cli(str(tmp_path / "f" / "step-00000004"))
    assert offline.returncode == 0 and "within 0.0001 relative" in offline.stdout, offline.stdout + offline.stderr


def test_validate_on_a_missing_or_empty_path_is_one_error_line(tmp_path):
    for path in (tmp_path / "nope", tmp_path):
        out = validate_cli(str(path))
        assert out.returncode == 2 and "Traceback" not in out.stdout + out.stderr, out.stdout + out.stderr
        assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1 and str(path) in out.stderr, out.stderr


def test_keep_best_keeps_the_lowest_eval_loss(tmp_path, corpus):
    """A learning rate high enough that the held-out loss goes up and down: the K best are not simply the newest."""
    base = TINY + ["--dataset", corpus, "--checkpoint-dir", str(tmp_path), "--training-steps", "4",
                   "--checkpoint-frequency", "1", "--learning-rate", "0.2", "--lr-warmup-steps", "0",
                   "--eval-windows", "8"]
    run_train(base + ["--experiment_name", "all", "--max-kept-checkpoints", "0"], check=True)
    losses = {s: manifest(tmp_path / "all" / f"step-{s:08d}")["meta"]["card"]["eval"]["eval_loss"]
              for s in committed(tmp_path / "all")}
    assert len(losses) == 4
    best = sorted(losses, key=lambda s: (losses[s], -s))[:2]
    assert set(best) != {3, 4}, f"eval losses do not exercise --keep-best: {losses}"

    run_train(base + ["--experiment_name", "best", "--max-kept-checkpoints", "1", "--keep-best", "2"], check=True)
    exp = tmp_path / "best"
    # The same run (deterministic): the same eval losses, and retention kept the newest plus the two best.
    assert committed(exp) == sorted({4, *best})
    for s in committed(exp):
        assert manifest(exp / f"step-{s:08d}")["meta"]["card"]["eval"]["eval_loss"] == losses[s]
    listing = ckpt_cli("list", str(exp)).stdout
    for rank, s in enumerate(best, 1):
        assert re.search(rf"^\s+{s}\s.*best #{rank}", listing, re.M), listing

    refused = run_train(base + ["--experiment_name", "x", "--keep-best", "2", "--eval-windows", "0"])
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith("error: --keep-best needs")
