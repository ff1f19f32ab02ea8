"""A second location for checkpoints (``--mirror-dir``): every committed checkpoint (or every K-th) is copied there in
the background, committed there by the same protocol, and verified there.

The main use: the primary on fast node-local disk, where a save stalls training least, and the mirror on the shared
filesystem or object storage, which outlives the node. The copy never blocks training and a failing mirror never stops
it: one warning when the mirror starts failing, retries, one line when it recovers, a summary at the end.

    primary step-N committed and published (manager.py)
      -> submit(N): the copier thread takes the newest step submitted (older ones still waiting are skipped)
      -> local mirror:  <mirror>/.staging-mirror-<run_id>/step-N/  every file copied atomically (tmp, fsync, rename),
                        each copy read back and checked against the primary's manifest, then manifest + COMMITTED
                        (layout.write_commit: the same bytes, the same marker), then layout.publish -> <mirror>/step-N
         s3:// mirror:  in place, an earlier attempt un-committed first (route.of), COMMITTED last
      -> retention on the mirror (--mirror-keep; never the newest committed one)

A SIGKILL mid-copy leaves a staging folder (local: swept by the next start, ``recover``) or an uncommitted folder (s3:
swept by the next start): never a committed partial checkpoint. `latest` looks in both
locations (``CheckpointManager.resolve``, the one resolver of the whole-step places); the newest valid checkpoint wins, the
primary on a tie.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from .. import layout, route, storage
from ..errors import CheckpointError
from ..fsio import MiB
from ..knobs import mirror_delay_s
from ..lease import Fenced
from ..naming import setting
from ..retention import Retention
from .promoter import NEWEST, Promoter

_log = logging.getLogger(__name__)

RETRIES = 3  # attempts per step before it counts as failed (a newer step submitted meanwhile ends them sooner)
BACKOFF_S = 1.0  # first pause between attempts; doubles after each


class Mirror:
    """Copies committed checkpoints of the primary ``CheckpointManager`` to ``root`` (rank 0 only).

    ``every``: mirror the steps that are multiples of it (the final checkpoint always, in ``close``). ``retention``:
    what the mirror keeps (the primary's, or --mirror-keep's newest K). ``timeout_s``: how long ``close`` waits for the
    final copy. ``guard`` (set by the manager): raises Fenced once a newer incarnation owns the
    run, checked before every change to the mirror."""

    def __init__(self, root, *, run_id: str, every: int = 1, retention: Retention = Retention(),
                 timeout_s: float = 600.0, retries: int = RETRIES, backoff_s: float = BACKOFF_S):
        self.root = storage.as_path(root)
        self._writing = route.of(self.root)  # staged and published by rename, or in place
        self.run_id = run_id
        self.every, self.retention = every, retention
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.guard: Callable[[str], None] = layout.no_guard
        self._lock = threading.Lock()
        self._newest: tuple | None = None  # the newest step the primary committed, mirrored or not
        self._promoter: Promoter | None = None  # shared -> mirror, the newest step only (promoter.py); from start()
        self._early: tuple | None = None  # a step committed before start() (a restored step drained at open)
        self._failing = False  # warned once; the next success says the mirror recovered
        self._fenced = False
        self.copied: list[int] = []
        self.failed: list[int] = []
        self.bytes = 0
        self.seconds = 0.0

    @property
    def _staging_name(self) -> str:
        return f"{layout.STAGING_PREFIX}mirror-{self.run_id}"

    # --- start ---------------------------------------------------------------------------------------------------
    def recover(self) -> None:
        """Before `latest` is resolved: what crashed copies left. Local: layout.recover (a copy committed in staging
        but not yet published is published; other staging folders go). Object storage: uncommitted step folders (a
        copy killed mid-way) go. Best effort: a failing mirror never stops the run."""
        try:
            self._writing.recover(self.root, self._staging_name, self.guard, label="mirror", mine=True)
        except Fenced:
            raise
        except (OSError, CheckpointError) as e:
            self._warn(f"cannot clean up the mirror {self.root} ({_why(e)})")

    def start(self, step: int, primary) -> None:
        """The run continues from ``step``: the mirror's checkpoints newer than it belong to a line the run left, and
        move to ``retired/`` as the primary's do (else a later `latest` would jump back to them). Then the copier
        thread starts, with the primary's ``step`` if the mirror lacks it (its copy was cut short by a crash)."""
        missing = None
        try:
            layout.retire_newer(self.root, step, guard=self.guard)
            src = storage.as_path(primary) / layout.step_dir_name(step)
            if step and not (self.root / src.name / layout.COMMITTED).exists() and (src / layout.COMMITTED).exists():
                missing = src
        except Fenced:
            raise
        except (OSError, CheckpointError) as e:
            self._warn(f"cannot move the mirror's checkpoints newer than step {step} aside ({_why(e)}); a later "
                       "resume from `latest` may pick them")
        with self._lock:
            self._promoter = Promoter("ckpt-mirror", self._run, mode=NEWEST)
            early, self._early = self._early, None
            if missing is not None:
                self._newest = (step, missing, None)
                self._queue(step, missing, None)
            elif early is not None:
                self._promoter.submit(*early)

    # --- copying -------------------------------------------------------------------------------------------------
    def protected(self) -> set[int]:
        """The primary's steps the copier may still read: the primary's retention keeps them."""
        with self._lock:
            if self._promoter is None:
                return {self._early[0]} if self._early is not None else set()
        return self._promoter.protected()

    def submit(self, step: int, src, record=None) -> None:
        """The primary committed ``step`` in ``src``: copy it if it is due (``every``). Never blocks: a due step still
        waiting is replaced by this newer one."""
        with self._lock:
            if self._newest is not None and step < self._newest[0]:
                return  # saves commit out of order (--max-async): the mirror follows the newest, never goes back
            self._newest = (step, src, record)
            if step % self.every == 0 and not self._fenced:
                self._queue(step, src, record)

    def _queue(self, step: int, src, record) -> None:
        job = (step, (src, record, time.perf_counter()))
        if self._promoter is None:
            self._early = job  # start() hands it on
        else:
            self._promoter.submit(*job)

    def _run(self, step: int, job: tuple) -> None:
        src, record, submitted = job
        try:
            self._copy_with_retries(step, src, record, submitted)
        except Exception as e:  # noqa: BLE001 - a bug here must not end mirroring unseen; training goes on
            _log.exception(f"warning: mirror: copying step {step} failed unexpectedly")
            self.failed.append(step)
            self._warn(f"copying step {step} failed ({type(e).__name__}: {e}); later checkpoints are still tried")

    def _copy_with_retries(self, step: int, src, record, submitted: float) -> None:
        delay = self.backoff_s
        for attempt in range(1, self.retries + 1):
            try:
                nbytes = self._copy(step, storage.as_path(src))
                self._retain()
            except Fenced:
                with self._lock:
                    self._fenced = True
                self._promoter.drop_waiting()
                return
            except (OSError, CheckpointError) as e:
                why = f"copying step {step} to the mirror {self.root} failed (attempt {attempt} of {self.retries}: " \
                      f"{_why(e)})"
                if not self._failing:
                    self._failing = True
                    self._warn(f"{why}; training continues, the copy is retried")
                else:
                    _log.debug(why)
                # wait before retrying, unless a newer step arrives: it replaces this one
                if attempt == self.retries or self._promoter.newer_waiting(delay):
                    break
                delay *= 2
                continue
            took = time.perf_counter() - submitted
            self.copied.append(step)
            self.bytes += nbytes
            self.seconds += took
            if record is not None:
                record.mirror_s = took  # the walltime stop counts it (policy.py)
            if self._failing:
                self._failing = False
                _log.info(f"mirror: step {step} copied to {self.root} after {attempt} attempt(s); the mirror works "
                          "again")
            else:
                _log.info(f"mirror: step {step} copied and verified in {self.root}: {nbytes / MiB:.1f} MiB in "
                          f"{took:.2f}s")
            return
        self.failed.append(step)

    def _copy(self, step: int, src) -> int:
        """Copy the committed checkpoint ``src`` as the mirror's step ``step``; every file read back and checked
        against the primary's manifest before COMMITTED. Returns the bytes copied."""
        raw = (src / layout.MANIFEST).read_bytes()
        manifest = layout.read_manifest(src)  # committed, and the manifest is the one its marker names
        dst = self._writing.save_dir(self.root, f"mirror-{self.run_id}", step)
        self.guard(f"mirror {dst.name}")
        self._writing.prepare(dst)
        algorithm = manifest["checksum"]
        delay = mirror_delay_s()
        pause = (lambda: time.sleep(delay)) if delay > 0 else None
        names = list(manifest["files"]) + [layout.part_record_name(r) for r in range(manifest["world_size"])]
        nbytes = 0
        for name in names:
            if pause is not None:
                pause()
            target = dst / name
            if "/" in name:
                target.parent.mkdir(parents=True, exist_ok=True)
            try:
                storage.copy_file(src / name, target)
            except FileNotFoundError:
                if name in manifest["files"]:
                    raise
                continue  # a part record is informational; the manifest lists the payload
            rec = manifest["files"].get(name)
            if rec is not None:
                size, digest = storage.checksum(target, algorithm)  # read back from the mirror: verified THERE
                if (size, digest) != (rec["size"], rec[algorithm]):
                    raise CheckpointError(f"{target} does not match the primary's manifest after the copy ({size} "
                                          f"bytes, {algorithm} {digest}; expected {rec['size']}, {rec[algorithm]})")
                nbytes += size
        self.guard(f"commit the mirror's {dst.name}")
        layout.write_commit(dst, raw)
        layout.read_manifest(dst)  # the marker just written names the manifest just written
        self._writing.publish(dst, self.root, step, guard=self.guard, tag=f"mirror-{self.run_id}")
        return nbytes

    def _retain(self) -> None:
        self.retention.apply(self.root, guard=self.guard, own_staging=self._staging_name, label="mirror retention")

    # --- end -----------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Mirror the newest committed checkpoint if it is not yet (the final one), then wait for the copier, at most
        ``timeout_s``. Never raises: what did not reach the mirror is said in one warning."""
        if self._promoter is None:
            return
        with self._lock:
            newest = self._newest
            if (newest is not None and not self._fenced and newest[0] not in self.copied
                    and not self._promoter.holds(newest[0])):
                self._queue(*newest)
        if not self._promoter.close(self.timeout_s):
            current = self._promoter.current
            left = current if current is not None else newest[0] if newest else "?"
            self._warn(f"the final copy to the mirror {self.root} did not finish within "
                       f"{setting('mirror_timeout_s', f'{self.timeout_s:g}s')} (step {left}); the primary holds it")
        else:
            self._writing.close(self.root, self._staging_name)

    def summary(self) -> str:
        last = max(self.copied) if self.copied else "none"
        skipped = self._promoter.skipped if self._promoter is not None else 0
        skipped = f", {skipped} skipped (a newer step came first)" if skipped else ""
        failed = f" (steps {', '.join(map(str, self.failed[-5:]))})" if self.failed else ""
        return (f"mirror: {len(self.copied)} copied, {len(self.failed)} failed{failed}{skipped}, last mirrored step "
                f"{last}, {self.bytes / MiB:.1f} MiB in {self.seconds:.1f}s to {self.root}")

    def _warn(self, what: str) -> None:
        _log.warning(f"warning: mirror: {what}")


def _why(e: BaseException) -> str:
    if isinstance(e, OSError):
        return f"{e.strerror or e}{f': {e.filename}' if e.filename else ''}"
    return str(e)
