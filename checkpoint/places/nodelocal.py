"""The node-local places as the place every save lands in first: this node's tier (tier.py) and, with
``--peer-checkpoint``, the copy of its steps on the buddy node (peer.py): a list of replicas (places.Replica), the
rank's own tier folder first, that this place iterates.

A save commits in the local tier; two ordered promoters (promoter.py) carry it on: the peer copy to the buddy node, and
the drainer to the shared tier for the steps the policy sends there (the committer lands it there, as any save). A
restart loads the newest step every rank can load from its nearest place (``latest``).

The manager's other first place is the run folder itself (first.RunFolder): both answer the same calls (``save``,
``latest``, ``recover``, ``follow``, ``poll``, ``wait``, ``close``, ...), so the manager never asks which it has; both
ask the run folder's side of a save or a load of the committer alone (first.Committer).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from .. import knobs, layout, slurm, storage
from ..backends import RankInfo
from ..backends.torchfile import rank_file
from ..errors import CheckpointError
from ..fsio import MiB
from ..lease import Fenced
from ..naming import setting
from ..state import CheckpointState
from . import Place, Places, Replica
from .first import Committer, FirstPlace, SaveRecord
from .peer import Link, PeerCopy, buddies
from .tier import FORKS, Drainer, LocalTier, everywhere, part_bytes, read_forks, record_resume

if TYPE_CHECKING:
    from ..settings import Settings

_log = logging.getLogger(__name__)


class NodeLocal(FirstPlace):
    """This rank's node-local places: ``tier``, its folder in its node's tier, where its saves commit, and the replicas
    of its steps, the tier first (then the peer copy, if any). ``attach`` hands it the committer of the run folder,
    which is the shared tier."""

    def __init__(self, tier: LocalTier, copies: list[Replica] = ()):
        self.tier = tier
        self.replicas: list[Replica] = [tier, *copies]
        self._drainer: Drainer | None = None

    @classmethod
    def of(cls, s: Settings, rank: RankInfo, places: Places, *, lineage: str, run_id: str, generation: int,
           spares: bool) -> NodeLocal:
        """Collective. This rank's folder in its node's local tier (``places.local``), and with ``s.peer`` its side of
        the peer copy. The node's first rank (by the host names every rank reports) is its leader: it writes the
        shared pieces there, once per node. ``lineage``, ``run_id``, ``generation``: the run's and this incarnation's
        (lease.lineage, the staging folders' tag, the lease generation); ``spares``: the backend overwrites retired
        payload files (Backend.reuses_files)."""
        nodes = rank.gather(knobs.node_name(rank.rank))
        leader = nodes.index(nodes[rank.rank])
        identity = {"origin": str(places.shared.root), "lineage": lineage, "job": slurm.job_id() or ""}
        order, why = buddies(nodes) if s.peer else ([], None)
        if why and rank.is_main:  # a warning line to stderr, beside the progress, as the session's
            print(f"warning: {setting('peer', True)}: {why}; the local tier goes on without a peer copy",
                  file=sys.stderr, flush=True)
        tier = LocalTier(places.local.root, rank, leader=leader, identity=identity, keep=s.local_keep,
                         copies=2 if order else 1, generation=generation, setting=places.local.setting, spares=spares)
        if not s.peer:
            return cls(tier)
        link = Link(rank, timeout_s=s.peer_timeout_s)  # collective: every rank, in the same order
        if not order:  # nothing to send now, but the copies this node keeps still serve a load: after an in-process
            # recovery a lost node's ranks may run here, and their newest parts are the copies kept for them
            return cls(tier, [PeerCopy(tier, link, buddy=None, source=None, keep=s.local_keep, run_id=run_id)])
        scope = None
        if knobs.emulated_nodes():  # one host, one local folder: each emulated node holds only what its ranks wrote
            mates = [r for r, name in enumerate(nodes) if name == nodes[rank.rank]]
            local, peer = places.local, places.peer
            scope = {str(p.relative_to(local.root)) for r in mates
                     for p in (local.rank_dir(r), peer.rank_dir(order.index(r)))}
        return cls(tier, [PeerCopy(tier, link, buddy=order[rank.rank], source=order.index(rank.rank),
                                   keep=s.local_keep, run_id=run_id, scope=scope)])

    @staticmethod
    def read_ahead(local: Place, rank: int, newest: int) -> Iterator[tuple[Path, dict, list[str]]]:
        """What this rank's load of `latest` reads from its node's tier (``local``) when that holds a committed step
        at or after ``newest`` (the run folder's newest; the load then takes the local copy): this rank's part of the
        newest such step, every file, then the shared pieces of its node leader's part (the rank's own, on the leader);
        nothing when it holds none. Each part as (step folder, manifest, file names), read only when asked for: on
        the read-ahead's thread, which imports nothing."""
        found = [i for i in layout.list_checkpoints(local.rank_dir(rank)) if i.committed and i.step >= newest]
        if not found:
            return
        step_dir = found[-1].path
        manifest = layout.read_manifest(step_dir)
        yield step_dir, manifest, list(manifest["files"])
        leader = manifest.get("meta", {}).get("tier", {}).get("leader", rank)
        if not isinstance(leader, int) or leader == rank:
            return
        leader_dir = local.rank_dir(leader) / step_dir.name
        if storage.is_link(leader_dir) or not leader_dir.is_dir():  # a linked step folder is never loaded
            return
        try:
            theirs = layout.read_manifest(leader_dir)
        except CheckpointError:
            return  # the load says what is wrong with it
        yield leader_dir, theirs, [n for n in theirs["files"] if n != rank_file(leader)]

    def attach(self, committer: Committer) -> None:
        super().attach(committer)
        self._drainer = Drainer(self.tier, self._land_drained, committer.abandon)

    # --- save ----------------------------------------------------------------------------------------------------
    def save(self, step: int, state: CheckpointState, meta: dict | None, *, t0: float, shared: bool, peer: bool):
        """Write this rank's part of ``step`` into the local tier; ``shared``: drain it to the shared tier once
        committed here; ``peer``: hand it to the replicas on other nodes too. Returns (payload, finish, record) for the
        manager."""
        c, tier = self.committer, self.tier
        if shared:
            self._drainer.wait()  # one drain at a time: a shared tier slower than its interval stalls, never piles up
        step_dir = c.prepare(step) if shared else None
        local_dir = None  # the local tier's staging folder, once it exists (only that one is the tier's to discard)
        sent = self.replicas if peer else []

        def failed(e: OSError | CheckpointError) -> CheckpointError:
            for replica in sent:
                replica.submit(step, None)  # the buddy, which saved this step, hears it will not come
            return c.failed(step, step_dir, e, where=(tier.root.parent.parent, "local_dir"),
                            cleanup=lambda: local_dir is not None and tier.discard(local_dir))

        try:  # fenced: the local publish refuses (its guard), as the shared commit does
            local_dir = tier.save_dir(c.run_id, step)
            tier.check_space(lambda: part_bytes(state, tier.writes_shared))
            # the node leader writes the shared pieces, and retired local files are overwritten
            payload = c.backend.save(local_dir, state, shared=tier.writes_shared, spares=tier.spares)
        except (OSError, CheckpointError) as e:
            raise failed(e) from None
        record = SaveRecord(step, blocking_s=time.perf_counter() - t0)

        def finish() -> None:
            try:
                files = payload.wait()
                published = tier.commit(local_dir, step, files, backend=c.backend.name, run_id=c.run_id,
                                         meta=meta or {}, guard=c.guard)
            except (OSError, CheckpointError) as e:
                c.fail(failed(e))
                return
            record.bytes = sum(r["size"] for r in files.values())
            record.durable_s = time.perf_counter() - t0
            if c.rank.is_main:
                _log.info(f"checkpoint step {step} committed in the local tier: {record.bytes / MiB:.1f} MiB, blocked "
                          f"{record.blocking_s:.2f}s, durable after {record.durable_s:.2f}s"
                          + ("; draining to the shared tier" if step_dir is not None else ""))
            if step_dir is not None:
                self._drainer.submit(step, step_dir, meta=meta, record=record, t0=t0)
            for replica in sent:
                replica.submit(step, published)
            try:
                tier.retain(self._drainer.protected() | c.in_flight(besides=step)
                            | set().union(*(replica.protected() for replica in self.replicas)),
                            c.guard, own_staging=local_dir.parent.name)
            except Fenced as e:
                c.fail(e)  # dropped, noted once

        return payload, finish, record

    def _land_drained(self, step: int, step_dir, files: dict, **land_args) -> None:
        self.committer.land(step, step_dir, files, landed=self._drained, **land_args)

    def _drained(self, record, t0: float) -> None:
        record.shared_s = time.perf_counter() - t0
        if self.committer.rank.is_main:
            _log.info(f"checkpoint step {record.step} committed in the shared tier {self.committer.root}, drained "
                      f"from the local tier ({record.shared_s:.2f}s after the save began)")

    def protected(self) -> set[int]:
        """The shared tier's steps still being drained into (its retention keeps them)."""
        return self._drainer.protected()

    # --- load ----------------------------------------------------------------------------------------------------
    def latest(self, state: CheckpointState, t0: float) -> int | None:
        """The newest step that every rank holds locally (in its node's tier, or restored from a copy on another node)
        wins if the shared tier has nothing newer committed; otherwise the shared tier's `latest`, which each rank still
        loads from its local tier if it holds that step. Only the chosen step is verified: a local copy that fails is
        removed, and the choice is made again without it (with the replicas' restores too: PeerCopy.restore, older
        than the refused step; a peer copy that fails is likewise never the end of the choice). When the shared tier
        holds the chosen step, a local copy must also match its manifest (LocalTier.usable), else that rank loads the
        shared copy. A step restored only from local tiers is then drained to the shared tier, so losing a node right
        after loses nothing."""
        c, rank = self.committer, self.committer.rank
        # the run's resumes, from its folder: a local part of a line the run has left is no candidate
        forks = rank.from_main(read_forks(c.root / FORKS, self.tier.identity["lineage"])
                               if rank.is_main and c.generation is not None else [])
        local = self.tier.committed(forks)
        newest_shared = c.newest()
        shared: list = []  # the shared tier's `latest`, resolved (and verified on rank 0) at most once

        def floor() -> int | None:  # collective: asked only by a replica that restores
            return max((s for s in (everywhere(local, rank.gather), newest_shared) if s is not None), default=None)

        def restore(below: int | None = None) -> list[int]:  # ranks whose part came from a copy on another node
            return sorted({r for replica in self.replicas for r in replica.restore(local, floor, forks, below=below)})

        restored = restore()
        while True:
            best_local = everywhere(local, rank.gather)
            info = None
            if newest_shared is not None and (best_local is None or newest_shared > best_local):
                shared = shared or [c.resolve("latest")]  # perhaps an older one; the same answer everywhere
                info = shared[0]
            if info is not None and (best_local is None or info.step >= best_local):
                step = info.step  # from the shared tier, but a rank holding it locally loads that copy
            elif best_local is not None:
                step, info = best_local, None
            else:
                return None
            mine = local.get(step)
            found = (info.path, info.manifest) if info is not None else c.manifest(step)
            if mine is not None and not self.tier.usable(mine, found[1] if found is not None else None, c.ahead):
                del local[step]
                mine = None
            everyone = all(rank.gather(mine is not None))
            if not everyone and info is None and found is not None:  # a local copy refused: the shared one, verified
                try:
                    info = c.resolve(str(found[0]))
                except CheckpointError:
                    pass  # no copy of this step: choose again, where the shared `latest` names what is wrong with it
            # a rank without the step loads the shared copy; without one, every rank must hold it (else choose again)
            if info is not None or everyone:
                break
            # a part refused: the copies on other nodes may still give every rank a step older than it
            restored = sorted(set(restored) | set(restore(below=step)))
        if mine is not None:
            self.tier.load(mine, state)
        else:
            c.load(info, state)
        here = rank.gather(mine is not None)
        from_peer = sum(1 for r in restored if here[r])
        # What was loaded, as rank 0 sees it, on every rank (its card: the resume checks agree across ranks)
        loaded = rank.from_main(mine or info)
        c.loaded(loaded, t0, source=f"{sum(here)} of {len(here)} ranks from their local tier"
                 + (f" ({from_peer} from a peer copy)" if from_peer else "")
                 + (f", {len(here) - sum(here)} from the shared tier" if not all(here) else ""))
        for held in [info] + list(local.values()):
            if held is not None:
                held.verified.clear()  # what the load did not take is not held for the rest of the run
        if info is None:
            self._drain_restored(step, loaded.manifest.get("meta", {}))
        return step

    def _drain_restored(self, step: int, meta: dict) -> None:
        """A step restored from the local tiers alone goes to the shared tier now (in the background), unless it is
        there already."""
        if self.committer.holds(step):
            return
        step_dir = self.committer.prepare(step)
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
        """The run continues from ``step``: newer local steps (in every replica) belong to a line it left, and the
        resume is recorded in the run folder (the local parts on nodes this job does not reach)."""
        c = self.committer
        for replica in self.replicas:
            replica.retire_newer(step)
        if c.rank.is_main and c.generation is not None:
            try:
                record_resume(c.root, self.tier.identity["lineage"], c.generation, step)
            except OSError as e:
                raise CheckpointError(f"cannot record the resume in {c.root / FORKS}: {e.strerror or e}") from None

    def poll(self) -> None:
        self._drainer.poll()

    def wait(self) -> None:
        self._drainer.wait()

    def leave(self) -> None:
        for replica in self.replicas:
            replica.leave()

    def close(self) -> None:
        self._drainer.close()
        for replica in self.replicas:  # the last local step reaches the buddy too (bounded wait)
            replica.close()

    def finished(self) -> None:
        """The run's final step is in the shared tier (or the run starts afresh): the local copies have done their
        job."""
        for replica in self.replicas:
            replica.clear()

    def summary(self) -> str:
        return "\n".join(line for line in (replica.summary() for replica in self.replicas) if line)
