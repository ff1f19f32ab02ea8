"""checkpoint/ core: kill anywhere, resume bit-exact; latest, retention, verification, bad input, the CLIs."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import (PY, ROOT, TINY, alive, check_weights, check_weights_cli, csv_rows, env_for_tests, kill_run_at_row,
                     loss_rows, run_train, torchrun_cmd)

sys.path.insert(0, str(ROOT))
from checkpoint import layout  # noqa: E402
from checkpoint.retention import apply_retention  # noqa: E402
import warm  # noqa: E402

pytestmark = pytest.mark.slow  # end-to-end runs: `make test`, not `make test-fast`

STEPS = 24
FREQ = 4


def _args(corpus: str, ckdir: Path) -> list[str]:
    return TINY + ["--dataset", corpus, "--training-steps", str(STEPS), "--checkpoint-frequency", str(FREQ),
                   "--log-loss-to-csv", "--checkpoint-dir", str(ckdir), "--max-kept-checkpoints", "2"]


def _cmd(nproc: int, args: list[str]) -> list[str]:
    return [PY, str(ROOT / "train.py"), *args] if nproc == 1 else torchrun_cmd(nproc, args)


def _run(nproc: int, args: list[str], env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(nproc, args), capture_output=True, text=True, timeout=timeout, env=env_for_tests(env),
                          cwd=ROOT)


def _kill_at_row(nproc: int, args: list[str], csv: Path, row: int) -> None:
    """A real `kill -9` of the run (launcher and every rank) once the loss CSV shows `row` steps."""
    kill_run_at_row(_cmd(nproc, args), csv, row)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """Uninterrupted runs, single process and 2 ranks."""
    refs = {}
    for nproc in (1, 2):
        ck = tmp_path_factory.mktemp(f"ref{nproc}")
        proc = _run(nproc, _args(corpus, ck))
        assert proc.returncode == 0, proc.stderr[-3000:]
        refs[nproc] = ck / "default"
    return refs


def _assert_same_as_reference(ref: Path, run: Path) -> None:
    cmp = check_weights(ref, run, "--tolerance", "0", "--optimizer")
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr
    assert "bitwise" in cmp.stdout
    assert loss_rows(run / "loss.csv") == loss_rows(ref / "loss.csv")
    assert [int(r[0]) for r in loss_rows(run / "loss.csv")] == list(range(1, STEPS + 1))  # every step exactly once


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigkill_at_random_step_then_resume_is_bit_exact(nproc, corpus, tmp_path, reference):
    seed = int(os.environ.get("PYRECOVER_TEST_SEED", time.time_ns() % 10_000))
    kill_row = random.Random(seed).randint(FREQ + 1, STEPS - 2)
    print(f"kill at step {kill_row} (PYRECOVER_TEST_SEED={seed})")
    args = _args(corpus, tmp_path)
    _kill_at_row(nproc, args, tmp_path / "default/loss.csv", kill_row)
    proc = _run(nproc, args + ["--resume-from-checkpoint", "latest"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    _assert_same_as_reference(reference[nproc], tmp_path / "default")


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigkill_inside_a_save_leaves_previous_checkpoint_latest(nproc, corpus, tmp_path, reference):
    # Rank 0 renames 3 files before the first save (its lease generation, config.resolved.json, places.json), then 9
    # per vanilla save (7 files, its manifest part, COMMITTED): the 14th rename is inside the 2nd save (step 8).
    args = _args(corpus, tmp_path)
    proc = _run(nproc, args, env={"PYRECOVER_FAULT": "after_fsync_before_rename:14"})
    assert proc.returncode != 0
    root = tmp_path / "default"
    # The interrupted save of step 8 is in its staging folder, never visible as a step folder.
    infos = {i.step: i.committed for i in layout.list_checkpoints(root)}
    assert infos == {4: True}, infos
    staged = list(root.glob(".staging-*/step-00000008"))
    assert len(staged) == 1 and not (staged[0] / layout.COMMITTED).exists()
    assert layout.resolve(root, "latest").step == 4
    proc = _run(nproc, args + ["--resume-from-checkpoint", "latest"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "removed what interrupted saves left" in proc.stdout and "step-00000008" in proc.stdout  # named, then gone
    assert "resumed from" in proc.stdout and "step 4" in proc.stdout
    _assert_same_as_reference(reference[nproc], root)


def test_bitflip_falls_back_to_previous_checkpoint(corpus, tmp_path, reference):
    args = _args(corpus, tmp_path)
    _kill_at_row(1, args, tmp_path / "default/loss.csv", 13)
    root = tmp_path / "default"
    newest = layout.list_checkpoints(root)[-1]
    model_pt = newest.path / "model.pt"
    data = bytearray(model_pt.read_bytes())
    data[len(data) // 2] ^= 0x40
    model_pt.write_bytes(bytes(data))
    proc = _run(1, args + ["--resume-from-checkpoint", "latest"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{model_pt} fails its checksum" in proc.stdout
    assert f"step {newest.step - FREQ}" in proc.stdout
    _assert_same_as_reference(reference[1], root)


def _fake_checkpoint(root: Path, step: int, committed: bool = True) -> Path:
    d = root / layout.step_dir_name(step)
    d.mkdir(parents=True)
    rec = layout.atomic_write_bytes(d / "model.pt", b"x" * 10)
    parts = [{"rank": 0, "files": {"model.pt": rec}}]
    if committed:
        layout.commit(d, step, 1, "vanilla", parts)
    return d


def test_retention_orders_by_numeric_step(tmp_path):
    for step in (99, 100, 1000):
        _fake_checkpoint(tmp_path, step)
    _fake_checkpoint(tmp_path, 5, committed=False)  # crash leftover, older than the newest commit
    _fake_checkpoint(tmp_path, 2000, committed=False)  # newer, maybe in progress: must survive
    assert [i.step for i in layout.list_checkpoints(tmp_path)] == [5, 99, 100, 1000, 2000]
    deleted = apply_retention(tmp_path, keep=2)
    assert sorted(deleted) == [5, 99]
    assert [i.step for i in layout.list_checkpoints(tmp_path)] == [100, 1000, 2000]
    assert layout.resolve(tmp_path, "latest").step == 1000
    # keep=1 never deletes the newest committed one; milestones survive
    _fake_checkpoint(tmp_path, 3000)
    apply_retention(tmp_path, keep=1, keep_every=1000)
    assert [i.step for i in layout.list_checkpoints(tmp_path) if i.committed] == [1000, 3000]


def test_retention_in_a_real_run_keeps_newest_k(corpus, tmp_path):
    run_train(_args(corpus, tmp_path), check=True)
    steps = [i.step for i in layout.list_checkpoints(tmp_path / "default")]
    assert steps == [20, 24]


def test_resume_bad_inputs(corpus, tmp_path):
    args = _args(corpus, tmp_path) + ["--training-steps", "4"]
    # a path that does not exist
    proc = run_train(args + ["--resume-from-checkpoint", str(tmp_path / "nope")])
    assert proc.returncode == 2 and "not found" in proc.stderr and "Traceback" not in proc.stderr
    # `latest` with nothing there: starts fresh and says so
    proc = run_train(args + ["--resume-from-checkpoint", "latest"], check=True)
    assert "no checkpoint found" in proc.stdout and "starting fresh" in proc.stdout
    # a different model config: names the flag and both presets (the saved flags load before the tensors)
    proc = run_train(_args(corpus, tmp_path) + ["--model", "small", "--training-steps", "8",
                                                "--resume-from-checkpoint", "latest"])
    assert proc.returncode == 2
    err = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(err) == 1 and "--model small differs from the checkpoint's tiny" in err[0], proc.stderr
    # a checkpoint dir that cannot be written: refused at startup
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = run_train(TINY + ["--dataset", corpus, "--checkpoint-dir", str(blocker / "sub"), "--training-steps", "4"])
    assert proc.returncode == 2 and "not writable" in proc.stderr and "step 1" not in proc.stdout


def test_resume_by_step_and_by_path(corpus, tmp_path):
    run_train(_args(corpus, tmp_path) + ["--training-steps", "8"], check=True)
    proc = run_train(_args(corpus, tmp_path) + ["--training-steps", "10", "--resume-from-checkpoint", "4"], check=True)
    assert "step 4" in proc.stdout
    # How long the restart took, and where the time went: the parts add up to the whole (each printed to 0.01 s).
    m = re.search(r"^recovery: first step after resume ([\d.]+)s after process start \(python start-up ([\d.]+)s, "
                  r"imports ([\d.]+)s, setup ([\d.]+)s, checkpoint load ([\d.]+)s, first step ([\d.]+)s\)$",
                  proc.stdout, re.M)
    assert m, proc.stdout[-3000:]
    total, *parts = map(float, m.groups())
    assert all(p >= 0 for p in parts) and abs(sum(parts) - total) <= 0.05 + 0.01 * len(parts), m.group(0)
    path = tmp_path / "default" / layout.step_dir_name(10)
    proc = run_train(_args(corpus, tmp_path) + ["--training-steps", "12", "--resume-from-checkpoint", str(path)],
                     check=True)
    assert "step 10" in proc.stdout


def test_check_weights_equality_exit_codes(corpus, tmp_path):
    run_train(_args(corpus, tmp_path / "a") + ["--training-steps", "4"], check=True)
    run_train(_args(corpus, tmp_path / "b") + ["--training-steps", "4", "--seed", "7"], check=True)
    a, b = tmp_path / "a/default/step-00000004", tmp_path / "b/default/step-00000004"
    same = check_weights_cli(a, a, "--tolerance", "0", "--verbose", "--optimizer")
    assert same.returncode == 0 and "max|a-b|" in same.stdout
    diff = check_weights_cli(a, b, "--tolerance", "0")
    assert diff.returncode == 1 and "differs" in diff.stdout
    loose = check_weights_cli(a, b, "--tolerance", "100")
    assert loose.returncode == 0
    missing = check_weights_cli(a, tmp_path / "nope")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    single_file = check_weights_cli(a / "model.pt", a, "--tolerance", "0")
    assert single_file.returncode == 0
    # the suite's in-process check_weights (helpers.py) answers as the command line does
    for args, code in (((a, a, "--tolerance", "0", "--optimizer"), 0), ((a, b, "--tolerance", "0"), 1),
                       ((a, tmp_path / "nope"), 2), ((a, a, "--tolerance", "nan"), 2)):
        assert check_weights(*args).returncode == code, args


def test_checkpoint_cli_list_verify_inspect(corpus, tmp_path):
    run_train(_args(corpus, tmp_path) + ["--training-steps", "8"], check=True)
    root = tmp_path / "default"

    def cli(*a):
        return subprocess.run([PY, "-m", "checkpoint", *a], capture_output=True, text=True, cwd=ROOT,
                              env=env_for_tests(), timeout=120)

    out = cli("list", str(root))
    assert out.returncode == 0 and "<- latest" in out.stdout and "valid" in out.stdout
    assert cli("verify", str(root)).returncode == 0
    out = cli("inspect", str(root / "step-00000008"))
    assert out.returncode == 0 and "tok_embeddings.weight" in out.stdout and '"step": 8' in out.stdout
    (root / "step-00000008" / "optimizer.pt").write_bytes(b"garbage")
    out = cli("verify", str(root))
    assert out.returncode == 1 and "FAILED" in out.stdout


# --- a warm standby (warm.py) -----------------------------------------------------------------------------------------

@contextlib.contextmanager
def standby(folder: Path, env: dict | None = None):
    """`python warm.py serve` on a socket in ``folder``: (its process, the ranks' variables)."""
    sock = folder / "warm.sock"
    with warm.running(str(sock), env=env_for_tests(env)) as proc:
        yield proc, {"PYRECOVER_WARM": str(sock)}
    assert not sock.exists()  # the standby removes its socket


def standby_children(proc: subprocess.Popen) -> list[int]:
    return [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]


def test_sigkill_then_resume_through_a_warm_standby_is_bit_exact(corpus, tmp_path, reference):
    """Both incarnations of 2 ranks run as children of one warm standby; the kill of the launcher and its ranks ends
    the standby's children too, and the resume is bitwise the uninterrupted run."""
    args = _args(corpus, tmp_path)
    with standby(tmp_path) as (server, env):
        kill_run_at_row(_cmd(2, args), tmp_path / "default/loss.csv", 9, env=env_for_tests(env))
        deadline = time.monotonic() + 30
        while standby_children(server):  # the ranks' stand-ins died: their children are SIGKILLed
            assert time.monotonic() < deadline, "the standby's children outlived their ranks"
            time.sleep(0.05)
        proc = _run(2, args + ["--resume-from-checkpoint", "latest"], env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        recovery = re.search(r"recovery: .*imports (\d+\.\d+)s", proc.stdout)
        assert recovery and float(recovery.group(1)) < 0.05, proc.stdout[-3000:]  # the imports were paid before
        assert "warm standby" not in proc.stderr  # nothing declined
    _assert_same_as_reference(reference[2], tmp_path / "default")


def test_a_warm_standby_forwards_signals_and_declines_what_it_cannot_run(corpus, tmp_path):
    """SIGTERM to the rank reaches the standby's child: it saves and stops (exit 4). A standby whose import-time
    environment differs (OMP_NUM_THREADS) declines with one line, and the rank starts cold."""
    args = _args(corpus, tmp_path) + ["--checkpoint-frequency", "1000"]
    with standby(tmp_path) as (_, env):
        run = subprocess.Popen(_cmd(1, args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env_for_tests(env), cwd=ROOT)
        deadline = time.monotonic() + 120
        while csv_rows(tmp_path / "default/loss.csv") < 3:
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            time.sleep(0.02)
        run.send_signal(signal.SIGTERM)
        out, err = run.communicate(timeout=120)
        assert run.returncode == 4, out[-2000:] + err[-2000:]
        assert re.search(r"checkpoint step \d+ committed", out), out[-2000:]
    no_omp = {k: v for k, v in env_for_tests().items() if k != "OMP_NUM_THREADS"}
    with standby(tmp_path, {"OMP_NUM_THREADS": "1"}) as (_, env):
        proc = subprocess.run(_cmd(1, _args(corpus, tmp_path / "cold") + ["--training-steps", "2"]),
                              capture_output=True, text=True, env=no_omp | env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    declined = [ln for ln in proc.stderr.splitlines() if "warm standby" in ln]
    assert declined == [f"warm standby {env['PYRECOVER_WARM']} not used (OMP_NUM_THREADS is set in the standby but "
                        "not in the rank): a cold start"], proc.stderr[-2000:]


def test_a_killed_standby_takes_its_children_with_it(corpus, tmp_path):
    """SIGKILL of the standby mid-run: its child (the rank's training) dies with it, and the rank process says so in
    one line and exits 1; no orphan trains on."""
    csv = tmp_path / "default/loss.csv"
    with standby(tmp_path) as (server, env):
        run = subprocess.Popen(_cmd(1, _args(corpus, tmp_path) + ["--training-steps", "2000"]), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env_for_tests(env), cwd=ROOT)
        deadline = time.monotonic() + 120
        while csv_rows(csv) < 3:
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            time.sleep(0.02)
        child = standby_children(server)
        server.kill()
        server.wait()
        out, err = run.communicate(timeout=60)
        Path(env["PYRECOVER_WARM"]).unlink()  # a killed standby leaves its socket (the next one replaces it)
    assert run.returncode == 1, err[-2000:]
    assert f"error: the warm standby {env['PYRECOVER_WARM']} ended while running this rank" in err, err[-2000:]

    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in child):  # a zombie waiting for init is not running
        assert time.monotonic() < deadline, f"the standby's child {child} outlived it"
        time.sleep(0.05)
