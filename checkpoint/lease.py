"""One writer per run directory: an ownership lease with a generation number that fences stale incarnations.

    <run>/.owner/gen-00000001.json    one file per incarnation that took the run over, never deleted
    <run>/.owner/gen-00000002.json    the highest generation is the owner

Taking over = creating ``gen-<g+1>`` with ``link(2)`` from a complete temporary file: link fails with EEXIST if the name
exists, atomically, on local filesystems and on NFS/Lustre/GPFS alike (the classic NFS lock-file idiom; ``flock`` is not
reliable there). Two starts racing for the same generation: exactly one wins, the other re-reads and is refused.

Fencing: an incarnation holding generation g is *fenced* as soon as ``gen-<g+1>`` exists, or as soon as its own
``gen-<g>`` is gone or is not its own any more: every record carries a random token, and the holder compares it. A
generation number alone cannot tell: if ``.owner`` is deleted, the next start finds no lease and takes generation 1
again, perhaps the very number the holder has. Every commit, step-folder replacement, retirement and retention sweep
checks that first (a ``stat`` and a read of one small file), and so do the heartbeat and rank 0 at every step boundary,
so a stale incarnation -- the ranks of a partitioned node still running after SLURM requeued the job, a SIGSTOPped job
that is continued, a run whose ``.owner`` was deleted -- can never change the run directory once a newer one has taken
over. It says so and stops (train.py exits with code 6). What is relied on: atomic ``link`` with EEXIST, and that a
file created by one node is visible to a ``stat`` on another afterwards (close-to-open consistency). A check and the
change it guards are not one atomic operation: a stale writer stopped exactly between them could still make that one
change when continued; it cannot make a second one.

Who may take over a run directory (checked in this order; anything else is refused in one line naming the holder):
  * nobody holds it, or the holder released it (a run that ended, however it ended, if its process could clean up);
  * ``--force-takeover``;
  * the requeued incarnation of the same SLURM job (same ``SLURM_JOB_ID``): the old one is fenced;
  * the holder's process is gone (same host, its pid no longer runs, or runs another program);
  * the holder's SLURM job has ended (``squeue`` says so): a job array's next task, a resubmitted job;
  * the holder's heartbeat (the file's mtime, touched every ``HEARTBEAT_S``) is older than ``TIMEOUT_S``: a holder on
    another host that died without SLURM (clocks must agree to within that margin, as munge already requires).

Tests shorten both through ``PYRECOVER_LEASE_HEARTBEAT_S`` (default 10 s) and ``PYRECOVER_LEASE_TIMEOUT_S`` (default
120 s), read once at import (knobs.py).
"""

from __future__ import annotations

import logging
import errno
import json
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from . import knobs, slurm
from .errors import CheckpointError
from .fsio import fsync_dir, make_dirs
from .naming import setting

_log = logging.getLogger(__name__)

OWNER_DIR = ".owner"
_GEN_RE = re.compile(r"^gen-(\d{8,})\.json$")
HEARTBEAT_S = knobs.lease_heartbeat_s()
TIMEOUT_S = knobs.lease_timeout_s()


class Fenced(CheckpointError):
    """A newer incarnation owns the run directory; this one must not change it."""


class LeaseHeld(CheckpointError):
    """Another live run owns the run directory."""


def _gen_name(gen: int) -> str:
    return f"gen-{gen:08d}.json"


def _proc_start(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (field 22 of /proc/PID/stat): tells a reused pid from the original."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else fields[19]  # a zombie has exited


def identity(environ: Mapping[str, str] = os.environ) -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _proc_start(os.getpid()),
            "slurm_job_id": slurm.job_id(environ), "slurm_restart_count": slurm.restart_count(environ),
            "started_unix": time.time()}


def describe(holder: dict) -> str:
    job = f", SLURM job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return f"generation {holder.get('generation')} (host {holder.get('host')}, pid {holder.get('pid')}{job})"


