"""Every SLURM fact the program needs, read from the environment, ``squeue`` and ``scontrol``: this task's place in
the job (the launch, distributed.py) and the job's deadline, restarts and requeue (the stop/requeue policy).

Every command runs with a timeout and with the stop signals blocked in the child (``run``): SLURM delivers a job's
signals to every process of a task, so an ``squeue`` or ``scontrol requeue`` started by train.py would otherwise die of
the very warning signal it is reacting to. Times are read with ``TZ=UTC`` (``squeue -o %e`` prints local time without a
zone), so the parse is exact whatever the node's time zone.
"""

from __future__ import annotations

import calendar
import os
import re
import shutil
import signal
import subprocess
import time
from typing import Mapping, Sequence

#: signals blocked in children we start (the stop signals of policy.py plus the usual SLURM warning signals)
CHILD_BLOCKED = {signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT}


def in_job(environ: Mapping[str, str] = os.environ) -> bool:
    return bool(environ.get("SLURM_JOB_ID"))


def in_array(environ: Mapping[str, str] = os.environ) -> bool:
    return bool(environ.get("SLURM_ARRAY_JOB_ID")) and bool(environ.get("SLURM_ARRAY_TASK_ID"))


def job_id(environ: Mapping[str, str] = os.environ) -> str | None:
    """This job's own id (an array task has its own numeric id too)."""
    return environ.get("SLURM_JOB_ID") or None


def requeue_target(environ: Mapping[str, str] = os.environ) -> str | None:
    """What to hand ``scontrol requeue``: ``<array job>_<task>`` for an array task (the plain id works for most
    commands, but the array form is the one SLURM documents for addressing one task), else the job id."""
    if in_array(environ):
        return f"{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}"
    return job_id(environ)


def restart_count(environ: Mapping[str, str] = os.environ) -> int:
    """How often SLURM has requeued this job (``SLURM_RESTART_COUNT``; unset in the first run)."""
    try:
        return int(environ.get("SLURM_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def first_host(nodelist: str) -> str:
    """First hostname of a SLURM node list, e.g. 'nid[001-004,007]' -> 'nid001'. Uses scontrol when available."""
    try:
        out = run(["scontrol", "show", "hostnames", nodelist], timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    m = re.match(r"^([^\[,]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        return nodelist
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def task(environ: Mapping[str, str] = os.environ) -> tuple[int, int, int, str, int] | None:
    """This process as a task of an ``srun`` step: (rank, world size, local rank, master address, master port), or
    None outside one. The master is the step's first node; the port is derived from the job id, so two jobs sharing a
    node do not collide."""
    if not ("SLURM_PROCID" in environ and "SLURM_NTASKS" in environ and "SLURM_STEP_ID" in environ):
        return None
    master = environ.get("MASTER_ADDR") or first_host(
        environ.get("SLURM_STEP_NODELIST", environ.get("SLURM_JOB_NODELIST", "127.0.0.1")))
    port = int(environ.get("MASTER_PORT") or 20000 + int(environ.get("SLURM_JOB_ID", "0")) % 20000)
    return (int(environ["SLURM_PROCID"]), int(environ["SLURM_NTASKS"]), int(environ.get("SLURM_LOCALID", 0)), master,
            port)


def run(cmd: Sequence[str], timeout: float) -> subprocess.CompletedProcess:
    """Run a SLURM client command with the stop signals blocked (inherited by the child), output captured.

    Raises FileNotFoundError when the command is missing, subprocess.TimeoutExpired on timeout."""
    env = dict(os.environ, TZ="UTC")
    old = signal.pthread_sigmask(signal.SIG_BLOCK, CHILD_BLOCKED)
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=env,
                              stdin=subprocess.DEVNULL)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def parse_utc_time(text: str) -> float | None:
    """``2026-11-21T23:38:50`` (UTC, as printed under TZ=UTC) -> epoch seconds; None for NONE/N/A/Unknown/empty."""
    text = text.strip()
    try:
        return float(calendar.timegm(time.strptime(text, "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return None


def end_time(job: str, timeout: float = 10.0) -> tuple[float | None, str]:
    """The job's end time (epoch) and where it came from: ``squeue``, else ``scontrol show job``.
    Returns (None, why-not) when neither answers with a time (no limit, command missing, slurmctld down)."""
    problems = []
    for source, cmd in (("squeue", ["squeue", "-h", "-j", job, "-o", "%e"]),
                        ("scontrol", ["scontrol", "-o", "show", "job", job])):
        try:
            proc = run(cmd, timeout)
        except FileNotFoundError:
            problems.append(f"{source} not found")
            continue
        except subprocess.TimeoutExpired:
            problems.append(f"{source} timed out after {timeout:.0f}s")
            continue
        if proc.returncode != 0:
            problems.append(f"{source} exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[:200]}")
            continue
        if source == "squeue":
            value = proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""
        else:
            value = next((w.split("=", 1)[1] for w in proc.stdout.split() if w.startswith("EndTime=")), "")
        when = parse_utc_time(value)
        if when is not None:
            return when, source
        problems.append(f"{source} gave no end time ({value or 'empty'})")
    return None, "; ".join(problems)


def requeue(target: str, timeout: float = 30.0) -> tuple[bool, str]:
    """``scontrol requeue <target>``. Returns (ok, message). SLURM ends the running job right after it succeeds."""
    if shutil.which("scontrol") is None:
        return False, "scontrol not found on PATH"
    try:
        proc = run(["scontrol", "requeue", target], timeout)
    except FileNotFoundError:
        return False, "scontrol not found on PATH"
    except subprocess.TimeoutExpired:
        return False, f"`scontrol requeue {target}` timed out after {timeout:.0f}s"
    if proc.returncode != 0:
        return False, f"`scontrol requeue {target}` failed (exit {proc.returncode}): " \
                      f"{(proc.stderr or proc.stdout).strip()[:300]}"
    return True, f"`scontrol requeue {target}` accepted"


def job_running(job: str, timeout: float = 10.0) -> bool | None:
    """Whether SLURM still runs ``job`` (pending, running, completing, suspended...). False once it has ended or SLURM no
    longer knows it; None when SLURM cannot be asked (no squeue, slurmctld down): the caller must not conclude."""
    try:
        proc = run(["squeue", "-h", "-j", job, "-o", "%T"], timeout)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return False if "Invalid job id" in (proc.stderr + proc.stdout) else None
    states = proc.stdout.split()
    return bool(states) and any(s not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                                          "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE") for s in states)
