"""CheckpointManager: the public face of the package — ``save`` / ``wait`` / ``load`` over the three layers.

    state (what)   -> CheckpointState of Stateful pieces          (state.py)
    backend (how)  -> writes this rank's payload files             (backends/)
    layout         -> part records, manifest, COMMITTED, latest    (layout.py)

Policy (when to call ``save``) lives in policy.py and train.py; the manager never decides that.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path
from typing import Callable

from . import layout, route, storage
from .backends import JIT_FORMAT, Backend, RankInfo, backend_class, loader_for
from .backends.base import BackgroundTask
from .errors import CheckpointError, GroupDown
from .fsio import MiB, is_disk_full
from .lease import Fenced, Lease
from .naming import setting
from .places.first import FirstPlace, RunFolder, SaveRecord
from .places.mirror import Mirror
from .retention import Retention
from .state import CheckpointState

_log = logging.getLogger(__name__)


class SaveHandle:
    """One save in flight. ``wait()`` returns when it is committed (on rank 0) / durable (other ranks), re-raising any
    error from the background."""

    def __init__(self, step: int, payload, task: BackgroundTask | None, record: SaveRecord):
        self.step = step
        self.payload = payload
        self._task = task
        self.record = record

    def done(self) -> bool:
        return self._task is None or self._task.done()

    def wait(self) -> None:
        if self._task is not None:
            self._task.wait()


class CheckpointManager:
    def __init__(
        self,
        root: Path,
        backend: Backend,
        rank: RankInfo,
        *,
        run_id: str,
        retention: Retention = Retention(),
        commit_timeout_s: float = 1800.0,
        lease: Lease | None = None,
        down: Callable[[], bool] | None = None,
        first: FirstPlace | None = None,
        copies: list[Mirror] = (),
    ):
        self.root = storage.as_path(root)  # a local Path or an s3:// S3Path
        self._writing = route.of(self.root)  # staged and published by rename, or in place
        self.backend = backend
        self.rank = rank
        self.run_id = run_id
        self._ahead: layout.VerifiedAhead | None = None  # what a read-ahead verified, during open() alone
        self.retention = retention
        self.commit_timeout_s = commit_timeout_s
        self.lease = lease  # one writer per run directory: None on object storage (no exclusive create there)
        self._down = down  # () -> whether a peer of this group has failed (in-process recovery): checked with the lease
        # Where every save lands first: the run folder itself, or the node-local places (places/nodelocal.py), which
        # carry it on to the run folder; it asks the run folder's side of a save and a load of the committer alone
        # (places/first.py). ``copies``: where committed steps of the run folder are copied (rank 0: the mirror).
        self.first = first if first is not None else RunFolder()
        self.first.attach(_Committer(self))
        self.copies = list(copies)
        for copy in self.copies:
            copy.guard = self._guard
        self._fenced_logged = False
        self.in_flight: deque[SaveHandle] = deque()
        self.history: list[SaveRecord] = []
        self.load_seconds = 0.0
        self.loaded: layout.CheckpointInfo | None = None  # what load() restored (its manifest holds the card)
        self.loaded_from = ""  # where load() took it from, in words ("" for the run folder itself)

    # --- save ----------------------------------------------------------------------------------------------------
    def save(self, step: int, state: CheckpointState, meta: dict | None = None, *, shared: bool = True,
             peer: bool = True) -> SaveHandle:
        """Start saving ``state`` as ``step``. Returns once the state is captured; the backend decides whether the bytes
        land before (vanilla) or after (async backends) this returns. Raises errors of earlier background saves.
        ``meta``: what rank 0 records in the manifest (the checkpoint's card). The save lands in the first place
        (``self.first``); with node-local places, ``shared``: it is then drained to the shared tier in the background
        (else it stays local only); ``peer``: with a peer copy, it is also sent to the next node (not needed for the
        save a run ends with: the shared tier has it)."""
        self._reap(block_until_below=self.backend.max_in_flight)
        t0 = time.perf_counter()
        payload, finish, record = self.first.save(step, state, meta, t0=t0, shared=shared, peer=peer)
        if payload.done():  # it may also have failed already (a writer that failed at once): raised here, then
            try:
                finish()
            except Exception:
                self._drain()  # as in _reap: the saves still in flight commit before the error propagates
                raise
            handle = SaveHandle(step, payload, None, record)
        else:
            handle = SaveHandle(step, payload, BackgroundTask(finish, name=f"ckpt-commit-{step}"), record)
        self.history.append(record)
        self.in_flight.append(handle)
        return handle

    def _land(self, step: int, step_dir: Path, files: dict[str, dict], *, meta: dict | None, record: SaveRecord,
              t0: float, landed: Callable[[SaveRecord, float], None] | None = None) -> None:
        """This rank's files of ``step`` are durable in ``step_dir`` (the run folder's staging): its part record; rank 0
        then waits for every rank's, commits, publishes, hands the checkpoint to the copies (the mirror) and applies
        retention. ``landed(record, t0)`` once committed (None: ``_durable``, a save that landed here first). Runs in
        the thread that wrote them (the save's, or the local tier's drainer)."""
        try:
            layout.write_part_record(step_dir, self.rank.rank, files, run_id=self.run_id)
            if self.rank.is_main:
                parts = layout.wait_for_part_records(step_dir, self.rank.world_size, self.commit_timeout_s,
                                                     self.run_id, guard=self._guard)
                self._guard(f"commit step {step}")
                layout.commit(step_dir, step, self.rank.world_size, self.backend.name, parts, meta=meta)
                published = self._writing.publish(step_dir, self.root, step, guard=self._guard, tag=self.run_id)
                record.bytes = sum(r["size"] for p in parts for r in p["files"].values())
        except (OSError, CheckpointError) as e:
            self._fail(self._save_failed(step, step_dir, e))
            return
        (landed or self._durable)(record, t0)
        if self.rank.is_main:
            # list(): a C-level copy, atomic under the GIL; iterating the deque itself from this background thread
            # races with the training thread appending/reaping ("deque mutated during iteration").
            in_flight = {h.step for h in list(self.in_flight) if h.step != step} | (self.first.protected() - {step})
            for copy in self.copies:  # before retention, which must keep what a copy will still read
                copy.submit(step, published, record)
                in_flight |= copy.protected()
            try:
                self.retention.apply(self.root, in_flight=in_flight, guard=self._guard,
                                     own_staging=step_dir.parent.name)
            except Fenced as e:
                self._note_fenced(e)

    def save_alone(self, step: int, pieces: dict[str, dict], *, meta: dict) -> Path:
        """Save ``pieces`` (file name -> state dict) as ``step`` from this rank alone, without the process group: the
        just-in-time save after a peer failed (jit.py). Written in the vanilla format for the run's world size,
        committed and published like any other save; a valid ``step-N`` committed meanwhile is kept."""
        staging = self._staging / f"jit-rank-{self.rank.rank:05d}" / layout.step_dir_name(step)
        self._prepare_step_dir(staging)
        files = backend_class(JIT_FORMAT).write_pieces(staging, pieces, self.rank.rank)
        layout.write_part_record(staging, self.rank.rank, files, run_id=self.run_id)
        layout.commit(staging, step, self.rank.world_size, JIT_FORMAT, [{"files": files}], meta=meta)
        return layout.publish(staging, self.root, step, guard=self._guard, tag=f"{self.run_id}-jit",
                              replace_valid=False)

    @property
    def jit_folder(self) -> Path:
        """Where the surviving ranks of this incarnation elect the one that saves just in time (inside its staging
        folder: the next incarnation sweeps it with the rest)."""
        return self._staging / "jit"

    @property
    def _staging(self) -> Path:
        """This incarnation's staging folder (holds one step-N folder per save in flight)."""
        return layout.staging_dir(self.root, self.run_id, 0).parent

    def _guard(self, what: str) -> None:
        """Raise Fenced if a newer incarnation owns the run directory (checked before every change to it), GroupDown
        if a peer of this process group failed (rank 0 waiting for a dead rank's part gives up at once)."""
        if self._down is not None and self._down():
            raise GroupDown(f"{what}: a peer of this process group failed")
        if self.lease is not None:
            self.lease.check(what)

    def _fail(self, error: CheckpointError) -> None:
        """Raise the error of a failed save, unless it is Fenced: then the save is dropped (noted once)."""
        if isinstance(error, Fenced):  # e.g. the new owner swept our staging folder mid-write
            self._note_fenced(error)
            return
        raise error from None

    def _note_fenced(self, e: Fenced) -> None:
        """A fenced save is not an error of this run: it is dropped (its staging folder is the new owner's to sweep),
        and the stop policy's vote (``fenced``) stops every rank at the next step boundary."""
        if not self._fenced_logged:
            self._fenced_logged = True
            _log.warning(f"warning: {e}")

    @property
    def fenced(self) -> bool:
        return self.lease is not None and self.lease.fenced()

    def _prepare_everywhere(self, step: int, step_dir: Path) -> None:
        """Rank 0 makes the shared tier's folder for ``step``; every rank learns it did (a broadcast: no rank writes
        into it before), or gets its failure as one line."""
        failed = None
        if self.rank.is_main:
            try:
                self._prepare_step_dir(step_dir)
            except (OSError, CheckpointError) as e:
                failed = self._save_failed(step, step_dir, e)
        failed = self.rank.from_main(failed)
        if failed is not None:
            raise failed

    def _prepare_step_dir(self, step_dir: Path) -> None:
        self._guard("start a save")
        self._writing.prepare(step_dir)

    def _save_failed(self, step: int, step_dir: Path | None, e: OSError | CheckpointError, *,
                     cleanup: Callable[[], object] | None = None, where: tuple = ()) -> CheckpointError:
        """Clean up after a failed save; the one-line error to raise (Fenced if a newer incarnation took over: then the
        failure is a consequence of that, and nothing is cleaned up -- the run directory is no longer ours).
        ``cleanup``: the first place's own (a node-local staging folder); ``step_dir``: the run folder's staging
        folder, if the step was to land there, where the other ranks must learn that this part will not come;
        ``where``: (folder, flag) a failed write names, when not the run folder."""
        if isinstance(e, Fenced):
            return e
        if self.fenced:
            return Fenced(self.lease.fenced_message)
        if cleanup is not None:
            cleanup()
        if step_dir is not None:
            self._abandon(step_dir, e)
        if not isinstance(e, OSError):
            return e
        return self._io_error(step, e, *where)

    def _abandon(self, step_dir: Path, e: OSError | CheckpointError) -> None:
        """A save failed on this rank. Rank 0 removes the uncommitted folder (a full disk gets its space back for the next
        attempt); another rank leaves a failure record so rank 0 stops waiting for its part at once. Best effort."""
        try:
            if self.rank.is_main:
                self._writing.discard(step_dir)
            else:
                layout.write_part_record(step_dir, self.rank.rank, {}, run_id=self.run_id, error=str(getattr(e, "strerror", None) or e))
        except OSError:
            pass

    def _io_error(self, step: int, e: OSError, where=None, setting_name: str = "checkpoint_dir") -> CheckpointError:
        where = where or self.root
        if is_disk_full(e):
            return CheckpointError(
                f"saving step {step} to {where} failed: no space left on device; free space or point "
                f"{setting(setting_name)} elsewhere (the previous checkpoint is intact)"
            )
        return CheckpointError(f"saving step {step} to {where} failed: {e.strerror or e} ({e.filename or ''})")

    def _reap(self, block_until_below: int) -> None:
        """Collect finished saves (re-raising their errors); block while too many are in flight.

        With several saves in flight a later one can fail while an earlier one is still writing: it is reported now,
        not after the earlier ones finish. Before any error propagates, the other saves in flight are waited for, so
        they still commit and the process never exits under a half-written save it could have finished."""
        try:
            while True:
                for h in [h for h in self.in_flight if h.done()]:  # any order: a later save's error is raised now
                    self._wait_and_forget(h)
                if len(self.in_flight) < block_until_below:
                    return
                time.sleep(0.01)  # until any save finishes, not just the oldest: one that failed must not wait
        except Exception:
            self._drain()
            raise

    def _wait_and_forget(self, h: SaveHandle) -> None:
        """Wait for ``h``, then drop it from ``in_flight`` -- in that order: a later save committing in the background
        meanwhile runs retention, which must still see ``h`` as in flight (else its folder is deleted as a stale
        partial while it is being written)."""
        try:
            h.wait()
        finally:
            try:
                self.in_flight.remove(h)
            except ValueError:
                pass

    def _drain(self) -> None:
        if self.in_flight:
            _log.info(f"waiting for {len(self.in_flight)} other checkpoint save(s) in flight before stopping")
        while self.in_flight:
            try:
                self._wait_and_forget(self.in_flight[0])
            except Exception as e:  # noqa: BLE001 - the first error is the one raised; later ones are logged
                _log.warning(f"warning: {e}")

    def wait_staged(self) -> None:
        """Block until every in-flight save has captured its state. train.py calls this right before
        ``optimizer.step()``: async backends copy the state while forward/backward of the next step runs, and only
        the optimizer's in-place update would change what they are copying."""
        for h in self.in_flight:
            t0 = time.perf_counter()
            try:
                h.payload.wait_staged()
            except OSError as e:
                raise self._io_error(h.step, e) from None
            h.record.blocking_s += time.perf_counter() - t0

    def poll(self) -> None:
        """Surface background errors at a step boundary without blocking."""
        self._reap(block_until_below=1 << 30)
        self.first.poll()

    def wait(self) -> None:
        """Block until every save in flight is committed (and drained to the shared tier, if it was to be); re-raise
        the first error."""
        self._reap(block_until_below=1)
        self.first.wait()

    def _durable(self, r: SaveRecord, t0: float) -> None:
        r.durable_s = time.perf_counter() - t0
        self._log_save(r)

    def _log_save(self, r: SaveRecord) -> None:
        rate = r.bytes / MiB / r.durable_s if r.durable_s > 0 else 0.0
        where = "committed" if self.rank.is_main else "written"
        if self.rank.is_main:
            _log.info(
                f"checkpoint step {r.step} {where}: {r.bytes / MiB:.1f} MiB, blocked {r.blocking_s:.2f}s, "
                f"durable after {r.durable_s:.2f}s ({rate:.0f} MiB/s)"
            )

    # --- load ----------------------------------------------------------------------------------------------------
    def resolve(self, spec: str) -> layout.CheckpointInfo | None:
        """Rank 0 resolves a step or path, or `latest` over the places that hold whole steps (the run folder, then
        the mirror: the newest valid step, the run folder's on a tie), and verifies it; every rank gets the same
        answer."""
        result = None
        if self.rank.is_main:
            try:
                if spec == "latest":
                    result = layout.resolve_latest(self._roots(), keep=True, ahead=self._ahead)
                    if result is not None and result.path.parent != self.root:
                        _log.info(f"resume: the primary {self.root} has no valid checkpoint at or after step "
                                  f"{result.step}; using the mirror's {result.path}")
                else:
                    result = layout.resolve(self.root, spec, keep=True, ahead=self._ahead)
            except CheckpointError as e:
                result = e
        result = self.rank.from_main(result)
        if isinstance(result, CheckpointError):
            raise result
        return result

    def load(self, spec: str, state: CheckpointState) -> int | None:
        """Restore ``state`` from `latest`, a step number or a path. Returns the step, or None if `latest` found none.
        `latest` is the newest step every rank can load from its nearest place: the first place chooses it (the run
        folder: ``resolve``; the node-local places: NodeLocal.latest, which resolves the run folder's the same way)."""
        t0 = time.perf_counter()
        if spec == "latest":
            return self.first.latest(state, t0)
        info = self.resolve(spec)
        if info is None:
            return None
        self._load_shared(info, state)
        self._loaded(info, t0)
        return info.step

    def _load_shared(self, info: layout.CheckpointInfo, state: CheckpointState) -> None:
        try:
            backend = loader_for(info.manifest, self.rank)
        except ValueError as e:
            raise CheckpointError(f"{info.path}: {e}") from None
        try:
            backend.load(info.path, info.manifest, state, verified=info.verified)
        finally:
            info.verified.clear()  # what the load did not take is not held for the rest of the run

    def _roots(self) -> list:
        """The places that hold whole steps, where `latest` is looked for: the run folder, then its copies."""
        return [self.root] + [copy.root for copy in self.copies]

    def _loaded(self, info: layout.CheckpointInfo, t0: float, source: str = "") -> None:
        self.load_seconds = time.perf_counter() - t0
        self.loaded, self.loaded_from = info, source
        size = info.size_bytes
        _log.info(
            f"resumed from {info.path} (step {info.step}, {info.manifest['backend']} backend"
            + (f"; {source}" if source else "")
            + f", {size / MiB:.1f} MiB in {self.load_seconds:.3f}s, {size / MiB / max(self.load_seconds, 1e-9):.0f} MiB/s)"
        )

    # An incarnation opens the run directory in two halves, so the caller can check what was loaded before anything
    # moves: ``open`` (sweep, load), then ``follow`` (retire the line it no longer follows).
    def open(self, spec: str | None, state: CheckpointState, ahead: layout.VerifiedAhead | None = None) -> int | None:
        """Clean up after crashed incarnations, then restore ``state`` from ``spec`` (None: start fresh). Nothing the
        run had committed moves yet: a caller refusing the loaded checkpoint leaves the folder as it found it.
        ``ahead``: what a read-ahead already verified and parsed (layout.VerifiedAhead), for this load alone."""
        if self.rank.is_main:
            if (line := storage.medium(self.root).describe(self.root)) is not None:
                _log.info(line)
            self._writing.recover(self.root, self._staging.name, self._guard, label="run directory", mine=False)
        for copy in self.copies:
            copy.recover()
        self.first.recover(self._staging.name, fresh=not spec)
        self._ahead = ahead
        try:
            step = self.load(spec, state) if spec else None
        finally:
            self._ahead = None
        self.first.check_space(state)
        return step

    def follow(self, step: int | None, *, keep_files: tuple[str, ...] = ()) -> None:
        """Continue the run from ``step`` (None: from scratch): checkpoints of a line it no longer follows are retired
        (with ``keep_files`` of the run folder), so a later `latest` cannot jump back to them; the mirror starts."""
        if self.rank.is_main:
            try:
                self._writing.retire_newer(self.root, step or 0, keep_files=keep_files, guard=self._guard)
            except OSError as e:
                raise CheckpointError(f"cannot move the abandoned line's checkpoints aside under {self.root}: "
                                      f"{e.strerror or e}") from None
        self.first.follow(step or 0)
        for copy in self.copies:
            copy.start(step or 0, self.root)

    def finished(self) -> None:
        """The run ended with its final step committed here: the nearer places' copies have done their job."""
        self.first.finished()

    # --- summary -------------------------------------------------------------------------------------------------
    def summary(self, run_seconds: float) -> str:
        blocked = sum(r.blocking_s for r in self.history)
        total_bytes = sum(r.bytes for r in self.history)
        pct = 100.0 * blocked / run_seconds if run_seconds > 0 else 0.0
        return (
            f"checkpointing: {len(self.history)} saves, {total_bytes / MiB:.1f} MiB, training blocked {blocked:.2f}s "
            f"({pct:.1f}% of {run_seconds:.1f}s), load {self.load_seconds:.2f}s"
        ) + "".join(f"\n{line}" for line in [c.summary() for c in self.copies] + [self.first.summary()] if line)

    def leave(self) -> None:
        """The process group failed (in-process recovery): saves in flight are not waited for, and background work
        that needs the group (a peer copy) stops at once."""
        self.in_flight.clear()
        self.first.leave()

    def close(self) -> None:
        """Wait for every save in flight (re-raising the first error), then release the backend's resources -- those
        also after an error, which the caller may survive (--on-save-error continue)."""
        try:
            self.wait()
        finally:
            self.first.close()
            for copy in self.copies:  # the final checkpoint reaches the mirror before a clean exit (bounded wait)
                copy.close()
            self.backend.close()
            if self.rank.is_main:
                self._writing.close(self.root, self._staging.name)


