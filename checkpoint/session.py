"""A training run's checkpointing behind one door: ``Session`` owns the run directory's lease (one writer), the stop
policy (when), the manager (how saves and loads run) and the places. The manager never decides *when*; the policy never
touches bytes; the caller never sees either.

A training loop makes six calls, in this order, on every rank (a call out of order raises, naming the order):

    session = Session(settings, rank, agree=...)      # refusals first: backend combination, places
    preview = session.prepare()                       # a restart's read starts in the background; rank 0: writable
    session.take(before_force=...)                    # rank 0: the lease; a live holder is fenced only with force
    loaded = session.load(state, check=..., records=...)  # leftovers swept, settings.resume loaded, check(loaded)
    loop = session.start(reseed=..., ensure_logged=..., describe=...)  # stop signals now mean "save, then stop"
    each step: loop.begin_step(), loop.before_update() before optimizer.step(), loop.end_step(), then
               ``if session.step_boundary(step, describe): break``
    ending = session.close(step, run_seconds=...)     # every save committed; requeue; the lease released

What a call tells the caller comes back in its result (``Preview``, ``Loaded``, ``Loop``, ``Ending``); the lower
layers (manager, places, policy) stay behind the door.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from . import fsio, knobs, layout, lease as run_lease, storage
from .backends import RankInfo, check_combination, make_backend
from .errors import CheckpointError
from .jit import JustInTime, NoJIT
from .manager import CheckpointManager, SaveRecord
from .places.first import RunFolder
from .places.mirror import Mirror
from .naming import setting
from .places.nodelocal import NodeLocal
from .places import Places
from .logs import EVERY_RANK
from .policy import FINISHED, INTERVAL, NONE, REQUEUE_FAILED, REQUEUED, STOPPED, SignalWatcher, step_boundary
from .reader import section_reader
from .retention import Retention
from .settings import PLACES_RECORD, Settings
from .state import CheckpointState, RunInfo, unwrap_model

_log = logging.getLogger(__name__)

#: what ``close`` reports when the run must not count as a success
FENCED, FINAL_SAVE_FAILED = "fenced", "final-save-failed"


class Outcome:
    """How a run ends (``Ending.outcome``): the stop policy's outcomes, and the two that must not report success."""

    FINISHED, REQUEUED, STOPPED, REQUEUE_FAILED = FINISHED, REQUEUED, STOPPED, REQUEUE_FAILED
    FENCED, FINAL_SAVE_FAILED = FENCED, FINAL_SAVE_FAILED


def _say(line: str) -> None:
    """A warning or error line from any rank, to stderr (what a batch log shows beside the progress)."""
    print(line, file=sys.stderr, flush=True)

#: the calls in their order, each with the one it follows (``step_boundary`` repeats within ``start``)
_FOLLOWS = {"prepare": (None,), "take": ("prepare",), "load": ("take",), "start": ("load",), "close": ("start",)}


@dataclass(frozen=True)
class Found:
    """What a resume would load: its step and the run_info saved with it (read, not verified: the load verifies)."""

    step: int
    saved: RunInfo


class Preview:
    """What a start knows before its load: where the run lives, and what ``settings.resume`` would find there. ``card``
    and ``found`` are read when first asked (the card once; ``found`` each time: a live run may commit meanwhile)."""

    def __init__(self, session: "Session"):
        self._session = session
        self.root = session.root
        #: the background read of the resume, or None: to wait on it where nothing sets up meanwhile (tests, benchmarks)
        self.reading: storage.ReadAhead | None = session._read_ahead
        #: where files that stay on local disk may go (loss CSV, traces): the run folder; None on object storage
        self.log_dir: Path | None = session.root if session.filesystem else None

    @functools.cached_property
    def card(self) -> dict | None:
        """The card of the checkpoint the load would take (e.g. its shard list), or None."""
        spec = self._session.settings.resume
        return self._session._peek_card(spec) if spec else None

    @property
    def found(self) -> Found | None:
        spec = self._session.settings.resume
        return self._session._peek(spec) if spec else None

    def held(self) -> int:
        """Bytes of checkpoint state the read-ahead holds parsed now, which the load will hand to training (about)."""
        return self._session._verified_ahead.nbytes


