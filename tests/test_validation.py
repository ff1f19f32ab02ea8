"""A real validation set (evaluation.py), through the real CLI:

* --val-dataset (a separate parquet file) with --eval-every on 2 DDP ranks: killed inside an evaluation, the resumed
  run's val rows, loss rows and weights are bitwise the uninterrupted run's (the interrupted evaluation is redone from
  the same weights; val.csv keeps every evaluation exactly once); the card's val loss is the val row of its step;
* --val-fraction with --eval-every 1 and --keep-best 1: the kept checkpoint is the one with the lowest val loss, and
  the loss rows are those of a run that evaluates only at its final save (evaluation draws no RNG, changes no
  weight); --val-fraction cannot change on resume;
* bad input is one line: --eval-every without validation data, both --val-dataset and --val-fraction, a fraction out
  of range, a --val-dataset that does not exist.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import flags
from helpers import PY, ROOT, TINY, check_weights, env_for_tests, kill_run_at_row, loss_rows, run_torchrun, run_train, \
    torchrun_cmd, val_rows



def card(step_dir: Path) -> dict:
    return json.loads((step_dir / "manifest.json").read_text())["meta"]["card"]


def committed(exp: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in exp.glob("step-*") if (p / "COMMITTED").exists())


@pytest.fixture(scope="module")
def val_parquet(corpus, tmp_path_factory) -> Path:
    """A separate validation file: a few documents of the corpus (KJV chapters), in a file of its own."""
    path = tmp_path_factory.mktemp("val") / "val.parquet"
    pq.write_table(pq.read_table(corpus, columns=["text"]).slice(400, 4), path)
    return path


@pytest.mark.slow
def test_val_dataset_rows_survive_a_kill_inside_an_evaluation(tmp_path, corpus, val_parquet):
    ck = tmp_path / "ck"
    args = TINY + ["--dataset", corpus, "--val-dataset", str(val_parquet), "--eval-every", "2", "--eval-tokens", "256",
                   "--training-steps", "6", "--checkpoint-frequency", "3", "--checkpoint-dir", str(ck),
                   "--log-loss-to-csv"]
    whole = run_torchrun(2, args + ["--experiment_name", "whole"], timeout=240)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    want = val_rows(ck / "whole" / "val.csv")
    # --eval-every 2 and every save (3, 6): each step once; 256 tokens = 8 windows of 32, 4 per rank
    assert [r[0] for r in want] == ["2", "3", "4", "6"] and {r[3] for r in want} == {"256"}, want
    assert "eval step 4: val loss" in whole.stdout + whole.stderr, whole.stdout[-3000:]
    eval6 = card(ck / "whole" / "step-00000006")["eval"]
    assert repr(eval6["val_loss"]) == want[3][1] and eval6["eval_loss"] == eval6["val_loss"]
    assert eval6["val_tokens"] == 256 and len(eval6["probe_tokens"]) == 2  # the probe: the val set's first windows

    # SIGKILL (torchrun and both ranks) once step 4's loss row is there: inside its evaluation, which sleeps
    csv_path = ck / "killed" / "loss.csv"
    kill_run_at_row(torchrun_cmd(2, args + ["--experiment_name", "killed"]), csv_path, 4,
                    env=env_for_tests({"PYRECOVER_TEST_EVAL_SLEEP": "2"}))
    assert [r[0] for r in val_rows(ck / "killed" / "val.csv")] == ["2", "3"]  # step 4's evaluation never finished
    resumed = run_torchrun(2, args + ["--experiment_name", "killed", "--resume-from-checkpoint", "latest"],
                           timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert val_rows(ck / "killed" / "val.csv") == want
    assert loss_rows(csv_path) == loss_rows(ck / "whole" / "loss.csv")
    same = check_weights(ck / "whole" / "step-00000006", ck / "killed" / "step-00000006")
    assert same.returncode == 0, same.stdout + same.stderr


def test_val_fraction_keep_best_keeps_the_lowest_val_loss(tmp_path, corpus):
    """A learning rate high enough that the val loss goes up after the first step: the best is not the newest."""
    base = TINY + ["--dataset", corpus, "--checkpoint-dir", str(tmp_path), "--training-steps", "2",
                   "--learning-rate", "0.2", "--lr-warmup-steps", "0", "--val-fraction", "0.001",
                   "--eval-tokens", "256", "--log-loss-to-csv"]
    run_train(base + ["--experiment_name", "best", "--eval-every", "1", "--checkpoint-frequency", "1",
                      "--max-kept-checkpoints", "1", "--keep-best", "1"], check=True)
    exp = tmp_path / "best"
    losses = {int(step): float(loss) for step, loss, _, _ in val_rows(exp / "val.csv")}
    assert sorted(losses) == [1, 2]
    assert losses[1] < losses[2], f"val losses do not exercise --keep-best: {losses}"
    assert committed(exp) == [1, 2]  # the newest, and the lowest val loss
    for s in committed(exp):
        assert card(exp / f"step-{s:08d}")["eval"]["val_loss"] == losses[s]

    # evaluating after every step changed no number of training: the loss rows of a run evaluating once, at its end
    # (reading one window: the card's probe is that window, so the checkpoint validates by prediction)
    once = run_train(base + ["--experiment_name", "once", "--checkpoint-frequency", "0", "--eval-tokens", "32"],
                     check=True)
    assert loss_rows(tmp_path / "once" / "loss.csv") == loss_rows(exp / "loss.csv")
    assert [r[0] for r in val_rows(tmp_path / "once" / "val.csv")] == ["2"], once.stderr[-2000:]
    assert len(card(tmp_path / "once" / "step-00000002")["eval"]["probe_tokens"]) == 1
    validated = subprocess.run([PY, "evaluation.py", "validate", str(tmp_path / "once")], cwd=ROOT,
                               env=env_for_tests(), capture_output=True, text=True, timeout=120)
    assert validated.returncode == 0 and "OK" in validated.stdout, validated.stdout + validated.stderr

    # the validation windows are cut from the training data: another fraction cannot continue the run
    refused = run_train(base + ["--experiment_name", "best", "--resume-from-checkpoint", "latest",
                                "--val-fraction", "0.002"])
    errors = [ln for ln in refused.stderr.splitlines() if ln.startswith("error")]
    assert refused.returncode == 2 and len(errors) == 1 and "--val-fraction 0.002 differs" in errors[0], refused.stderr


@pytest.mark.parametrize("argv, says", [
    (["--eval-every", "2", "--eval-windows", "0"], "--eval-every 2 needs validation data"),
    (["--val-dataset", "v.parquet", "--val-fraction", "0.1"], "give one of them"),
    (["--val-fraction", "1"], "--val-fraction 1 is out of range"),
    (["--val-fraction", "0"], "--val-fraction 0 is out of range"),
    (["--eval-tokens", "-1"], "--eval-tokens -1 is out of range"),
])
def test_validation_flags_refused_in_one_line(argv, says):
    with pytest.raises(flags.BadInput, match=None) as refused:
        flags.check_numeric_flags(flags.parse_args(argv))
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_missing_val_dataset_is_one_line(tmp_path, corpus):
    missing = tmp_path / "nope.parquet"
    proc = run_train(TINY + ["--dataset", corpus, "--val-dataset", str(missing), "--checkpoint-dir", str(tmp_path),
                             "--training-steps", "1"], timeout=120)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(errors) == 1 and f"--val-dataset {missing} does not exist" in errors[0], errors