@dataclass
class Lease:
    """This incarnation's claim on ``root``. Rank 0 acquires it (``acquire``); the other ranks build one from the
    broadcast generation (``Lease(root, gen)``, which reads the record's token) for the same fencing checks."""

    root: Path
    generation: int
    holder: dict | None = None
    token: str | None = None  # the holder's record's token; other ranks read it from the record when they start
    _fenced_why: str = ""
    _stop: threading.Event = field(default_factory=threading.Event)  # ends the heartbeat

    def __post_init__(self) -> None:
        if self.token is None and self.generation:
            self.token = (self.holder or _read(self.dir / _gen_name(self.generation)) or {}).get("token")

    @property
    def dir(self) -> Path:
        return Path(self.root) / OWNER_DIR

    def fenced(self) -> bool:
        """True once a newer incarnation has taken over, or this one's record is gone or another's (sticky)."""
        if not self._fenced_why and self.generation:
            self._fenced_why = self._lost()
        return bool(self._fenced_why)

    def _lost(self) -> str:
        """Why this incarnation no longer holds the run directory ("" while it does)."""
        newer = self.dir / _gen_name(self.generation + 1)
        if newer.exists():
            return f"was taken over by {describe(_read(newer) or {'generation': self.generation + 1})}"
        if self.token is None:  # a rank that could not read the record at start: the generation is all it knows
            return ""
        ours = self.dir / _gen_name(self.generation)
        record = _read(ours)
        if record is not None and record.get("token") == self.token:
            return ""
        gens = generations(self.dir)
        now = _read(self.dir / _gen_name(gens[-1])) if gens else None
        holder = f"; {describe(now)} holds it now" if now else ""
        return f"lost its lease: {OWNER_DIR}/{ours.name} was deleted or replaced while this run held it{holder}"

    def check(self, what: str) -> None:
        """Raise Fenced unless this incarnation still owns the run directory; ``what`` names the change refused."""
        if self.fenced():
            raise Fenced(f"{self.fenced_message} (refused: {what})")

    @property
    def fenced_message(self) -> str:
        return (f"{self.root} {self._fenced_why}; this incarnation (generation {self.generation}) is fenced: it "
                "stops without changing the run directory")

    # --- rank 0 ------------------------------------------------------------------------------------------------------
    def start_heartbeat(self, period: float = HEARTBEAT_S) -> None:
        """Touch our generation file every ``period`` s (liveness for other hosts) and notice a takeover early."""
        path = self.dir / _gen_name(self.generation)

        def beat() -> None:
            while not self._stop.wait(period):
                if self.fenced():
                    return
                try:
                    os.utime(path)
                except OSError:
                    pass

        threading.Thread(target=beat, name="lease-heartbeat", daemon=True).start()

    def release(self) -> None:
        """Mark the lease released (the next start takes over without questions). Not if fenced: it is not ours."""
        self._stop.set()
        if self.holder is None or self.fenced():
            return
        try:
            _publish(self.dir / _gen_name(self.generation), {**self.holder, "released_unix": time.time()}, replace=True)
        except OSError:
            pass


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _publish(path: Path, record: dict, *, replace: bool = False) -> None:
    """Write ``record`` complete under a temporary name, then link (exclusive) or rename (replace) it into place."""
    tmp = path.with_name(f".tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    try:
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # EEXIST if another start won this generation
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                _create_exclusive(path, record)  # a filesystem without hard links
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def _create_exclusive(path: Path, record: dict) -> None:
    """O_CREAT|O_EXCL, then the content: a reader may briefly see it empty, which counts as a live holder."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        os.write(fd, json.dumps(record).encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def lineage(root: Path) -> str:
    """The token of the oldest generation record under ``root``: the same for every incarnation of a run directory,
    new when the directory (or its ``.owner``) was deleted and a run started anew ("" without a lease). The node-local
    tier (tier.py) tells its own steps from a dead run's by it."""
    owner = Path(root) / OWNER_DIR
    gens = generations(owner)
    return str((_read(owner / _gen_name(gens[0])) or {}).get("token", "")) if gens else ""


def generations(owner_dir: Path) -> list[int]:
    try:
        return sorted(int(m.group(1)) for m in map(_GEN_RE.match, os.listdir(owner_dir)) if m)
    except FileNotFoundError:
        return []


def _takeover_reason(holder: dict | None, mtime: float, me: dict, force: bool,
                     job_running: Callable[[str], bool | None]) -> str | None:
    """Why we may take over from ``holder`` (None: we may not)."""
    if holder is None:
        return "the previous holder's record is unreadable" if time.time() - mtime > TIMEOUT_S else None
    if holder.get("released_unix"):
        return ""
    if force:
        return f"{setting('force_takeover', True)} from {describe(holder)}"
    if holder.get("slurm_job_id") and holder.get("slurm_job_id") == me["slurm_job_id"]:
        return f"requeued SLURM job {me['slurm_job_id']} (restart {me['slurm_restart_count']}) fences {describe(holder)}"
    if holder.get("host") == me["host"] and _proc_start(int(holder.get("pid") or 0)) != holder.get("pid_start"):
        return f"{describe(holder)} is no longer running"
    if holder.get("slurm_job_id") and job_running(str(holder["slurm_job_id"])) is False:
        return f"SLURM job {holder['slurm_job_id']} of {describe(holder)} has ended"
    age = time.time() - mtime
    if age > TIMEOUT_S:
        return f"{describe(holder)} sent no heartbeat for {age:.0f}s"
    return None


def acquire(root: Path, *, force: bool = False, environ: Mapping[str, str] = os.environ,
            job_running: Callable[[str], bool | None] = slurm.job_running) -> Lease:
    """Take ``root`` over (rank 0, before anything in it is written), or raise LeaseHeld naming the live holder."""
    try:
        return _acquire(Path(root), force, environ, job_running)
    except OSError as e:
        raise CheckpointError(f"cannot take the run directory {root} over: {e.strerror or e} ({e.filename or root}); "
                              f"check its permissions or pass another {setting('checkpoint_dir')}") from None


def _acquire(root: Path, force: bool, environ: Mapping[str, str], job_running: Callable[[str], bool | None],
             ) -> Lease:
    owner_dir = Path(root) / OWNER_DIR
    make_dirs(owner_dir)
    me = identity(environ)
    for _ in range(100):  # each retry means another start won a generation in between: re-judge its holder
        gens = generations(owner_dir)
        current = gens[-1] if gens else 0
        if current:
            path = owner_dir / _gen_name(current)
            holder = _read(path)
            try:
                mtime = path.stat().st_mtime
            except FileNotFoundError:
                continue
            why = _takeover_reason(holder, mtime, me, force, job_running)
            if why is None:
                age = time.time() - mtime
                raise LeaseHeld(
                    f"{root} is in use by {describe(holder or {'generation': current})}, heartbeat {age:.0f}s ago: one "
                    f"writer per run directory; wait for it to finish, use another {setting('experiment')}, or pass "
                    f"{setting('force_takeover', True)} if that run is dead (it is then fenced)")
            if why:
                _log.info(f"run directory: taking over from {why}")
        record = {**me, "generation": current + 1, "token": uuid.uuid4().hex}
        try:
            _publish(owner_dir / _gen_name(current + 1), record)
        except FileExistsError:
            time.sleep(0.05)
            continue
        return Lease(Path(root), current + 1, holder=record)
    raise CheckpointError(f"{owner_dir}: could not take the run directory over (other starts kept winning)")
