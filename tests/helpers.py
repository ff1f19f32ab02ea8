"""Shared test helpers: run the real CLI in subprocesses, exactly as a user would."""

from __future__ import annotations

import csv
import importlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # benchmarks/ beside tests/ (pytest puts the root there; a script run may not)
    sys.path.insert(0, str(ROOT))
from benchmarks.procs import alive, process_tree  # noqa: E402  (the tree a lost node takes: kill_tree)
PY = sys.executable

# The tiny configuration every end-to-end test trains (seconds per run on 2 CPU cores).
TINY = ["--model", "tiny", "--sequence-length", "32", "--batch-size", "4", "--lr-warmup-steps", "5",
        "--logging-frequency", "5"]


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def optional_module(name: str):
    """A test-only extra (pip install -e .[dev]), or None when it is not installed: see `require`."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def require(module, name: str) -> None:
    """Skip a test whose extra is missing on a user's machine; in CI, which installs every extra, fail instead."""
    if module is None:
        reason = f"{name} is not installed (test-only extra: pip install -e .[dev])"
        if in_ci():
            pytest.fail(reason)
        pytest.skip(reason)


def env_for_tests(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.pop("PYRECOVER_FAULT", None)
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    env.update(extra or {})
    return env


def run_train(args: list[str], *, env: dict | None = None, timeout: float = 300, check: bool = False,
              cwd: Path = ROOT) -> subprocess.CompletedProcess:
    proc = subprocess.run([PY, str(ROOT / "train.py"), *args], capture_output=True, text=True, timeout=timeout,
                          env=env_for_tests(env), cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py exited {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}")
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(nproc: int, args: list[str]) -> list[str]:
    return [PY, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", str(ROOT / "train.py"), "--distributed", *args]


def run_torchrun(nproc: int, args: list[str], *, env: dict | None = None, timeout: float = 300,
                 check: bool = False) -> subprocess.CompletedProcess:
    proc = subprocess.run(torchrun_cmd(nproc, args), capture_output=True, text=True, timeout=timeout,
                          env=env_for_tests(env), cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun exited {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}")
    return proc


def check_weights(a: Path, b: Path, *extra: str) -> subprocess.CompletedProcess:
    """tests/check_weights_equality.py on ``a`` and ``b``, run in this process: the same comparison and exit code as
    its command line, without a process that imports torch for each call (about 4 s of CPU each, dozens of calls in the
    suite). Its command line itself is tested through check_weights_cli (test_checkpoint.py)."""
    import contextlib
    import io

    from check_weights_equality import main  # tests/ is on sys.path: this module came from there

    argv = [str(a), str(b), *extra]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse: a bad flag
            rc = e.code if isinstance(e.code, int) else 2
    return subprocess.CompletedProcess(["check_weights_equality.py", *argv], rc, out.getvalue(), err.getvalue())


def check_weights_cli(a: Path, b: Path, *extra: str) -> subprocess.CompletedProcess:
    """The same, through the script's command line (as docs/install.md has a user run it)."""
    return subprocess.run([PY, str(ROOT / "tests" / "check_weights_equality.py"), str(a), str(b), *extra],
                          capture_output=True, text=True, timeout=120, env=env_for_tests())


def loss_rows(path: Path) -> list[tuple[str, str, str, str]]:
    """The deterministic columns of a loss CSV (wall time and restart count legitimately differ between runs)."""
    with open(path, newline="") as f:
        return [(r["step"], r["loss"], r["lr"], r["tokens_seen"]) for r in csv.DictReader(f)]


def val_rows(path: Path) -> list[tuple[str, str, str, str]]:
    """The deterministic columns of a val CSV (wall time legitimately differs)."""
    with open(path, newline="") as f:
        return [(r["step"], r["val_loss"], r["val_ppl"], r["val_tokens"]) for r in csv.DictReader(f)]


def csv_rows(csv: Path) -> int:
    try:
        return max(0, len(csv.read_text().splitlines()) - 1)
    except FileNotFoundError:
        return 0


def start_train(args: list[str], env: dict | None = None) -> subprocess.Popen:
    """train.py in the background (text pipes): for tests that act on a run while it trains."""
    return subprocess.Popen([PY, str(ROOT / "train.py"), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env_for_tests(env), cwd=ROOT)


def wait_rows(csv: Path, rows: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Wait until the run's loss CSV has ``rows`` rows; fail if the run ends first or the time runs out."""
    deadline = time.monotonic() + timeout
    while csv_rows(csv) < rows:
        assert proc.poll() is None, f"run ended (rc {proc.returncode}) before row {rows}: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.02)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process and every descendant (torchrun's ranks sit in sessions of their own), and wait until each is
    gone: orphaned ranks are reaped by init."""
    tree = process_tree(proc.pid)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in tree):
        assert time.monotonic() < deadline, "ranks survived SIGKILL"
        time.sleep(0.01)


def kill_run_at_row(cmd: list[str], csv: Path, row: int, *, env: dict | None = None, cwd: Path = ROOT,
                    timeout: float = 300, ready: Callable[[], bool] | None = None) -> int:
    """Start a run and SIGKILL it -- torchrun and every rank, like a node loss -- once the loss CSV shows `row` steps
    and ``ready()`` (if given) holds, e.g. an asynchronous save has landed. The rows seen when the kill was sent."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env or env_for_tests(),
                            cwd=cwd, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while (seen := csv_rows(csv)) < row or (ready is not None and not ready()):
            assert proc.poll() is None, f"run ended (rc {proc.returncode}) before step {row}"
            assert time.monotonic() < deadline, "timed out waiting for the run to reach the kill step"
            time.sleep(0.01)
    finally:
        kill_tree(proc)
    assert csv_rows(csv) < seen + 2  # nothing kept training after the kill
    return seen


class LogLines(list):
    """The lines the checkpoint package logs (stdlib logging, checkpoint/logs.py) from the moment this is made until
    the test ends (conftest detaches every one)."""

    attached: list["LogLines"] = []

    def __init__(self) -> None:
        super().__init__()
        self._handler = logging.Handler(logging.INFO)
        self._handler.emit = lambda record: self.append(record.getMessage())
        logger = logging.getLogger("checkpoint")
        logger.addHandler(self._handler)
        logger.setLevel(logging.INFO)
        LogLines.attached.append(self)

    def has(self, text: str) -> bool:
        return any(text in m for m in self)

    @classmethod
    def detach_all(cls) -> None:
        while cls.attached:
            logging.getLogger("checkpoint").removeHandler(cls.attached.pop()._handler)


def assert_same_tree(a, b, path: str = "state", *, exact_containers: bool = False) -> None:
    """Two nested state dicts hold the same values: tensors of the same dtype, shape and bytes, equal plain values.
    ``exact_containers``: the same container types and dict key order too (the order decides a saved file's bytes)."""
    import torch

    if exact_containers:
        assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.flatten().view(torch.uint8).tolist() == b.flatten().view(torch.uint8).tolist(), path
    elif isinstance(a, dict):
        keys_a, keys_b = (list(a), list(b)) if exact_containers else (set(a), set(b))
        assert keys_a == keys_b, f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            assert_same_tree(a[k], b[k], f"{path}.{k}", exact_containers=exact_containers)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{path}[{i}]", exact_containers=exact_containers)
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
