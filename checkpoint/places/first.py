"""The place every save lands in first, and the committer it is handed.

The manager (checkpoint/manager.py) hands each save and each load of `latest` to its first place: the run folder itself
(``RunFolder``, here) or the node-local places (``nodelocal.NodeLocal``), which carry the steps the policy sends there
on to the run folder. A first place never reaches into the manager: ``attach`` hands it a ``Committer``, the manager's
side of a save (the run folder's step folder prepared on every rank, a part landed there and committed by rank 0, a
failure cleaned up, the lease's guard) and of a load (the whole-step places' `latest`, a step loaded from them, the
load recorded).

    manager.save  -> first.save   -> committer.prepare (every rank) ... backend writes ... committer.land
    manager.load  -> first.latest -> committer.resolve / newest / manifest ... committer.load ... committer.loaded
    manager.open / follow / poll / wait / close / finished -> the first place's own (its defaults: nothing to do)
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

from ..errors import CheckpointError
from ..state import CheckpointState

if TYPE_CHECKING:
    from .. import layout
    from ..backends import Backend, RankInfo


@dataclass
class SaveRecord:
    step: int
    blocking_s: float
    durable_s: float = 0.0
    mirror_s: float = 0.0  # until this checkpoint was also in the mirror (mirror.py; 0: not mirrored)
    shared_s: float = 0.0  # with a local tier: until it was committed in the shared tier too (0: local only)
    bytes: int = 0


class Committer(Protocol):
    """What a first place may ask of the run folder (the manager's side; every call on every rank unless noted)."""

    rank: RankInfo
    run_id: str  # this incarnation's: part records and staging folders carry it
    backend: Backend  # writes and loads this rank's payload
    root: Path  # the run folder (the shared tier)

    @property
    def generation(self) -> int | None:
        """The lease generation this incarnation writes under; None without a lease (object storage)."""

    # --- save ------------------------------------------------------------------------------------------------------
    def prepare(self, step: int) -> Path:
        """The run folder's staging folder for ``step``, made by rank 0 before any rank writes into it (a broadcast);
        a failure is raised on every rank, as one line."""

    def land(self, step: int, step_dir: Path, files: dict[str, dict], *, meta: dict | None, record: SaveRecord,
             t0: float, landed: Callable[[SaveRecord, float], None] | None = None) -> None:
        """This rank's ``files`` of ``step`` are durable in ``step_dir``: its part record; rank 0 then waits for every
        rank's, commits, publishes, hands the step to the copies (the mirror) and applies retention. ``landed(record,
        t0)`` once committed (None: the run folder's own record of a durable save). A failure goes to ``fail``."""

    def failed(self, step: int, step_dir: Path | None, e: OSError | CheckpointError, *,
               cleanup: Callable[[], object] | None = None, where: tuple = ()) -> CheckpointError:
        """After a failed save: the first place's ``cleanup``, ``step_dir`` (the run folder's, if the step was to land
        there) abandoned; the one-line error to raise (Fenced, and nothing cleaned up, when a newer incarnation owns the
        run folder). ``where``: (folder, setting) a failed write names, when not the run folder."""

    def abandon(self, step_dir: Path, e: OSError | CheckpointError) -> None:
        """This rank's part of the run folder's ``step_dir`` will not come (rank 0 removes the folder; another rank
        leaves a failure record), unless the run folder is no longer ours."""

    def fail(self, error: CheckpointError) -> None:
        """Raise the error of a save that failed in the background, unless it is Fenced: then the save is dropped
        (noted once) and the stop policy stops every rank."""

    def guard(self, what: str) -> None:
        """Raise Fenced if a newer incarnation owns the run folder (before every change a save makes)."""

    def in_flight(self, besides: int) -> set[int]:
        """The steps of the saves in flight, but ``besides``."""

    # --- load ------------------------------------------------------------------------------------------------------
    @property
    def ahead(self) -> layout.VerifiedAhead | None:
        """What a read-ahead verified and parsed, for this load alone."""

    def resolve(self, spec: str) -> layout.CheckpointInfo | None:
        """Rank 0 resolves ``spec`` over the whole-step places (`latest`: the run folder, then the mirror) and verifies
        it; the same answer everywhere."""

    def newest(self) -> int | None:
        """The newest committed step of the whole-step places, listed (not verified) by rank 0; the same everywhere."""

    def manifest(self, step: int) -> tuple[Path, dict] | None:
        """(folder, manifest) of ``step`` in the whole-step places, read by rank 0; the same everywhere."""

    def holds(self, step: int) -> bool:
        """The run folder holds ``step`` committed (rank 0 looks); the same everywhere."""

    def load(self, info: layout.CheckpointInfo, state: CheckpointState) -> None:
        """Restore ``state`` from this rank's files of ``info`` (a whole-step place's step, resolved)."""

    def loaded(self, info: layout.CheckpointInfo, t0: float, source: str = "") -> None:
        """Record the load: ``info`` as rank 0 sees it (the same on every rank), how long since ``t0``, ``source``: where
        the ranks' parts came from, when not all from ``info``."""


class FirstPlace(ABC):
    """Where a save lands first. ``save`` and ``latest`` are its own; the rest defaults to a place with nothing of its
    own to sweep, check, protect, wait for, retire or say."""

    committer: Committer

    def attach(self, committer: Committer) -> None:
        self.committer = committer

    @abstractmethod
    def save(self, step: int, state: CheckpointState, meta: dict | None, *, t0: float, shared: bool, peer: bool
             ) -> tuple:
        """Start writing this rank's part of ``step``. Returns (payload, finish, record): ``finish()`` completes the
        save once ``payload`` is written (the manager runs it, in the background or at once)."""

    @abstractmethod
    def latest(self, state: CheckpointState, t0: float) -> int | None:
        """Load the newest step every rank can load from its nearest place into ``state``; the step, or None."""

    def protected(self) -> set[int]:
        """The run folder's steps it still writes into (retention keeps them)."""
        return set()

    def recover(self, own_staging: str, *, fresh: bool) -> None:
        """What crashed incarnations left here; ``fresh``: the run starts from scratch."""

    def check_space(self, state: CheckpointState) -> None:
        """Pre-flight, before the loop: ``state`` fits here."""

    def follow(self, step: int) -> None:
        """The run continues from ``step``: what is newer belongs to a line it left."""

    def poll(self) -> None:
        """Surface errors of its background work, without blocking."""

    def wait(self) -> None:
        """Block until its background work is done; re-raise its first error."""

    def leave(self) -> None:
        """The process group failed (in-process recovery): background work that needs it stops at once."""

    def close(self) -> None:
        """The run ends: its background work stops (bounded)."""

    def finished(self) -> None:
        """The run's final step is in the run folder: nearer copies have done their job."""

    def summary(self) -> str:
        return ""


class RunFolder(FirstPlace):
    """The run folder as the first place: every rank writes its part of a save into the step's staging folder there,
    and rank 0 commits it (``Committer.land``). `latest` is the whole-step places' (``Committer.resolve``)."""

    def save(self, step: int, state: CheckpointState, meta: dict | None, *, t0: float, shared: bool, peer: bool):
        c = self.committer
        step_dir = c.prepare(step)
        try:
            payload = c.backend.save(step_dir, state)
        except (OSError, CheckpointError) as e:
            raise c.failed(step, step_dir, e) from None
        record = SaveRecord(step, blocking_s=time.perf_counter() - t0)

        def finish() -> None:
            try:
                files = payload.wait()
                record.bytes = sum(r["size"] for r in files.values())  # rank 0: every part's, once committed
                c.land(step, step_dir, files, meta=meta, record=record, t0=t0)
            except (OSError, CheckpointError) as e:
                c.fail(c.failed(step, step_dir, e))

        return payload, finish, record

    def latest(self, state: CheckpointState, t0: float) -> int | None:
        c = self.committer
        info = c.resolve("latest")
        if info is None:
            return None
        c.load(info, state)
        c.loaded(info, t0)
        return info.step
