"""Two ways a run continues or stops that used to go wrong quietly, driven through the real CLI:

* resuming with optimisation/schedule flags that differ from the checkpoint: each one is applied (and named) or
  refused (exit 2, one line) -- never half-applied, as the learning rate was (LambdaLR restored the old base rate);
* Ctrl-C (SIGINT): saves at the next step boundary and exits 4 like SIGTERM, with one line saying how to resume; a
  second Ctrl-C, or one during setup, exits at once with 130. Never a KeyboardInterrupt traceback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import PY, ROOT, TINY, LogLines, check_weights, csv_rows, env_for_tests, loss_rows, run_train


def _train_lr_lambda():
    sys.path.insert(0, str(ROOT))
    from schedules import lr_lambda  # the schedule's own formula

    return lr_lambda


def _committed_steps(experiment: Path) -> list[int]:
    """Committed checkpoints: step-* folders (never a staging folder) holding COMMITTED."""
    return sorted(int(p.name.split("-")[1]) for p in experiment.glob("step-*") if (p / "COMMITTED").exists())


# ----------------------------------------------------------------------------------------------------------------------
# Defect 5: flags that differ on resume are applied or refused, each named in one line
# ----------------------------------------------------------------------------------------------------------------------


def test_resume_applies_a_new_learning_rate_and_schedule(tmp_path, corpus):
    base = TINY + ["--dataset", corpus, "--checkpoint-dir", str(tmp_path), "--log-loss-to-csv"]  # lr 1e-3, warm-up 5
    run_train(base + ["--training-steps", "5", "--checkpoint-frequency", "5"], check=True)
    proc = run_train(base + ["--training-steps", "8", "--checkpoint-frequency", "0", "--learning-rate", "1e-5",
                             "--lr-warmup-steps", "1", "--grad-max-norm", "0.5", "--resume-from-checkpoint", "latest"],
                     check=True)
    for line in ("resume: applying --learning-rate 1e-05 (checkpoint had 0.001)",
                 "resume: applying --lr-warmup-steps 1 (checkpoint had 5)",
                 "resume: applying --training-steps 8 (checkpoint had 5)",
                 "resume: applying --grad-max-norm 0.5 (checkpoint had 1.0)"):
        assert line in proc.stdout.splitlines(), proc.stdout
    lr_lambda = _train_lr_lambda()
    old, new = lr_lambda(5, 5), lr_lambda(1, 8)
    rows = loss_rows(tmp_path / "default" / "loss.csv")
    assert [int(r[0]) for r in rows] == list(range(1, 9))
    # row `step` logs the lr its optimizer step used: lr * lambda(step - 1), exactly what a fresh run with these flags
    # would use at that step (not the old base rate on the new schedule, not the old lr for the first resumed step)
    assert [r[2] for r in rows[:5]] == [repr(1e-3 * old(s - 1)) for s in range(1, 6)]
    assert [r[2] for r in rows[5:]] == [repr(1e-5 * new(s - 1)) for s in range(6, 9)]


def test_resume_refuses_flags_the_checkpoint_cannot_take(tmp_path, corpus):
    base = TINY + ["--dataset", corpus, "--checkpoint-dir", str(tmp_path), "--checkpoint-frequency", "4"]
    run_train(base + ["--training-steps", "4"], check=True)
    resume = base + ["--training-steps", "6", "--resume-from-checkpoint", "latest"]
    cases = [  # flag, new value, what the error line must say
        ("--model", "small", ["--model small", "checkpoint's tiny", "--model tiny"]),
        ("--tokenizer-name-or-path", "cl100k_base", ["--tokenizer-name-or-path cl100k_base", "checkpoint's mistral-sp-32k"]),
        ("--sequence-length", "16", ["--sequence-length 16", "checkpoint's 32", "--sequence-length 32"]),
        ("--seed", "7", ["--seed 7", "checkpoint's 42", "--seed 42"]),
        ("--model-dtype", "bf16", ["--model-dtype bf16", "checkpoint's fp32", "--model-dtype fp32"]),
        ("--training-steps", "3", ["checkpoint is at step 4 but --training-steps 3 ends before it"]),
    ]
    for flag, value, says in cases:
        proc = run_train(resume + [flag, value], timeout=180)
        assert proc.returncode == 2, (flag, proc.stdout[-2000:], proc.stderr[-2000:])
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in proc.stderr + proc.stdout, (flag, proc.stderr[-3000:])
        assert all(s in errors[0] for s in says), (flag, errors[0])
        assert "start a new --experiment_name" in errors[0], errors[0]
    assert _committed_steps(tmp_path / "default") == [4]  # nothing trained, saved or moved aside by a refusal


# ----------------------------------------------------------------------------------------------------------------------
# Defect 7: Ctrl-C saves like SIGTERM; a second one (or one during setup) exits at once
# ----------------------------------------------------------------------------------------------------------------------

STEPS = 12  # more than the run reaches before the SIGINT lands (PYRECOVER_STEP_SLEEP paces it at ~0.1 s a step)


def _start(args: list[str], out: Path) -> subprocess.Popen:
    with open(out / "stdout", "w") as stdout, open(out / "stderr", "w") as stderr:
        return subprocess.Popen([PY, str(ROOT / "train.py"), *args], stdout=stdout, stderr=stderr, cwd=ROOT,
                                env=env_for_tests({"PYRECOVER_STEP_SLEEP": "0.05"}))


def _wait_rows(proc: subprocess.Popen, csv: Path, rows: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while csv_rows(csv) < rows:
        assert proc.poll() is None, f"run ended (rc {proc.returncode}) before step {rows}"
        assert time.monotonic() < deadline, "timed out waiting for the run to reach the step"
        time.sleep(0.01)


def _output(out: Path) -> str:
    return (out / "stdout").read_text() + (out / "stderr").read_text()


def _exit(proc: subprocess.Popen, out: Path, timeout: float = 30) -> tuple[int, str]:
    """Wait for the run to end (killed if it does not); its exit code and output, no traceback in it."""
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        proc.kill()
    text = _output(out)
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    return rc, text


def test_ctrl_c_saves_at_the_next_step_and_resume_is_bitwise(tmp_path, corpus):
    flags = TINY + ["--dataset", corpus, "--training-steps", str(STEPS), "--checkpoint-frequency", "1000",
                    "--log-loss-to-csv"]
    run, ref = tmp_path / "run", tmp_path / "ref"
    run.mkdir()
    proc = _start(flags + ["--checkpoint-dir", str(run)], run)
    try:
        _wait_rows(proc, run / "default" / "loss.csv", 5)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
    finally:
        proc.kill()
    out = _output(run)
    assert rc == 4, out[-3000:]  # EXIT_STOPPED, as SIGTERM
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    said = re.findall(r"^interrupted \(SIGINT\) at step (\d+): checkpoint step (\d+) committed; resume with "
                      r"--resume-from-checkpoint latest", out, re.M)
    assert len(said) == 1 and said[0][0] == said[0][1], out[-3000:]
    stop = int(said[0][0])
    assert 5 <= stop < STEPS and _committed_steps(run / "default") == [stop]
    # the last line says it stopped, not "done"; the first step has a line of its own (not a terminal: plain lines)
    assert re.search(rf"^stopped at step {stop} of {STEPS} \(not requeued\), final loss ", out, re.M), out[-3000:]
    assert "done:" not in out
    assert re.search(rf"^step 1/{STEPS} loss \S+ lr \S+ .* peak_rss [\d,]+MiB eta ", out, re.M), out[-3000:]
    assert csv_rows(run / "default" / "loss.csv") == stop

    resumed = run_train(flags + ["--checkpoint-dir", str(run), "--resume-from-checkpoint", "latest"], check=True)
    # the restart read its checkpoint's files while it set up (Session.prepare); the load then verified them
    step_dir = run / "default" / f"step-{stop:08d}"
    mib = sum(rec["size"] for rec in json.loads((step_dir / "manifest.json").read_text())["files"].values()) / 2**20
    assert f"read ahead {mib:.1f} of {mib:.1f} MiB of {step_dir} while setting up" in resumed.stdout, resumed.stdout
    run_train(flags + ["--checkpoint-dir", str(ref)], check=True)  # uninterrupted
    same = check_weights(run / "default", ref / "default", "--tolerance", "0", "--optimizer")
    assert same.returncode == 0, same.stdout + same.stderr
    assert loss_rows(run / "default" / "loss.csv") == loss_rows(ref / "default" / "loss.csv")


def test_second_ctrl_c_exits_at_once_without_saving(tmp_path, corpus):
    flags = TINY + ["--dataset", corpus, "--training-steps", str(STEPS), "--checkpoint-frequency", "1000",
                    "--log-loss-to-csv", "--checkpoint-dir", str(tmp_path)]
    proc = _start(flags, tmp_path)
    try:
        _wait_rows(proc, tmp_path / "default" / "loss.csv", 5)
        proc.send_signal(signal.SIGINT)
        # Again every 50 ms until it exits: two signals sent back to back may reach the handler as one, and the first
        # one's save takes longer than 50 ms, so the run sees a second SIGINT before it could finish saving.
        t_second = time.monotonic()
        while proc.poll() is None and time.monotonic() - t_second < 30:
            time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
    finally:
        rc, out = _exit(proc, tmp_path)
    assert rc == 130, out[-3000:]
    assert time.monotonic() - t_second < 10  # at once, not after a save or a timeout
    assert re.search(r"^interrupted \(SIGINT\) again: exiting now without saving", out, re.M), out[-3000:]
    assert _committed_steps(tmp_path / "default") == []


def test_ctrl_c_during_setup_exits_at_once(tmp_path, corpus):
    proc = _start(TINY + ["--dataset", corpus, "--checkpoint-dir", str(tmp_path)], tmp_path)
    try:
        time.sleep(1.0)  # imports or setup: nothing to save yet
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
    finally:
        rc, out = _exit(proc, tmp_path)
    assert rc == 130, out[-3000:]
    assert "interrupted (SIGINT) before training started: nothing to save yet" in out


def test_sigint_in_the_loop_is_save_and_stop_without_requeue(train_spelling):
    """The policy itself, in process: SIGINT votes like SIGTERM, and is not requeued even in a SLURM job (its line as
    train.py words it)."""
    from checkpoint import policy

    kept = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)}
    try:
        log = LogLines()
        watcher = policy.install_signal_handlers("USR1")
        assert watcher.owner.owns(signal.SIGINT)  # else the SIGINT below would end pytest
        b = policy.StepBoundary(policy.IntervalPolicy(0, 10), agree=lambda v: v, signals=watcher,
                                environ={"SLURM_JOB_ID": "1"})
        b.start()
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(100):
            time.sleep(0.001)  # the handler runs between bytecodes of the main thread
        d = b(3)
        assert d.save and d.stop and d.vote == policy.TERM
        assert b.finish(3, 10) == policy.STOPPED  # no scontrol call: the user asked to stop
        assert log[-1] == ("interrupted (SIGINT) at step 3: checkpoint step 3 committed; resume with "
                           "--resume-from-checkpoint latest (make train does)")
    finally:
        for s, handler in kept.items():
            signal.signal(s, handler)
