"""The node-local places as the place every save lands in first: this node's tier (tier.py) and, with
``--peer-checkpoint``, the copy of its steps on the buddy node (peer.py).

A save commits in the local tier; two ordered promoters (promoter.py) carry it on: the peer copy to the buddy node, and
the drainer to the shared tier for the steps the policy sends there (manager._land commits it there, as any save). A
restart loads the newest step every rank can load from its nearest place (``latest``).

The manager's other first place is the run folder itself (manager.RunFolder): both answer the same calls (``save``,
``latest``, ``recover``, ``follow``, ``poll``, ``wait``, ``close``, ...), so the manager never asks which it has.
"""

from __future__ import annotations

import logging
import time

from .. import layout, storage
from ..errors import CheckpointError
from ..fsio import MiB
from ..lease import Fenced
from ..manager import CheckpointManager, SaveRecord
from ..state import CheckpointState
from .peer import PeerCopy
from .tier import FORKS, Drainer, LocalTier, everywhere, part_bytes, read_forks, record_resume

_log = logging.getLogger(__name__)


class NodeLocal:
    """This rank's node-local places. ``attach`` hands it the manager whose run folder is the shared tier."""

    def __init__(self, tier: LocalTier, peer: PeerCopy | None):
        self.tier, self.peer = tier, peer
        self.m: CheckpointManager | None = None
        self._drainer: Drainer | None = None

    def attach(self, manager: CheckpointManager) -> None:
        self.m = manager
        self._drainer = Drainer(self.tier, self._land_drained, self._drain_failed)

    # --- save ----------------------------------------------------------------------------------------------------
    def save(self, step: int, state: CheckpointState, meta: dict | None, *, t0: float, shared: bool, peer: bool):
        """Write this rank's part of ``step`` into the local tier; ``shared``: drain it to the shared tier once
        committed here; ``peer``: send it to the buddy node too. Returns (payload, finish, record) for the manager."""
        m, tier = self.m, self.tier
        if shared:
            self._drainer.wait()  # one drain at a time: a shared tier slower than its interval stalls, never piles up
        step_dir = m._writing.save_dir(m.root, m.run_id, step) if shared else None
        if step_dir is not None:
            m._prepare_everywhere(step, step_dir)
        local_dir = None  # the local tier's staging folder, once it exists (only that one is the tier's to discard)
        to_peer = self.peer is not None and peer

        def failed(e: OSError | CheckpointError) -> CheckpointError:
            if to_peer:
                self.peer.submit(step, None)  # the buddy, which saved this step, hears it will not come
            return m._save_failed(step, step_dir, e, where=(tier.root.parent.parent, "local_dir"),
                                  cleanup=lambda: local_dir is not None and tier.discard(local_dir))

        try:  # fenced: the local publish refuses (its guard), as the shared commit does
            local_dir = tier.save_dir(m.run_id, step)
            tier.check_space(lambda: part_bytes(state, tier.writes_shared))
            # the node leader writes the shared pieces, and retired local files are overwritten
            payload = m.backend.save(local_dir, state, shared=tier.writes_shared, spares=tier.spares)
        except (OSError, CheckpointError) as e:
            raise failed(e) from None
        record = SaveRecord(step, blocking_s=time.perf_counter() - t0)

        def finish() -> None:
            try:
                files = payload.wait()
                published = tier.commit(local_dir, step, files, backend=m.backend.name, run_id=m.run_id,
                                         meta=meta or {}, guard=m._guard)
            except (OSError, CheckpointError) as e:
                m._fail(failed(e))
                return
            record.bytes = sum(r["size"] for r in files.values())
            record.durable_s = time.perf_counter() - t0
            if m.rank.is_main:
                _log.info(f"checkpoint step {step} committed in the local tier: {record.bytes / MiB:.1f} MiB, blocked "
                          f"{record.blocking_s:.2f}s, durable after {record.durable_s:.2f}s"
                          + ("; draining to the shared tier" if step_dir is not None else ""))
            if step_dir is not None:
                self._drainer.submit(step, step_dir, meta=meta, record=record, t0=t0)
            if to_peer:
                self.peer.submit(step, published)
            try:
                tier.retain(self._drainer.protected() | {h.step for h in list(m.in_flight) if h.step != step}
                            | (self.peer.protected() if self.peer is not None else set()),
                            m._guard, own_staging=local_dir.parent.name)
            except Fenced as e:
                m._note_fenced(e)

        return payload, finish, record

    def _land_drained(self, step: int, step_dir, files: dict, **land_args) -> None:
        self.m._land(step, step_dir, files, landed=self._drained, **land_args)

    def _drain_failed(self, step_dir, e: OSError | CheckpointError) -> None:
        """This rank's copy from the local tier failed: the shared tier's folder is abandoned, unless the run directory
        is no longer ours."""
        if not isinstance(e, Fenced) and not self.m.fenced:
            self.m._abandon(step_dir, e)

    def _drained(self, record, t0: float) -> None:
        record.shared_s = time.perf_counter() - t0
        if self.m.rank.is_main:
            _log.info(f"checkpoint step {record.step} committed in the shared tier {self.m.root}, drained from the "
                      f"local tier ({record.shared_s:.2f}s after the save began)")

    def protected(self) -> set[int]:
        """The shared tier's steps still being drained into (its retention keeps them)."""
        return self._drainer.protected()

    # --- load ----------------------------------------------------------------------------------------------------
    def latest(self, state: CheckpointState, t0: float) -> int | None:
        """The newest step that every rank holds locally (in its node's tier, or restored from a peer's copy) wins if
        the shared tier has nothing newer committed; otherwise the shared tier's `latest`, which each rank still loads
        from its local tier if it holds that step. Only the chosen step is verified: a local copy that fails is
        removed, and the choice is made again without it (with the peer copies too: PeerCopy.restore, older than the
        refused step; a peer copy that fails is likewise never the end of the choice). When the shared tier holds the
        chosen step, a local copy
        must also match its manifest (LocalTier.usable), else that rank loads the shared copy. A step restored only
        from local tiers is then drained to the shared tier, so losing a node right after loses nothing."""
        m, rank = self.m, self.m.rank
        # the run's resumes, from its folder: a local part of a line the run has left is no candidate
        forks = rank.from_main(read_forks(m.root / FORKS, self.tier.identity["lineage"])
                               if rank.is_main and m.lease is not None else [])
        local = self.tier.committed(forks)
        newest_shared = rank.from_main(max((i.step for r in m._roots() for i in layout.list_checkpoints(r)
                                            if i.committed), default=None) if rank.is_main else None)
        shared: list = []  # the shared tier's `latest`, resolved (and verified on rank 0) at most once
        peers: list[int] = []  # ranks whose part came from a copy on another node (peer.py)
        if self.peer is not None:
            floor = max((s for s in (everywhere(local, rank.gather), newest_shared) if s is not None), default=None)
            peers = self.peer.restore(local, floor, forks)
        while True:
            best_local = everywhere(local, rank.gather)
            info = None
            if newest_shared is not None and (best_local is None or newest_shared > best_local):
                shared = shared or [m.resolve("latest")]  # perhaps an older one; the same answer everywhere
                info = shared[0]
            if info is not None and (best_local is None or info.step >= best_local):
                step = info.step  # from the shared tier, but a rank holding it locally loads that copy
            elif best_local is not None:
                step, info = best_local, None
            else:
                return None
            mine = local.get(step)
            found = (info.path, info.manifest) if info is not None else self._shared_manifest(step)
            if mine is not None and not self.tier.usable(mine, found[1] if found is not None else None, m._ahead):
                del local[step]
                mine = None
            everyone = all(rank.gather(mine is not None))
            if not everyone and info is None and found is not None:  # a local copy refused: the shared one, verified
                try:
                    info = m.resolve(str(found[0]))
                except CheckpointError:
                    pass  # no copy of this step: choose again, where the shared `latest` names what is wrong with it
            # a rank without the step loads the shared copy; without one, every rank must hold it (else choose again)
            if info is not None or everyone:
                break
            if self.peer is not None:  # a part refused: the peer copies may still give every rank a step older than it
                floor = max((s for s in (everywhere(local, rank.gather), newest_shared) if s is not None), default=None)
                peers = sorted(set(peers) | set(self.peer.restore(local, floor, forks, below=step)))
        if mine is not None:
            self.tier.load(mine, state)
        else:
            m._load_shared(info, state)
        here = rank.gather(mine is not None)
        from_peer = sum(1 for r in peers if here[r])
        # What was loaded, as rank 0 sees it, on every rank (its card: the resume checks agree across ranks)
        m._loaded(rank.from_main(mine or info), t0, source=f"{sum(here)} of {len(here)} ranks from their local "
                  "tier" + (f" ({from_peer} from a peer copy)" if from_peer else "")
                  + (f", {len(here) - sum(here)} from the shared tier" if not all(here) else ""))
        for held in [info] + list(local.values()):
            if held is not None:
                held.verified.clear()  # what the load did not take is not held for the rest of the run
        if info is None:
            self._drain_restored(step, m.loaded.manifest.get("meta", {}))
        return step

    def _shared_manifest(self, step: int) -> tuple | None:
        """(folder, manifest) of ``step`` in the shared tier (the run folder, else the mirror's), read by rank 0, the
        same on every rank; None where neither holds it committed. Its payload is not read: a local copy that matches
        its records is the run's bytes (LocalTier.usable)."""
        m = self.m
        found, unreadable = None, []
        if m.rank.is_main:
            for root in m._roots():
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
        return m.rank.from_main(found)

    def _drain_restored(self, step: int, meta: dict) -> None:
        """A step restored from the local tiers alone goes to the shared tier now (in the background), unless it is
        there already."""
        m = self.m
        there = m.rank.from_main((m.root / layout.step_dir_name(step) / layout.COMMITTED).exists()
                                 if m.rank.is_main else None)
        if there:
            return
        step_dir = m._writing.save_dir(m.root, m.run_id, step)
        m._prepare_everywhere(step, step_dir)
        meta = {k: v for k, v in meta.items() if k != "tier"}
        self._drainer.submit(step, step_dir, meta=meta, record=SaveRecord(step, 0.0), t0=time.perf_counter())

    # --- an incarnation's life -----------------------------------------------------------------------------------
    def recover(self, own_staging: str, *, fresh: bool) -> None:
        """What crashed incarnations left; ``fresh``: the run starts from scratch, and nothing local belongs to it."""
        self.tier.recover(own_staging)
        if fresh:
            self.finished()

    def check_space(self, state: CheckpointState) -> None:
        """Pre-flight: the local tier holds what is known of the state now."""
        self.tier.check_space(lambda: part_bytes(state, self.tier.writes_shared), first_save=False)

    def follow(self, step: int) -> None:
        """The run continues from ``step``: newer local steps belong to a line it left, and the resume is recorded in
        the run folder (the local parts on nodes this job does not reach)."""
        m = self.m
        self.tier.retire_newer(step)
        if m.rank.is_main and m.lease is not None:
            try:
                record_resume(m.root, self.tier.identity["lineage"], m.lease.generation, step)
            except OSError as e:
                raise CheckpointError(f"cannot record the resume in {m.root / FORKS}: {e.strerror or e}") from None
        if self.peer is not None:
            self.peer.retire_newer(step)

    def poll(self) -> None:
        self._drainer.poll()

    def wait(self) -> None:
        self._drainer.wait()

    def close(self) -> None:
        self._drainer.close()
        if self.peer is not None:  # the last local step reaches the buddy too (bounded wait)
            self.peer.close()

    def finished(self) -> None:
        """The run's final step is in the shared tier (or the run starts afresh): the local copies have done their
        job."""
        self.tier.clear()
        if self.peer is not None:
            self.peer.clear()

    def summary(self) -> str:
        return self.peer.summary() if self.peer is not None else ""