@dataclass
class Loaded:
    """What ``load`` restored: ``step`` (None: a fresh start), its ``info`` (the manifest holds the card), the load's
    seconds, and ``history``: this run's saves, appended as they land (the summary's and the trackers' figures)."""

    step: int | None = None
    info: layout.CheckpointInfo | None = None
    seconds: float = 0.0
    history: list[SaveRecord] = field(default_factory=list)
    scheduled: bool = False  # ``step`` is one the save schedule saves (a stop's save of another step is not)
    source: str = ""  # where the load took it from, in words ("the local tier", ...; "": the run folder)


class Loop:
    """The hooks of one training step (``Session.start``): the phases a just-in-time save needs to know, the wait for
    a save still copying the state before ``optimizer.step()``, and an evaluation's chance to give way to a stop."""

    def __init__(self, manager: CheckpointManager, policy, jit: NoJIT):
        self._manager, self._policy, self._jit = manager, policy, jit

    def begin_step(self) -> None:
        """From here until the optimizer step, the last completed step's state is intact (jit.py)."""
        self._jit.begin_step()

    def before_update(self) -> None:
        """Right before ``optimizer.step()``: an asynchronous save still copying the weights must finish first."""
        self._manager.wait_staged()
        self._jit.begin_optimizer()

    def end_step(self) -> None:
        self._jit.end_step()

    def rescue(self, error: BaseException) -> bool:
        """A step raised ``error``: True if it was a peer's failure and this rank's last completed step is saved (the
        caller exits for a requeue); False: the caller re-raises."""
        return self._jit.save_if_survivor(error)

    def interrupt(self, before_eval: bool = False) -> bool:
        """Between an evaluation's batches, on every rank as often: True when it must give way to a stop (a signal,
        the walltime, fenced; agreed like a step boundary), which the next boundary then saves."""
        return self._policy.interrupt(before_eval)

    def observe_eval(self, seconds: float) -> None:
        """A whole evaluation's duration, which the walltime rule counts before the next one starts."""
        self._policy.observe_eval(seconds)


@dataclass(frozen=True)
class Ending:
    """How ``close`` ended the run: ``outcome`` FINISHED, REQUEUED, STOPPED or REQUEUE_FAILED (policy.py); FENCED or
    FINAL_SAVE_FAILED, with ``line`` to say, when it must not report success; None when the caller said it failed.
    ``summary``: the checkpointing's figures for the log."""

    outcome: str | None
    line: str
    summary: str