class _Committer:
    """The manager's side of a first place's save and load (places/first.py, Committer): the run folder's commit,
    its guard, and the whole-step places' `latest`."""

    def __init__(self, manager: CheckpointManager):
        self._m = manager
        self.rank, self.run_id, self.backend, self.root = manager.rank, manager.run_id, manager.backend, manager.root

    @property
    def generation(self) -> int | None:
        return self._m.lease.generation if self._m.lease is not None else None

    # --- save ----------------------------------------------------------------------------------------------------
    def prepare(self, step: int) -> Path:
        step_dir = self._m._writing.save_dir(self.root, self.run_id, step)
        self._m._prepare_everywhere(step, step_dir)
        return step_dir

    def land(self, step: int, step_dir: Path, files: dict[str, dict], *, meta: dict | None, record: SaveRecord,
             t0: float, landed: Callable[[SaveRecord, float], None] | None = None) -> None:
        self._m._land(step, step_dir, files, meta=meta, record=record, t0=t0, landed=landed)

    def failed(self, step: int, step_dir: Path | None, e: OSError | CheckpointError, *,
               cleanup: Callable[[], object] | None = None, where: tuple = ()) -> CheckpointError:
        return self._m._save_failed(step, step_dir, e, cleanup=cleanup, where=where)

    def abandon(self, step_dir: Path, e: OSError | CheckpointError) -> None:
        if not isinstance(e, Fenced) and not self._m.fenced:
            self._m._abandon(step_dir, e)

    def fail(self, error: CheckpointError) -> None:
        self._m._fail(error)

    def guard(self, what: str) -> None:
        self._m._guard(what)

    def in_flight(self, besides: int) -> set[int]:
        # list(): a C-level copy, atomic under the GIL (the training thread appends and reaps meanwhile)
        return {h.step for h in list(self._m.in_flight) if h.step != besides}

    # --- load ----------------------------------------------------------------------------------------------------
    @property
    def ahead(self) -> layout.VerifiedAhead | None:
        return self._m._ahead

    def resolve(self, spec: str) -> layout.CheckpointInfo | None:
        return self._m.resolve(spec)

    def newest(self) -> int | None:
        return self.rank.from_main(max((i.step for r in self._m._roots() for i in layout.list_checkpoints(r)
                                        if i.committed), default=None) if self.rank.is_main else None)

    def manifest(self, step: int) -> tuple[Path, dict] | None:
        """Its payload is not read: a local copy that matches its records is the run's bytes (LocalTier.usable). A
        manifest that cannot be read is said once, and taken for none."""
        found, unreadable = None, []
        if self.rank.is_main:
            for root in self._m._roots():
                step_dir = storage.as_path(root) / layout.step_dir_name(step)
                try:
                    if storage.is_link(step_dir) or not (step_dir / layout.COMMITTED).exists():
                        continue  # a linked step folder is never read (list_checkpoints)
                    found = (step_dir, layout.read_manifest(step_dir))
                    break
                except CheckpointError as e:
                    unreadable.append(str(e))
                except OSError as e:  # e.g. an object store that does not answer
                    unreadable.append(f"{step_dir}: {e.strerror or e}")
            if found is None and unreadable:
                _log.warning(f"warning: cannot read the shared tier's manifest of step {step} ({unreadable[0]}); the "
                             f"local copies of step {step} are checked against their own manifests only")
        return self.rank.from_main(found)

    def holds(self, step: int) -> bool:
        return self.rank.from_main((self.root / layout.step_dir_name(step) / layout.COMMITTED).exists()
                                   if self.rank.is_main else None)

    def load(self, info: layout.CheckpointInfo, state: CheckpointState) -> None:
        self._m._load_shared(info, state)

    def loaded(self, info: layout.CheckpointInfo, t0: float, source: str = "") -> None:
        self._m._loaded(info, t0, source)
