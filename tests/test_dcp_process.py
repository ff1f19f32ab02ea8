"""The dcp backend's process mode (`--async-checkpoint process`: DCP's background save process) through the real CLI:
kill -9 and resume bit-exact on 1 process and on 2 torchrun/gloo ranks (FSDP), and a failure inside the save process
stopping the run in one line."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from helpers import PY, ROOT, TINY, check_weights, csv_rows, env_for_tests, kill_run_at_row, loss_rows, torchrun_cmd

sys.path.insert(0, str(ROOT))
from checkpoint import layout  # noqa: E402

pytestmark = pytest.mark.slow  # end-to-end runs: `make test`, not `make test-fast`

STEPS = 12
FREQ = 4
DCP = ["--checkpoint-backend", "dcp"]
PROCESS = ["--async-checkpoint", "process"]
RUNS = {1: [], 2: ["--distributed", "--parallel", "fsdp"]}  # ranks -> flags


def _args(corpus: str, ckdir, *extra: str, keep: int = 2) -> list[str]:
    return TINY + ["--dataset", corpus, "--training-steps", str(STEPS), "--checkpoint-frequency", str(FREQ),
                   "--log-loss-to-csv", "--checkpoint-dir", str(ckdir), "--max-kept-checkpoints", str(keep), *extra]


def _cmd(nproc: int, args: list[str]) -> list[str]:
    return [PY, str(ROOT / "train.py"), *args] if nproc == 1 else torchrun_cmd(nproc, args)


def _run(nproc: int, args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    # capture_output: this returns only once every holder of the pipes has exited, DCP's save processes included
    return subprocess.run(_cmd(nproc, args), capture_output=True, text=True, timeout=300, env=env_for_tests(env),
                          cwd=ROOT)


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """Uninterrupted runs with synchronous dcp saves, every checkpoint kept: 1 process and 2 ranks FSDP."""
    refs = {}
    for nproc, flags in RUNS.items():
        ck = tmp_path_factory.mktemp(f"dcp-sync-{nproc}")
        _ok(_run(nproc, _args(corpus, ck, *DCP, *flags, keep=0)))
        refs[nproc] = ck / "default"
    return refs


@pytest.mark.parametrize("nproc", sorted(RUNS))
def test_process_save_kill_and_resume_is_bit_exact(nproc, corpus, tmp_path, reference):
    # One save in flight: the step-8 save waits until the step-4 one has committed, so from row 9 on a checkpoint
    # written by the save process exists; the kill may also catch the step-8 save in flight.
    kill_row = random.randint(2 * FREQ + 1, STEPS - 2)
    print(f"kill at step {kill_row}")
    args = _args(corpus, tmp_path, *DCP, *RUNS[nproc], *PROCESS)
    kill_run_at_row(_cmd(nproc, args), tmp_path / "default/loss.csv", kill_row)
    root = tmp_path / "default"
    assert [i.step for i in layout.list_checkpoints(root) if i.committed], "nothing committed before the kill"

    proc = _ok(_run(nproc, args + ["--resume-from-checkpoint", "latest"]))
    assert "resumed from" in proc.stdout
    # the save process's own logging (every request, at INFO) and its shutdown stay off the run's output
    assert "Traceback" not in proc.stderr and " INFO " not in proc.stderr, proc.stderr[-3000:]

    manifest = layout.verify(root / layout.step_dir_name(STEPS))  # every file's checksum, as recorded in the child
    shards = {f"__{r}_0.distcp" for r in range(nproc)}
    assert manifest["backend"] == "dcp" and {".metadata", *shards} <= set(manifest["files"])
    leftovers = [p.name for p in root.rglob(".dcp-records-*")]
    assert not leftovers, leftovers  # the records files are read and removed before the commit

    cmp = check_weights(reference[nproc], root, "--tolerance", "0", "--optimizer")
    assert cmp.returncode == 0 and "bitwise" in cmp.stdout, cmp.stdout + cmp.stderr
    assert loss_rows(root / "loss.csv") == loss_rows(reference[nproc] / "loss.csv")
    assert [int(r[0]) for r in loss_rows(root / "loss.csv")] == list(range(1, STEPS + 1))


def test_save_process_error_stops_the_run_in_one_line(corpus, tmp_path):
    # the first file DCP writes fails with EIO -- inside the save process (it inherits the fault setting)
    proc = _run(1, _args(corpus, tmp_path, *DCP, *PROCESS), env={"PYRECOVER_FAULT": "dcp_write_file:1:error"})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: saving step 4") and "injected I/O error" in errors[0], errors
    # surfaced by a per-step poll or, at the latest, by the step-8 save waiting for it (one save in flight)
    assert csv_rows(tmp_path / "default/loss.csv") <= 2 * FREQ
    assert not [i for i in layout.list_checkpoints(tmp_path / "default") if i.committed]