class Session:
    def __init__(self, settings: Settings, rank: RankInfo, *, agree: Callable[[float], float],
                 signals: SignalWatcher | None = None, started: float | None = None,
                 down: Callable[[], bool] | None = None):
        """Refuse, in one line (CheckpointError), what cannot work with these settings (no file is touched: see
        ``prepare``). ``agree(x)``: the maximum of ``x`` over all ranks (an all-reduce; identity for one
        process)."""
        s = settings
        self.places = Places.of(s)  # where this run's steps live (places/), each place refused here if it cannot work
        check_combination(s.backend, sharded=s.sharded, checkpoint_dir=s.checkpoint_dir, async_save=s.async_save,
                          jit=s.jit, local_tier=self.places.local is not None)
        self.settings, self.rank, self.agree, self.signals, self.started = s, rank, agree, signals, started
        self.down = down  # () -> whether a peer of this group failed (in-process recovery): a save stops waiting
        self.root = self.places.shared.root
        self.filesystem = storage.medium(self.root).filesystem  # the lease and local logs need one
        self.backend = make_backend(s.backend, rank, **s.backend_options)
        self.lease: run_lease.Lease | None = None  # rank 0 after take(); every rank after open() when there is one
        self.manager: CheckpointManager | None = None
        self.policy = None
        self.state: CheckpointState | None = None
        self._saved_at: int | None = None
        self._failed_at: int | None = None  # --on-save-error continue: the final checkpoint must still exist
        self._read_ahead: storage.ReadAhead | None = None  # a restart's step folder, read while setting up
        self._verified_ahead = layout.VerifiedAhead()  # ... and verified and parsed there, for the load to take
        self._phase: str | None = None  # the last of the caller's calls (_FOLLOWS)

    def _enter(self, call: str) -> None:
        """The calls come in one order (the module's docstring); another is a bug in the caller, said as such."""
        if self._phase not in _FOLLOWS[call]:
            did = f"after {self._phase}()" if self._phase else "first"
            raise RuntimeError(f"Session.{call}() called {did}: the order is prepare, take, load, start, "
                               "step_boundary at each step, close")
        self._phase = call

    # --- the caller's calls --------------------------------------------------------------------------------------
    def prepare(self, *, dry_run: bool = False) -> Preview:
        """Before the load, on every rank: a restart's read of ``settings.resume`` starts in the background (it
        overlaps the caller's setup until the load). Nothing is written (``take`` makes the run folder). ``dry_run``:
        nothing is read ahead either; whether the run folder could be made and written is judged from the nearest
        folder that exists (object storage: its probe, a small object written and deleted)."""
        self._enter("prepare")
        if dry_run:
            self._judge_writable()
        else:
            self._start_read_ahead(self.settings.resume)
        return Preview(self)

    def load(self, state: CheckpointState, *, check: Callable[[Loaded], None] = lambda loaded: None,
             records: dict[str, bytes] | None = None) -> Loaded:
        """Sweep what crashed incarnations left, restore ``state`` from ``settings.resume`` (None: start fresh), then
        ``check(loaded)``: the caller's refusal of what was loaded (flags, data, a probe), while nothing has moved.
        A load that fails calls ``check(Loaded())`` before it raises: what the caller refuses of the run_info, which
        loads first, explains the failure best. Either refusal releases the lease (nothing changed: the next start
        need not wait). Then newer checkpoints of a line the run no longer follows are retired, the mirror starts, the
        stop policy is set up, and rank 0 writes ``records`` (name -> bytes) into the run folder: a record that cannot
        be written is a warning (the card holds the same facts)."""
        self._enter("load")
        wrapped = getattr(state.get("model"), "wrapped", None)  # a ModelState's module (a test may save another kind)
        model = unwrap_model(wrapped) if wrapped is not None else None
        if model is not None and "train_state" in state:  # test-only (knobs.py): a rank dies at a given step
            progress = state["train_state"]  # not the state: the hook outlives it (and its model's wrapper)
            knobs.install_crash_hook(model, self.rank.rank, lambda: progress.step)
        try:
            try:
                step = self._restore(self.settings.resume, state)
            except Exception:
                check(Loaded())
                raise
            if step is not None and model is not None:
                knobs.swap_after_load(model)  # test-only: a wrong load that passes every checksum
            loaded = Loaded(step, self.manager.loaded, self.manager.load_seconds, self.manager.history,
                            source=self.manager.loaded_from)
            check(loaded)
        except BaseException:
            self._release()
            raise
        self._follow(step)
        loaded.scheduled = step is not None and self.policy.interval.due(step)
        self._write_records({**(records or {}), PLACES_RECORD: self.settings.places_record()})
        return loaded

    def start(self, *, reseed: Callable[[int], None] = lambda rank: None,
              ensure_logged: Callable[[int], None] = lambda step: None,
              describe: Callable[[int], dict] = lambda step: {}) -> Loop:
        """Right before the loop: from now on a stop signal means 'save at the next step boundary and stop'. Returns
        the step's hooks. With ``settings.jit`` they save the last completed step when a peer fails (jit.py), using
        ``reseed(rank)``, ``ensure_logged(step)`` and ``describe(step)`` (that step's manifest meta)."""
        self._enter("start")
        self.policy.start()
        jit = NoJIT()
        if self.settings.jit:
            _log.info(f"jit: just-in-time checkpointing on (rank {self.rank.rank})", extra=EVERY_RANK)
            jit = JustInTime(self.manager, self.state, reseed=reseed, ensure_logged=ensure_logged, describe=describe)
        return Loop(self.manager, self.policy, jit)

    # --- the run directory ---------------------------------------------------------------------------------------
    def _check_writable(self) -> None:
        if self.rank.is_main:
            layout.ensure_writable(self.root)

    def _judge_writable(self) -> None:
        """Whether the run folder could be made and written, without making it: the nearest folder that exists must
        be one this user may write into. Object storage: its probe (a small object, deleted)."""
        if not self.filesystem:
            self._check_writable()
            return
        existing = next(p for p in (self.root, *self.root.parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            what = "is not a folder" if not existing.is_dir() else "is not writable for this user"
            raise CheckpointError(f"checkpoint directory {self.root} cannot be written: {existing} {what}; fix its "
                                  f"permissions or give {setting('checkpoint_dir')} a writable folder")

    def take(self, before_force: Callable[[], None] = lambda: None) -> None:
        """Rank 0: the run folder, made if missing and checked writable (a folder that cannot be written fails now,
        not at the first save hours from now), and its lease (checkpoint/lease.py; none on object storage). A live
        holder is fenced only with ``force_takeover``, and only after ``before_force()`` passed: what could still
        refuse this start (a start refused after fencing would leave nothing running). Every rank calls it."""
        self._enter("take")
        self._check_writable()
        if not self.rank.is_main or not self.filesystem:
            return
        try:
            self.lease = run_lease.acquire(self.root)  # fences nothing that is alive
        except run_lease.LeaseHeld:
            if not self.settings.force_takeover:
                raise
            before_force()
            self.lease = run_lease.acquire(self.root, force=True)

    def _roots(self) -> list:
        """Where `latest` is looked for: the run folder, then the mirror's."""
        return [p.root for p in self.places.whole_steps]

    def _peek(self, spec: str) -> Found | None:
        """Read-only: the step ``spec`` resolves to now and the run_info saved with it, or None (nothing to resume)."""
        if spec == "latest":
            info = layout.resolve_latest(self._roots(), quiet=True)
        else:
            info = layout.resolve(self.root, spec, quiet=True)
        if info is None:
            return None
        saved = RunInfo()
        try:
            saved.load_state_dict(section_reader(info.manifest["backend"])(info.path, info.manifest, "run_info"))
        except (OSError, KeyError, ValueError, TypeError) as e:  # e.g. removed meanwhile by the live run's retention
            raise CheckpointError(f"{info.path}: cannot read its run_info ({e}); nothing was taken over") from None
        return Found(info.step, saved)

    def _peek_card(self, spec: str) -> dict | None:
        """The card of the checkpoint ``spec`` would load, read but not verified (the load verifies it), or None: for
        what must be known before the state exists (e.g. the dataset's shard list). A location that cannot be read now
        is the load's to report, in its words."""
        try:
            for step_dir in self._step_dirs(spec):
                try:
                    card = layout.read_manifest(step_dir).get("meta", {}).get("card", {})
                except CheckpointError:
                    continue  # the load skips it too, or names the problem
                return card if isinstance(card, dict) else None  # a malformed card: the load names it
        except (OSError, CheckpointError):
            pass
        return None

    def _step_dirs(self, spec: str) -> list:
        """The step folders ``spec`` may load, newest first, unverified: for `latest` every committed one under the
        run folder and the mirror's (on a tie the run folder's first, as resolve_latest); else the one it names."""
        if spec != "latest":
            return [layout.spec_dir(self.root, spec)]
        found = sorted((i for r in self._roots() for i in layout.list_checkpoints(r) if i.committed),
                       key=lambda i: i.step, reverse=True)  # stable: equal steps keep the roots' order
        return [i.path for i in found]

    def _start_read_ahead(self, spec: str | None) -> storage.ReadAhead | None:
        """Start reading, in the background, what this rank's load of ``spec`` will most likely read, so a restart's
        read overlaps its setup until ``open``: the newest committed step as listed now (`latest`: this rank's part
        in its node-local tier if that holds the step or a newer one, as the load then takes that copy), or the step
        or folder asked for. From a filesystem into the page cache; from object storage into memory. Each file read
        whole is then verified against the manifest and parsed as the load parses it (layout.VerifiedAhead), so the
        load takes it without reading it again, if its own manifest lists the same checksum. PYRECOVER_READ_AHEAD=off
        turns it off. Returns the read-ahead started, if any."""
        self._end_read_ahead(quiet=True)
        if not spec or knobs.read_ahead_disabled():
            return None
        try:
            for where in self._roots() + ([] if spec == "latest" or spec.isdigit() else [spec]):
                storage.medium(where).connect()  # a client and its imports on this thread, not the reader's
            records: dict[str, tuple[dict, str]] = {}  # what each planned file must verify against
            self._verified_ahead = verified = layout.VerifiedAhead()  # this read-ahead's alone
            parse = self.backend.parse_file  # none for DCP: its load plans its own reads
            self._read_ahead = storage.ReadAhead(
                lambda: self._read_ahead_plan(spec, records),
                then=(lambda path: self._verify_ahead(verified, path, *records[str(path)], parse)) if parse else None)
        except CheckpointError:
            return None  # e.g. no S3 client library: the load says so, in its words
        except RuntimeError as e:  # no thread to be had (a process limit): the load reads it all, as before
            _log.debug(f"read-ahead not started: {e}")
        return self._read_ahead

    def _read_ahead_plan(self, spec: str, records: dict) -> tuple[str, list[tuple[Path, int]]] | None:
        """(the step folder, [(file, size)]) the read-ahead reads, and into ``records`` what each must verify
        against; on its own thread (listing and a manifest take time on shared storage too). It imports nothing: an
        import on a second thread can meet the main thread's imports in the interpreter's import locks."""
        step_dirs = self._step_dirs(spec)
        shared = layout.read_manifest(step_dirs[0]) if step_dirs and self._readable(step_dirs[0]) else None
        if spec == "latest" and self.places.local is not None:  # the load takes a local copy of that step or newer
            parts = NodeLocal.read_ahead(self.places.local, self.rank.rank, shared["step"] if shared is not None else 0)
            if (own := next(parts, None)) is not None:  # this rank's part, then its node leader's shared pieces
                planned = self._plan_files(*own, records)
                for part in parts if planned is not None else ():
                    theirs = self._plan_files(*part, records)
                    planned[1].extend(theirs[1] if theirs is not None else [])
                return planned
        if shared is None:
            return None
        return self._plan_files(step_dirs[0], shared, self.backend.files_read(shared, self.rank.rank), records)

    @staticmethod
    def _readable(step_dir) -> bool:
        # a linked step folder is never loaded (layout.resolve, list_checkpoints): nothing is read through it
        return not storage.is_link(step_dir) and step_dir.is_dir()

    def _plan_files(self, step_dir, manifest: dict, names: list[str], records: dict):
        if manifest["backend"] != self.backend.name:  # another backend's format: its module is not imported here
            return None
        files = [(layout.member(step_dir, n, manifest), manifest["files"][n]) for n in names]
        records.update({str(path): (record, manifest["checksum"]) for path, record in files})
        return str(step_dir), [(path, int(record["size"])) for path, record in files]

    @staticmethod
    def _verify_ahead(verified: layout.VerifiedAhead, path, record: dict, algorithm: str, parse: Callable) -> None:
        """A file the read-ahead read whole, verified and parsed now, on its thread (layout.VerifiedAhead)."""
        try:
            verified.check(path, record, algorithm, parse)
        except (OSError, CheckpointError):
            pass  # the load reads it again, and says what is wrong

    def _end_read_ahead(self, quiet: bool = False) -> storage.ReadAhead | None:
        ahead, self._read_ahead = self._read_ahead, None
        if ahead is not None:
            read = ahead.stop()
            if ahead.label and not quiet:
                parsed = f", {len(self._verified_ahead)} files verified and parsed" if len(self._verified_ahead) else ""
                _log.info(f"read ahead {read / fsio.MiB:.1f} of {ahead.nbytes / fsio.MiB:.1f} MiB of {ahead.label} "
                          f"while setting up{parsed}")
            if quiet:
                ahead.release()
                self._verified_ahead = layout.VerifiedAhead()  # a thread left behind keeps the one it fills
        return ahead

    def _restore(self, spec: str | None, state: CheckpointState) -> int | None:
        """Sweep what crashed incarnations left, then restore ``state`` from ``spec`` (`latest`, a step, a path; None:
        start fresh). Returns the step (None: nothing loaded). Nothing the run committed has moved yet."""
        ahead = self._end_read_ahead()
        # what the read-ahead verified, once its thread is done with it (one left behind by stop() is not trusted)
        verified = self._verified_ahead if ahead is not None and ahead.ended else None
        try:
            return self._open(spec, state, verified)
        finally:
            if verified is not None:
                verified.clear()  # what the load did not take is not held for the run
            self._verified_ahead = layout.VerifiedAhead()
            if ahead is not None:
                ahead.release()

    def _open(self, spec: str | None, state: CheckpointState, ahead: layout.VerifiedAhead | None) -> int | None:
        s, main = self.settings, self.rank.is_main
        # One id per incarnation (part records, staging folder) and the lease's generation (fencing), on every rank.
        run_id = self.rank.from_main([uuid.uuid4().hex[:12], self.lease.generation if self.lease else 0,
                                      run_lease.lineage(self.root) if self.filesystem else ""] if main else None)
        if self.lease is None and run_id[1]:
            self.lease = run_lease.Lease(self.root, run_id[1])
        if self.lease is not None and main:
            self.lease.start_heartbeat()
        retention = Retention(s.keep, s.keep_every, s.keep_best)
        # The places' machinery: where saves land first, and the copies of the run folder's steps (rank 0's)
        first = NodeLocal.of(s, self.rank, self.places, lineage=run_id[2], run_id=run_id[0], generation=run_id[1],
                             spares=self.backend.reuses_files) if self.places.local is not None else RunFolder()
        copies = [Mirror(place.root, run_id=run_id[0], every=s.mirror_every, timeout_s=s.mirror_timeout_s,
                         retention=retention if s.mirror_keep is None else replace(retention, keep=s.mirror_keep))
                  for place in self.places.copies] if main else []
        self.manager = CheckpointManager(self.root, self.backend, self.rank, run_id=run_id[0], retention=retention,
                                         lease=self.lease, down=self.down, first=first, copies=copies)
        self.state = state
        return self.manager.open(spec, state, ahead)

    def _follow(self, step: int | None) -> None:
        """Continue from ``step`` (None: from scratch): newer checkpoints of a line the run no longer follows are
        retired, so a later `latest` cannot jump back to them; the mirror starts; the stop policy is set up."""
        self.manager.follow(step, keep_files=self.settings.keep_files)
        main = self.rank.is_main
        self.policy = step_boundary(self.settings.when, rank=self.rank.rank, agree=self.agree, signals=self.signals,
                                    save_history=self.manager.history, start=self.started,
                                    fenced=(lambda: self.manager.fenced) if main else None,
                                    local_every=self.settings.local_every if self.places.local is not None else 0)

    def _write_records(self, records: dict[str, bytes]) -> None:
        """Rank 0: small files of the run's own in the run folder, each written atomically."""
        if not self.rank.is_main:
            return
        for name, data in records.items():
            try:
                storage.write_bytes(self.root / name, data)
            except OSError as e:  # a record, not state: a failing disk stops the next save anyway
                _say(f"warning: could not write {self.root / name} ({e.strerror or e}); training continues")

    def _release(self) -> None:
        """Rank 0: the next start takes the run directory over without asking."""
        if self.lease is not None and self.rank.is_main:
            self.lease.release()

    # --- the loop ------------------------------------------------------------------------------------------------
    def step_boundary(self, step: int, describe: Callable[[bool], dict]) -> bool:
        """Save if it is time (intervals, signals, walltime: one small all-reduce, the same decision on every rank);
        ``describe(rushed)`` gives the checkpoint's manifest meta (its card); ``rushed``: a stop (signal, SIGTERM,
        walltime) whose grace time belongs to the save, so nothing slow goes into the card. True: stop now -- saved
        just above, by every rank at this step; ``close`` waits until it has committed."""
        if self._phase != "start":
            raise RuntimeError(f"Session.step_boundary() called after {self._phase}(): it comes between start() and "
                               "close()")
        decision = self.policy(step)
        try:
            self.manager.poll()  # surface background save errors at a step boundary
            if decision.save:
                rushed = decision.vote not in (NONE, INTERVAL)
                meta = describe(rushed)
                # a stop agreed while the card's evaluation ran (it gave way): this save is the stop's
                decision = self.policy.stop_now(step) or decision
            if decision.save:
                self.manager.save(step, self.state, meta=meta, shared=decision.shared, peer=decision.peer)
                self._saved_at = step
        except run_lease.Fenced:
            pass  # a newer incarnation owns the run directory: the policy's next vote stops every rank, saving nothing
        except CheckpointError as e:  # e.g. disk full
            self._save_failed(e, step)
        return decision.stop

    def _save_failed(self, error: CheckpointError, step: int) -> None:
        if self.settings.on_save_error == "stop":
            raise error
        _say(f"warning: {error}; training continues ({setting('on_save_error', 'continue')}), the next save retries")
        self._failed_at = step

    def abandon(self) -> None:
        """After this generation's process group failed (a peer died or raised), on every rank that lives: this
        incarnation ends without another collective. Saves in flight are not waited for: one still running commits
        nothing once the next generation holds the lease (fenced), and the next load sweeps its staging folder; rank 0
        releases the lease, so the next generation takes the run folder at once. A later call of this object raises."""
        self._phase = "abandon"
        if self.manager is not None:
            self.manager.leave()
        self._release()
        self.state = self.manager = self.policy = None  # the model's wrapper, and its group, are not held here

    # --- the end -------------------------------------------------------------------------------------------------
    def close(self, step: int, *, succeeded: bool = True, run_seconds: float = 0.0) -> Ending:
        """Wait until every save has committed; then, unless the run must not report success (fenced, its final save
        lost, or ``succeeded`` False: the caller found it broken), requeue if the policy says so (rank 0), retire the
        local copies of a finished run, and release the lease. The same outcome on every rank."""
        self._enter("close")
        kind, line = self._commit_all(step) or (None, "")
        summary = self.manager.summary(run_seconds)
        if kind is not None or not succeeded:
            return Ending(kind, line, summary)
        outcome = self.policy.finish(step, self.settings.when.final_step)
        if outcome == FINISHED:
            self.manager.finished()  # the final step is in the shared tier: the local copies have done their job
        self._release()
        return Ending(outcome, "", summary)

    def _commit_all(self, step: int) -> tuple[str, str] | None:
        """(FENCED or FINAL_SAVE_FAILED, the line to say) when the run must not report success, else None."""
        try:
            self.manager.close()
        except run_lease.Fenced:
            pass  # the verdict below says so, on every rank
        except CheckpointError as e:
            self._save_failed(e, step)
        # One all-reduce, the worst on any rank: a newer incarnation took the run directory over (rank 0 knows), so
        # this one committed nothing since and must neither requeue nor report success; or a rank's final save failed
        # (--on-save-error continue), so no rank may report success and clear its local tier.
        failed = self._failed_at is not None and self._failed_at >= (self._saved_at or 0)
        verdict = self.agree(2.0 if self.manager.fenced else 1.0 if failed else 0.0)
        if verdict >= 2:
            why = self.lease.fenced_message if self.lease is not None else "taken over"
            return FENCED, f"error: stopped at step {step}: {why}"
        if verdict >= 1:
            where = f"at step {self._failed_at}" if failed else "on another rank"
            return FINAL_SAVE_FAILED, (f"error: training reached step {step} but its final checkpoint could not be "
                                       f"saved (save failed {where}); resume from `latest` repeats the steps since")
        return None
