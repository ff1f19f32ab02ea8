"""`make train` through real make on a real terminal: make runs on a pseudo-terminal as its controlling terminal and the
test types Ctrl-C (the byte 0x03; the terminal driver sends SIGINT to the foreground process group, as for a person at
a keyboard). train.py saves and stops (exit 4), and make exits 0 with one line saying the state was saved -- while a
real failure (bad input, exit 2) is still a make error. The tiny model on a temp checkpoint dir, a few steps."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import PY, ROOT, TINY, csv_rows, env_for_tests  # noqa: E402

VENV = Path(PY).parent.parent


def make_train(corpus: str, *args: str) -> tuple[subprocess.Popen, int, list[bytes]]:
    """make train on a fresh pseudo-terminal (its controlling terminal, make in the foreground process group).
    Returns the process, the terminal's master side (write b"\\x03" = Ctrl-C) and the output read so far (a thread
    keeps reading: a full terminal buffer would block train.py)."""
    # -o: the venv and the dataset are there already; never reinstall/rebuild them from a test (a newer pyproject.toml
    # would otherwise reinstall the shared venv). Later train.py flags override the target's (argparse: last wins).
    cmd = ["make", "-C", str(ROOT), "-o", f"{VENV}/.installed", "-o", corpus, "train", f"VENV={VENV}",
           f"DATA={corpus}", "ARGS=" + " ".join([*TINY, *args])]
    master, slave = os.openpty()
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env_for_tests(None),
                            start_new_session=True,  # a new session, then the terminal becomes its controlling one:
                            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    os.close(slave)
    chunks: list[bytes] = []

    def read():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every process holding the terminal has ended
                return
            if not data:
                return
            chunks.append(data)
    threading.Thread(target=read, daemon=True).start()
    return proc, master, chunks


def finish(proc: subprocess.Popen, master: int, chunks: list[bytes], timeout: float = 120) -> str:
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(0.2)  # the reader drains what is left
    os.close(master)
    return b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")


def test_ctrl_c_under_make_train_saves_and_exits_0(tmp_path, corpus):
    ck = tmp_path / "ck"
    proc, master, chunks = make_train(corpus, "--checkpoint-dir", str(ck), "--experiment_name", "mk",
                                      "--training-steps", "100000")
    csv = ck / "mk" / "loss.csv"
    deadline = time.monotonic() + 120
    try:
        while csv_rows(csv) < 3:
            assert proc.poll() is None, b"".join(chunks).decode(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "no 3 loss rows within 120 s"
            time.sleep(0.05)
        os.write(master, b"\x03")  # Ctrl-C
    finally:
        out = finish(proc, master, chunks)
    assert proc.returncode == 0, out[-3000:]
    assert "interrupted (SIGINT)" in out and "committed" in out, out[-3000:]
    assert "make train: stopped with the state saved (train.py exit 4)" in out, out[-3000:]
    assert "Error" not in out and "Interrupt" not in out, out[-3000:]


def test_bad_input_under_make_train_is_still_a_make_error(tmp_path, corpus):
    proc, master, chunks = make_train(corpus, "--checkpoint-dir", str(tmp_path / "ck"), "--training-steps", "-1")
    out = finish(proc, master, chunks)
    assert proc.returncode != 0 and "Error 2" in out, out[-3000:]
    assert "state saved" not in out


def test_sigterm_to_train_py_without_a_terminal_is_a_saved_stop_and_exit_0(tmp_path, corpus):
    """No terminal (a batch job, nohup, CI): train.py is make's grandchild in make's process group; a SIGTERM to
    train.py alone (a scheduler, `kill PID`) saves and exits 4, and make exits 0."""
    ck = tmp_path / "ck"
    cmd = ["make", "-C", str(ROOT), "-o", f"{VENV}/.installed", "-o", corpus, "train", f"VENV={VENV}",
           f"DATA={corpus}", "ARGS=" + " ".join([*TINY, "--checkpoint-dir", str(ck), "--experiment_name", "mk",
                                                 "--training-steps", "100000"])]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env_for_tests(None), start_new_session=True)  # new session: no controlling terminal
    try:
        deadline = time.monotonic() + 120
        while csv_rows(ck / "mk" / "loss.csv") < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.05)
        pids = subprocess.run(["pgrep", "-g", str(proc.pid), "-f", "train.py --model"], capture_output=True,
                              text=True).stdout.split()
        trainer = [p for p in pids if "foreground.py" not in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(trainer) == 1, pids
        os.kill(int(trainer[0]), signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    assert "received SIGTERM" in out and "checkpoint committed" in out, out[-3000:]
    assert "make train: stopped with the state saved (train.py exit 4)" in out, out[-3000:]
