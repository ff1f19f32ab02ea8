"""Bad input through the real CLI (reliability audit, issue 21): every path, flag and flag combination that cannot work
is refused in one `error:` line with exit code 2 before anything is taken or written; a --force-takeover that would be
refused fences nothing; a SIGTERM before training starts says so in one line."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import TINY, check_weights, run_train, start_train, wait_rows


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    return lines[0]


# (flags, what the line must say). {tmp} is the test's folder; --checkpoint-dir is {tmp}/ck, the working folder
# {tmp}/cwd: neither may be written to.
BAD = {
    "experiment name absolute": (["--experiment_name", "{tmp}/abs"], "--experiment_name '{tmp}/abs' is not a plain"),
    "experiment name ..": (["--experiment_name", ".."], "--experiment_name '..' is not a plain folder name"),
    "experiment name empty": (["--experiment_name", ""], "--experiment-name is empty"),
    "checkpoint dir empty": (["--checkpoint-dir", ""], "--checkpoint-dir is empty"),
    "mirror dir empty": (["--mirror-dir", ""], "--mirror-dir is empty"),
    "csv is a folder": (["--log-loss-to-csv", "{tmp}"], "--log-loss-to-csv {tmp} is a folder"),
    "csv folder missing": (["--log-loss-to-csv", "{tmp}/logs/loss.csv"], "the folder {tmp}/logs does not exist"),
    "signal 9": (["--signal", "9"], "SIGKILL (9) cannot be caught"),
    "signal 19": (["--signal", "19"], "SIGSTOP (19) cannot be caught"),
    "alias contradicts backend": (["--use-torch-distributed-ckpt", "--checkpoint-backend", "concurrent"],
                                  "--use-torch-distributed-ckpt means --checkpoint-backend dcp, but "
                                  "--checkpoint-backend concurrent was given"),
    "fsdp without distributed": (["--parallel", "fsdp"], "--parallel fsdp shards the model over the ranks"),
    # a name too long to be a path is not a file or folder, not an OSError
    "model name too long": (["--model", "m" * 300], "invalid choice: 'mmmm"),
    "init-from name too long": (["--init-from", "i" * 300], "is not a folder"),
    # each checkpoint in flight is a copy of the state in RAM: the hint names the flag that fixes it
    "max-async too many": (["--checkpoint-backend", "concurrent", "--max-async", "1000000"], "(--max-async {n} fits)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, corpus, case):
    flags, says = BAD[case]
    ck, cwd = tmp_path / "ck", tmp_path / "cwd"
    cwd.mkdir()
    # TINY and 2 steps: a build that accepts the input finishes quickly (and fails this test by its exit code)
    proc = run_train(TINY + ["--training-steps", "2", "--dataset", corpus, "--checkpoint-dir", str(ck),
                             *[f.format(tmp=tmp_path) for f in flags]], cwd=cwd, timeout=180)
    line = one_error_line(proc)
    pattern = re.escape(says.format(tmp=tmp_path, n="{n}")).replace(re.escape("{n}"), r"\d+")
    assert re.search(pattern, line), line
    # nothing taken (no lease), nothing written: not under --checkpoint-dir, not beside or above it, not in the cwd
    assert [p.name for p in tmp_path.iterdir()] == ["cwd"] and not list(cwd.iterdir())


@pytest.mark.parametrize("tolerance", ["nan", "-1"])
def test_check_weights_refuses_a_tolerance_that_cannot_compare(tmp_path, tolerance):
    import torch

    weights = tmp_path / "model.pt"
    torch.save({"w": torch.zeros(3)}, weights)
    proc = check_weights(weights, weights, "--tolerance", tolerance)  # identical: EQUAL for any tolerance >= 0
    line = one_error_line(proc)
    assert f"--tolerance {tolerance} is not a finite number >= 0" in line, line
    assert proc.stdout == ""


# --- --force-takeover: nothing that can refuse the new start comes after the takeover -----------------------------


@pytest.mark.slow
def test_force_takeover_refused_on_resume_fences_nothing(tmp_path, corpus):
    """B passes --force-takeover with a flag the checkpoint refuses (another --seed): B is refused before it takes the
    run directory over, so A -- alive, frozen meanwhile -- is not fenced and finishes."""
    args = TINY + ["--dataset", corpus, "--training-steps", "12", "--checkpoint-frequency", "4", "--checkpoint-dir",
                   str(tmp_path), "--log-loss-to-csv", "--resume-from-checkpoint", "latest"]
    a = start_train(args, {"PYRECOVER_STEP_SLEEP": "0.1"})
    try:
        wait_rows(tmp_path / "default/loss.csv", 5, a)  # step 4 committed: B's resume has a checkpoint to compare
        a.send_signal(signal.SIGSTOP)  # alive, holding the run directory, whatever the machine's speed
        try:
            b = run_train(args + ["--force-takeover", "--seed", "7"])
        finally:
            a.send_signal(signal.SIGCONT)
        line = one_error_line(b)
        assert "--seed 7 differs from the checkpoint's 42" in line, line
        out, err = a.communicate(timeout=300)
    finally:
        if a.poll() is None:
            a.kill()
            a.communicate()
    assert a.returncode == 0, out[-2000:] + err[-2000:]  # not fenced (exit 6)
    assert "fenced" not in out + err and "Traceback" not in err
    assert sorted(p.name for p in (tmp_path / "default/.owner").glob("gen-*")) == ["gen-00000001.json"]


# --- SIGTERM before training: one line, 143 -------------------------------------------------------------------------


def _signal_bits(pid: int, field: str) -> int:
    """A signal set of /proc/PID/status (SigCgt: caught, SigBlk: blocked) as a bit mask (bit n-1 = signal n)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no {field} in /proc/{pid}/status")


@pytest.mark.parametrize("when", ["imports", "setup"])
def test_sigterm_before_training_is_one_line_and_143(tmp_path, corpus, when):
    """`imports`: train.py's own handler is in place (SIGTERM caught) while torch is imported. `setup`: the stop
    policy's handlers exist (it has released the held SIGUSR1), training has not started (tokenizer, data, model)."""
    proc = start_train([*TINY, "--training-steps", "2", "--dataset", corpus, "--checkpoint-dir", str(tmp_path)])
    try:
        deadline = time.monotonic() + 120
        while not (_signal_bits(proc.pid, "SigCgt") >> (signal.SIGTERM - 1)) & 1 or (
                when == "setup" and (_signal_bits(proc.pid, "SigBlk") >> (signal.SIGUSR1 - 1)) & 1):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
            time.sleep(0.002)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err[-2000:])
    assert err.splitlines() == ["terminated (SIGTERM) before training started: nothing to save yet"], err[-2000:]
    assert "step " not in out
