"""A rank does not outlive its launcher (distributed.follow_launcher): SIGKILL torchrun alone -- its ranks run in
sessions of their own, so nothing else reaches them -- and the ranks are gone within seconds; the restart is not refused
by the lease they held and resumes from the last committed checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from helpers import ROOT, TINY, alive, process_tree, csv_rows, env_for_tests, run_torchrun, torchrun_cmd


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (tells the process from a later one that reuses its pid)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None


def test_ranks_end_with_their_killed_torchrun_and_the_restart_resumes(tmp_path, corpus):
    args = TINY + ["--dataset", corpus, "--training-steps", "30", "--checkpoint-frequency", "4", "--checkpoint-dir",
                   str(tmp_path), "--log-loss-to-csv"]
    csv = tmp_path / "default/loss.csv"
    launcher = subprocess.Popen(torchrun_cmd(2, args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=env_for_tests({"PYRECOVER_STEP_SLEEP": "0.2"}), cwd=ROOT, start_new_session=True)
    started: dict[int, str | None] = {}
    try:
        deadline = time.monotonic() + 240
        while csv_rows(csv) < 5:  # step 4 committed; the ranks train on
            assert launcher.poll() is None, f"torchrun ended (rc {launcher.returncode}) before step 5"
            assert time.monotonic() < deadline, "timed out waiting for the ranks to train"
            time.sleep(0.02)
        started = {pid: _start_time(pid) for pid in process_tree(launcher.pid) if pid != launcher.pid}
        assert len(started) >= 2, started  # the two ranks
        os.kill(launcher.pid, signal.SIGKILL)  # the launcher alone, as an OOM kill or `kill -9 <torchrun>` does
        launcher.wait()
        gone_by = time.monotonic() + 5
        while any(alive(pid) and _start_time(pid) == t for pid, t in started.items()):
            assert time.monotonic() < gone_by, f"ranks outlived their torchrun: {sorted(started)}"
            time.sleep(0.02)
        trained = csv_rows(csv)
        restart = run_torchrun(2, args + ["--resume-from-checkpoint", "latest"])
        assert restart.returncode == 0, restart.stdout[-3000:] + restart.stderr[-3000:]
        assert "in use by" not in restart.stderr
        resumed = int(restart.stdout.split("resumed from")[1].split("(step ")[1].split(",")[0])
        assert 4 <= resumed < trained and resumed % 4 == 0, (resumed, trained)
        assert csv_rows(csv) == 30  # every step exactly once
    finally:
        for pid, t in started.items():  # the ranks are in sessions of their own: each by its pid, if still the same
            if alive(pid) and _start_time(pid) == t:
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
