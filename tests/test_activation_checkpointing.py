"""Activation checkpointing (--activation-checkpointing) through the real CLI on 2 torchrun/gloo ranks: recomputing
activations changes no result, and checkpoints do not depend on it (the mode may change on resume), so a run killed
(SIGKILL, torchrun and every rank) and resumed in another mode ends bitwise equal -- weights, optimizer state, loss
rows -- to an uninterrupted run without it. DDP + gradient accumulation: trains with `full`, killed, resumed with
`selective`; FSDP2 (dcp checkpoints): trains with `selective`, killed, resumed with `full`. So each mode is killed and
resumed under each parallelism. The same runs resume the `linear` (DDP) and `constant` (FSDP2) LR schedules bitwise
(tests/test_continued_pretraining.py resumes `wsd`, the other resume tests `cosine`).

--compile with activation checkpointing is not run here: on these CPUs one compiled tiny run takes over a minute. The
transform only sets each recomputed block's ``forward`` (distributed.checkpoint_activations), which Dynamo traces as
a torch.utils.checkpoint region; a tiny run was checked by hand to train with identical losses."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import TINY, check_weights, kill_run_at_row, loss_rows, run_torchrun, torchrun_cmd

pytestmark = pytest.mark.slow  # end-to-end runs: `make test`, not `make test-fast`

STEPS, FREQ = 8, 4
CASES = {  # parallel mode: (activation checkpointing until the kill, after the resume, the flags both run with)
    "ddp": ("full", "selective", ["--parallel", "ddp", "--gradient-accumulation-steps", "2", "--lr-schedule", "linear"]),
    "fsdp": ("selective", "full", ["--parallel", "fsdp", "--checkpoint-backend", "dcp", "--lr-schedule", "constant"]),
}


def _args(corpus: str, ckdir: Path, parallel: str, mode: str) -> list[str]:
    return TINY + ["--dataset", corpus, "--training-steps", str(STEPS), "--checkpoint-frequency", str(FREQ),
                   "--log-loss-to-csv", "--checkpoint-dir", str(ckdir), *CASES[parallel][2],
                   "--activation-checkpointing", mode]


def _ok(proc):
    assert proc.returncode == 0, (f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-3000:]}"
                                 f"\nSTDERR:\n{proc.stderr[-3000:]}")
    return proc


@pytest.mark.parametrize("parallel", list(CASES))
def test_killed_and_resumed_in_another_mode_is_bitwise_a_run_without_it(parallel, corpus, tmp_path):
    before, after = CASES[parallel][:2]
    reference = tmp_path / "reference"
    _ok(run_torchrun(2, _args(corpus, reference, parallel, "none")))

    run = tmp_path / "run"
    csv = run / "default" / "loss.csv"
    kill_run_at_row(torchrun_cmd(2, _args(corpus, run, parallel, before)), csv, FREQ + 2)  # after the step-4 save
    proc = _ok(run_torchrun(2, _args(corpus, run, parallel, after) + ["--resume-from-checkpoint", "latest"]))

    assert f"resume: applying --activation-checkpointing {after} (checkpoint had {before})" in proc.stdout, proc.stdout
    # the memory estimate line says it is on, and models the recompute
    estimate = next(line for line in proc.stdout.splitlines() if line.startswith("memory estimate:"))
    recomputed = {"full": 2, "selective": 1}[after]
    assert f"activation checkpointing {after}: {recomputed} of 2 blocks recomputed" in estimate, estimate
    cmp = check_weights(reference / "default", run / "default", "--tolerance", "0", "--optimizer")
    assert cmp.returncode == 0 and "bitwise" in cmp.stdout, cmp.stdout + cmp.stderr
    rows = loss_rows(csv)
    assert rows == loss_rows(reference / "default" / "loss.csv")
    assert [int(r[0]) for r in rows] == list(range(1, STEPS + 1))  # every step exactly once
