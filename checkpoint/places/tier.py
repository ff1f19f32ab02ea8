"""The node-local tier (``--local-checkpoint-dir``): every rank keeps its part of the recent steps on its own node, where
writing and reading run at memory or NVMe speed; some of those steps are drained from there to the shared tier
(``--checkpoint-dir``) in the background; a restart loads each rank's part from the nearest tier that holds the newest
step every rank can load.

    <local-dir>/<experiment>-<key>/rank-00003/     key: of the shared run folder (run_folder_name)
        step-00000012/          this rank's files of step 12, committed like any checkpoint (manifest, COMMITTED;
                                verified before a load): rank-00003.pt, and on the node's first rank (its *leader*) the
                                shared pieces too (model.pt, optimizer.pt, ...), which every rank of the node loads
        .staging-<run id>/      saves being written (published by rename, as in the shared tier)
        .spare/                 payload files of retired steps, to be overwritten by the next saves (Spares; only
                                for a backend that overwrites files: Backend.reuses_files)

The run's folder is this user's alone (0700; checkpoint/nodetrust.py): the tier sits in a folder every user of the
node shares.

Each rank writes and deletes only under its own ``rank-N`` folder; a rank reads only its own and its node leader's:
no rank ever reads another node's folder. Whether a step is complete in the local tier is agreed by a collective at
restart (``nearest``), not by files. A local step is used only if its manifest names this run: the shared run folder,
its lineage (the token of the lease's first generation: a run folder deleted and started anew is another run), the
world size, the rank, its node leader and the SLURM job; anything else is stale and removed.

What this tier holds is a cache of the shared tier: a clean end drains the final step to the shared tier and removes
the local folders (``clear``); a stop that will be requeued keeps them for the next incarnation.

Only the file backends (vanilla, concurrent) write here: their parts are whole files per rank. DCP writes one
collective ``.metadata`` and is refused with the local tier (backends.combination_refusal).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import torch

from .. import knobs, layout, naming, nodetrust, route, storage
from ..backends import RankInfo
from ..backends.torchfile import load_pieces, rank_file
from ..errors import CheckpointError
from ..fsio import MiB, is_disk_full, make_dirs
from ..logs import EVERY_RANK
from ..reader import flatten
from ..retention import apply_retention
from ..state import CheckpointState, OptimizerState
from . import Replica, rank_dir_name
from .promoter import ORDERED, Promoter

_log = logging.getLogger(__name__)


class LocalTier(Replica):
    """This rank's folder in its node's local tier, and its node leader's (read-only)."""

    def __init__(self, base: Path, rank: RankInfo, *, leader: int, identity: dict, keep: int = 2, copies: int = 1,
                 generation: int = 0, setting: str = "", spares: bool = False):
        """``base``: the run's folder in the tier (places.Places.local); ``setting``: what names it, for messages;
        ``spares``: the backend overwrites retired payload files (Backend.reuses_files), so retirement keeps them."""
        base = Path(base)
        self._setting, self._folder_checked = setting or naming.setting("local_dir", base.parent), False
        self._folder_lock = threading.Lock()  # the training, commit and peer threads all make folders here
        self._held: set[int] = set()  # this rank's committed steps here, as last seen: named if the folder vanishes
        self.root = base / rank_dir_name(rank.rank)
        self.private()  # refused before anything is read from there
        self.rank, self.leader, self.keep = rank, leader, max(keep, 1)
        self.copies = copies  # 2 with a peer copy: this node also keeps another node's part (peer.py)
        self.generation = generation  # the lease generation writing here: which line a part belongs to (abandoned)
        self.identity = {**identity, "rank": rank.rank, "leader": leader, "world_size": rank.world_size}
        self._writing = route.of(self.root)
        self._checked_space = False
        self.spares = Spares(self.root / SPARE_DIR) if spares else None
        self._leader_manifests: dict[Path, tuple[Path, dict]] = {}  # by local step folder: the part holding its
        # shared pieces and its manifest, as ``usable`` checked them

    def private(self) -> None:
        """The run's folder in the tier, 0700 and this user's (checkpoint/nodetrust.py): the tier sits in a folder every
        user of the node shares, so nobody else may read a step or replace one. Every folder made there (a save, a
        peer copy, a restore) comes through here first, and the folders below it are made only inside it
        (fsio.make_dirs ``within``), never under the umask: a run folder removed while the run goes on (a clean-up of
        /dev/shm, an epilog, by hand) is made again the same way, with one line naming the steps it took along."""
        with self._folder_lock:
            run_folder = self.root.parent
            if self._folder_checked and _plain_folder(run_folder):
                return
            gone, self._folder_checked = self._folder_checked, False
            try:
                nodetrust.private_folder(run_folder, self._setting)
            except nodetrust.Untrusted as e:
                raise CheckpointError(str(e)) from None
            self._folder_checked = True
            if gone:
                held, self._held = sorted(self._held), set()
                _log.warning(f"warning: local tier: {run_folder} had disappeared while the run went on, with "
                             + (f"this rank's steps {', '.join(map(str, held))}" if held else "no step of this rank")
                             + "; made again, this user's alone (0700)", extra=EVERY_RANK)

    def folder(self) -> Path:
        """This rank's folder, made (inside the private run folder) if missing."""
        for again in (False, True):
            self.private()
            with self._folder_lock:
                if not self.root.is_dir() and self._held:
                    _log.warning(f"warning: local tier: {self.root} had disappeared while the run went on, with this "
                                 f"rank's steps {', '.join(map(str, sorted(self._held)))}; made again",
                                 extra=EVERY_RANK)
                    self._held = set()
                try:
                    make_dirs(self.root, within=self.root.parent)
                    return self.root
                except FileNotFoundError:
                    if again:
                        raise
                    # another rank of the node removed the run folder as it emptied it (its clear at a fresh start)
                    # between our check and our folder: the run folder is made again, privately, as at the start
                    self._folder_checked = False
        raise AssertionError("unreachable")

    @property
    def writes_shared(self) -> bool:
        """The node leader writes the shared pieces (model, optimizer, ...) into the node's tier, once per node."""
        return self.leader == self.rank.rank

    # --- save ----------------------------------------------------------------------------------------------------
    def save_dir(self, run_id: str, step: int) -> Path:
        step_dir = self._writing.save_dir(self.folder(), run_id, step)
        if step_dir.exists():  # this incarnation's own leftover of a failed attempt (the name proves it)
            storage.rmtree(step_dir)
        make_dirs(step_dir, within=self.root)
        return step_dir

    def check_space(self, part_bytes: Callable[[], int], *, first_save: bool = True) -> None:
        """``keep`` + 1 copies of this rank's part (the kept ones and the one being written) must fit on the local
        tier's filesystem; else one line, before a write fails half-way (a 64 MiB Docker /dev/shm). Checked before the
        loop (``first_save`` False: the state as it is then -- a fresh optimizer holds no moments yet) and again, with
        the part's real size, at the first save."""
        if self._checked_space:
            return
        self._checked_space = first_save
        nbytes = part_bytes()
        st = os.statvfs(self.folder())
        # what retention frees for the next saves counts as free: the steps, and spares only as far as the next save
        # overwrites them (one part; Spares keeps at most two retirements' files, a backend that reuses none keeps none)
        spare = _tree_bytes(self.spares.dir) if self.spares is not None else 0
        free = (st.f_bavail * st.f_frsize + sum(_tree_bytes(i.path) for i in layout.list_checkpoints(self.root))
                + min(spare, nbytes))
        need = (self.keep + 1) * nbytes * self.copies
        if need > free:
            raise CheckpointError(
                f"{self._setting}: {free / MiB:.1f} MiB free, but this rank's "
                f"part of a checkpoint is {'' if first_save else 'at least '}{nbytes / MiB:.1f} MiB and the local tier "
                f"holds {self.keep} + 1 of them{' (and as many of a peer node)' if self.copies > 1 else ''} "
                f"({need / MiB:.1f} MiB); give it more space (e.g. docker run --shm-size), point it at a larger "
                f"node-local disk, or lower {naming.setting('local_keep')}")

    def commit(self, step_dir: Path, step: int, files: dict[str, dict], *, backend: str, run_id: str, meta: dict,
               guard: Callable[[str], None]) -> Path:
        """Commit this rank's part of ``step`` (written in ``step_dir``) and publish it as ``rank-N/step-M``."""
        layout.commit(step_dir, step, self.rank.world_size, backend, [{"files": files}],
                      meta={**meta, "tier": {**self.identity, "generation": self.generation}})
        published = self._writing.publish(step_dir, self.root, step, guard=guard, tag=run_id)
        self._held.add(step)
        return published

    def discard(self, step_dir: Path) -> None:
        try:
            self._writing.discard(step_dir)
        except OSError:
            pass

    def drain_files(self, step: int) -> dict[str, tuple[Path, dict, str]]:
        """The files of this rank's part of ``step`` that belong in the shared tier -- what this rank writes there
        without a local tier (rank 0: the shared pieces and its rank file; any other rank: its rank file) -- as
        (path, record, checksum algorithm)."""
        step_dir = self.root / layout.step_dir_name(step)
        manifest = layout.read_manifest(step_dir)
        files = manifest["files"]
        names = files if self.rank.is_main else [n for n in files if n == rank_file(self.rank.rank)]
        return {n: (layout.member(step_dir, n, manifest), files[n], manifest["checksum"]) for n in names}

    def retain(self, protected: set[int], guard: Callable[[str], None], own_staging: str) -> None:
        """Keep the newest ``keep`` committed local steps and ``protected`` (not drained yet)."""
        apply_retention(self.root, self.keep, in_flight=protected, guard=guard, own_staging=own_staging,
                        label=f"local tier {self.root}", quiet=True,
                        salvage=self.spares.give if self.spares is not None else None)
        self._held = {i.step for i in layout.list_checkpoints(self.root) if i.committed}

    # --- restart -------------------------------------------------------------------------------------------------
    def committed(self, forks: list | None = None) -> dict[int, layout.CheckpointInfo]:
        """This rank's committed local steps, not verified yet: ``usable`` verifies the one a restart picks, so a
        restart reads the bytes of that step only. ``forks``: the run's resumes (``abandoned``); a step of a line the
        run has left is not one of them."""
        found = {info.step: info for info in layout.list_checkpoints(self.root)
                 if info.committed and not (forks and abandoned(info.path, forks))}
        self._held = set(found)
        return found

    def usable(self, info: layout.CheckpointInfo, shared: dict | None = None,
               ahead: layout.VerifiedAhead | None = None) -> bool:
        """Verify ``info`` (this rank's part and the part holding its shared pieces) and that it names this run; its
        bytes stay in ``info.verified`` for the load. The shared pieces are where the part says they were written: in
        the part itself if this rank was its node's leader then, else in that leader's part -- after an in-process
        recovery a rank may run on another node, under another leader, and load a part (a peer copy) written as its
        old node's leader. ``shared``: the shared tier's manifest of the same step, when the shared tier holds it;
        then every file of the local copy (the leader's part too) must be one that manifest records, with the same
        size and checksum, or the rank loads the shared copy: a local manifest sits beside the files it vouches for,
        and whoever can change them can reseal it. A step that fails is removed, with one line saying why."""
        try:
            info.manifest = self._verified(info.path, info.verified, shared, ahead, self.rank.rank)
            leader, leader_dir = info.manifest, info.path
            written_under = info.manifest.get("meta", {}).get("tier", {}).get("leader", self.leader)
            if written_under != self.rank.rank:
                leader_dir = self.root.parent / rank_dir_name(written_under) / info.path.name
                leader = self._verified(leader_dir, info.verified, shared, ahead, written_under)
        except CheckpointError as e:
            info.verified.clear()
            self._remove(info, f"not usable ({e})")
            return False
        self._leader_manifests[info.path] = (leader_dir, leader)  # the load reads the shared pieces as checked here
        return True

    def _verified(self, step_dir: Path, keep: dict | None, shared: dict | None,
                  ahead: layout.VerifiedAhead | None, rank: int) -> dict:
        """``step_dir``'s manifest, verified, naming this run and ``rank``; a part of another rank must have been
        written as its node's leader (the one holding the shared pieces)."""
        manifest = layout.verify(step_dir, keep=keep, ahead=ahead)
        tier = manifest.get("meta", {}).get("tier", {})
        expected = {**self.identity, "rank": rank, "leader": rank if rank != self.rank.rank else tier.get("leader")}
        mine = {k: v for k, v in tier.items() if k in expected}
        if mine != expected:
            differs = sorted(k for k in expected if mine.get(k) != expected[k])
            raise CheckpointError(f"written by another run, job or layout ({', '.join(differs)} differ)")
        if shared is not None:
            whose = "" if step_dir.parent == self.root else f" of its node leader's part {step_dir}"
            _check_against(manifest, shared, whose)
        return manifest

    def load(self, info: layout.CheckpointInfo, state: CheckpointState) -> None:
        """Restore ``state`` from this rank's part of ``info`` and its leader's shared pieces, both as ``usable``
        checked them (their bytes verified there, or as they are read against the manifests it checked)."""
        try:
            shared = self._leader_manifests.pop(info.path)
            load_pieces(info.path, info.manifest, state, self.rank.rank, info.verified, shared_at=shared)
        finally:
            info.verified.clear()

    def retire_newer(self, step: int) -> None:
        """The run continues from ``step``: newer local steps belong to a line it left (or to another run) and go."""
        for info in layout.list_checkpoints(self.root):
            if info.step > step:
                self._remove(info, f"newer than step {step}, which the run continues from")

    def recover(self, own_staging: str) -> None:
        """What a crashed incarnation left being written here goes (its committed steps stay), and spares where this
        backend never reuses them (they would only hold space the space check cannot count)."""
        if self.root.is_dir():
            layout.recover(self.root, own_staging)
            if self.spares is None:
                shutil.rmtree(self.root / SPARE_DIR, ignore_errors=True)

    def clear(self) -> None:
        """Empty this rank's folder (a fresh start, or a clean end: everything is in the shared tier) of what PyRecover
        wrote there: its steps, staging folders and spares. Anything else stays, and so do the folders holding it."""
        for info in layout.list_checkpoints(self.root):
            self._remove(info, "")
        self._writing.sweep(self.root, own_staging="", guard=layout.no_guard)  # interrupted saves, trash
        shutil.rmtree(self.root / SPARE_DIR, ignore_errors=True)
        try:
            self.root.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            _log.warning(f"warning: local tier: {self.root} keeps files PyRecover did not write; remove them")
            return
        try:
            self.root.parent.rmdir()  # the run's folder, once every rank of the node has cleared its own
        except OSError:
            pass
        self._folder_checked = False  # gone, or going with another rank's clear: the next save makes it again
        self._held = set()

    def _remove(self, info: layout.CheckpointInfo, why: str) -> None:
        try:
            layout.remove_step_dir(info.path, "move them out of the local tier")
            self._held.discard(info.step)
            if why:
                _log.info(f"local tier: removed {info.path}: {why}", extra=EVERY_RANK)
        except (OSError, CheckpointError) as e:
            _log.warning(f"warning: local tier: cannot remove {info.path}: {e}")


SPARE_DIR = ".spare"


class Spares:
    """Payload files of retired local steps, which the next saves overwrite in place instead of creating new files
    (fsio.atomic_write's ``reuse``). On tmpfs a new file's pages are allocated and zeroed as it is written, and freed
    when it is deleted: measured, 150-170 ms for a 224 MiB file against 43 ms to overwrite one, on 2 busy cores the
    largest CPU cost of a local save. A spare is a name in this folder only: no step refers to it, and what a crash
    leaves there is overwritten or removed like any spare. Thread-safe: the writer threads take, the commit thread
    gives."""

    MIN_BYTES = 1 * MiB  # smaller files gain nothing worth a rename
    LIMIT = 16  # files, at most; and none that no save took by the retirement after the one that gave it

    def __init__(self, folder: Path):
        self.dir = folder
        self._lock = threading.Lock()
        self._handed: set[str] = set()  # taken, about to be renamed away by the writer
        self._round = 0  # retirements so far
        self._given: dict[str, int] = {}  # spare -> the retirement that gave it (one left by a crash: 0)

    def give(self, step_dir: Path) -> None:
        with self._lock:
            try:
                # only inside this rank's folder (it holds the step being retired): never a folder above it
                make_dirs(self.dir, within=self.dir.parent)
                self._round += 1
                for f in sorted(step_dir.iterdir()):
                    st = f.lstat()
                    # a file with another name too (a hard link someone made to keep the step) is not ours to overwrite
                    if f.suffix == ".pt" and stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_size >= self.MIN_BYTES:
                        name = f"{uuid.uuid4().hex[:12]}.spare"
                        os.rename(f, self.dir / name)
                        self._given[name] = self._round
                # a spare that no save took by the next retirement never will (another size, no save in between): it
                # would only pile up (vanilla's did, 16 files on a tmpfs the space check had passed); one being taken
                # now stays
                listed = self._list()
                self._given = {f.name: self._given.get(f.name, 0) for _, f in listed}  # the taken ones are gone
                spares = [f for _, f in listed if f.name not in self._handed]
                stale = [f for f in spares if self._given.get(f.name, 0) < self._round - 1]
                fresh = [f for f in spares if f not in stale]
                for f in stale + fresh[:-self.LIMIT]:
                    f.unlink(missing_ok=True)
                    self._given.pop(f.name, None)
            except OSError as e:
                _log.debug(f"local tier: keeping no spares ({e})")

    def take(self, nbytes: int) -> Path | None:
        """A spare to overwrite with ``nbytes``: the smallest that holds them, else the largest (None: none)."""
        with self._lock:
            listed = self._list()
            self._handed &= {f.name for _, f in listed}
            spares = [(size, f) for size, f in listed if f.name not in self._handed]
            if not spares:
                return None
            fitting = [(size, f) for size, f in spares if size >= nbytes]
            _, chosen = min(fitting) if fitting else spares[-1]
            self._handed.add(chosen.name)
            return chosen

    def _list(self) -> list[tuple[int, Path]]:
        out = []
        try:
            for entry in os.scandir(self.dir):
                if entry.name.endswith(".spare") and entry.is_file(follow_symlinks=False):
                    out.append((entry.stat(follow_symlinks=False).st_size, Path(entry.path)))
        except FileNotFoundError:
            pass
        return sorted(out)


def part_bytes(state: CheckpointState, shared: bool) -> int:
    """The tensor bytes of this rank's part (``shared``: with the replicated pieces), give or take the small per-rank
    pieces. An optimizer before its first step counts nothing: it has no moments yet, and DCP's state_dict would make
    them by stepping it (its step count would change the run)."""
    pieces = [p for p in (state.shared() if shared else {}).values()
              if not (isinstance(p, OptimizerState) and not p.optimizer.state)]
    return sum(t.numel() * t.element_size() for p in pieces for _, t in flatten(p.state_dict())
               if isinstance(t, torch.Tensor))


def _plain_folder(path: Path) -> bool:
    """``path`` is a folder, not a link to one (whatever replaced ours is checked again by nodetrust)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file() and not p.is_symlink())


def _check_against(manifest: dict, shared: dict, whose: str) -> None:
    """Every file of a local part (``manifest``: verified) is recorded in ``shared`` (the shared tier's manifest of the
    same step) by name, size and checksum; else CheckpointError naming the first that is not (``whose``: which part,
    when not the rank's own). A file the shared tier does not list is refused too: nothing vouches for it."""
    algorithm, step = manifest["checksum"], shared["step"]
    for name, record in manifest["files"].items():
        theirs = shared["files"].get(name)
        if theirs is None:
            raise CheckpointError(f"{name}{whose} is not in the shared tier's step {step}, so nothing vouches for it; "
                                  "the rank loads the shared tier's copy instead")
        if (shared["checksum"] != algorithm or theirs.get("size") != record["size"]
                or theirs.get(algorithm) != record[algorithm]):
            raise CheckpointError(f"{name}{whose} differs in size or {algorithm} from its record in the shared tier's "
                                  f"step {step}; the rank loads the shared tier's copy instead")


FORKS = "resumes.json"  # in the shared run folder: [generation, step] of every incarnation that resumed, per lineage


def record_resume(run_folder: Path, lineage: str, generation: int, step: int) -> None:
    """Rank 0, the lease holder, once an incarnation continues the run from ``step``: remembered so that a node-local
    part written by an older generation beyond ``step`` is known to belong to a line the run left -- also where the
    run cannot reach to remove it (a node dropped from the job, its /dev/shm intact, which a later requeue gets back)."""
    path = Path(run_folder) / FORKS
    forks = read_forks(path, lineage)
    storage.write_bytes(path, json.dumps({"lineage": lineage, "forks": forks + [[generation, step]]}).encode())


def read_forks(path: Path, lineage: str) -> list:
    """The run's recorded resumes (``record_resume``) for this lineage; [] when none, another lineage's, or
    unreadable (nothing is then taken for abandoned: the identity checks still hold)."""
    try:
        data = json.loads(Path(path).read_bytes())
        forks = data["forks"] if data.get("lineage") == lineage else []
        return [[int(g), int(s)] for g, s in forks]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def abandoned(step_dir: Path, forks: list) -> bool:
    """Whether the local part ``step_dir`` was written on a line the run has left: by a generation older than one that
    resumed from an earlier step."""
    try:
        manifest = layout.read_manifest(step_dir)
    except CheckpointError:
        return False  # unreadable: the load's verify says why
    written_by = manifest.get("meta", {}).get("tier", {}).get("generation", 0)
    step = manifest["step"]
    return any(g > written_by and s < step for g, s in forks)


def everywhere(local: dict[int, layout.CheckpointInfo], gather: Callable[[object], list]) -> int | None:
    """The newest step that every rank holds in its local tier (``local``: this rank's loadable steps; ``gather(x)``:
    every rank's ``x``, a collective); None when there is none."""
    return max(set.intersection(*(set(steps) for steps in gather(sorted(local)))), default=None)


class Drainer:
    """Node-local -> shared: an ordered promoter (promoter.py) per rank that copies this rank's part of a locally
    committed step into the shared tier, then calls ``land(step, files)`` (the part record; rank 0 commits there). A
    copy that fails calls ``abandon(shared_dir, error)`` instead (a failure record: rank 0 gives up on that step at
    once, not after its commit timeout), and the step stays protected from local retention: the local tier still
    holds it. ``wait`` returns once every queued step has landed, re-raising the first error (also at ``poll``)."""

    def __init__(self, tier: LocalTier, land: Callable[..., None], abandon: Callable[..., None]):
        self.tier, self.land, self.abandon = tier, land, abandon
        self._promoter = Promoter("ckpt-drain", self._drain, mode=ORDERED)
        self.protected, self.poll, self.wait = self._promoter.protected, self._promoter.poll, self._promoter.wait

    def submit(self, step: int, shared_dir, **land_args) -> None:
        self._promoter.submit(step, (shared_dir, land_args))

    def _drain(self, step: int, job: tuple) -> None:
        shared_dir, land_args = job
        files = {}
        try:
            for name, (src, record, algorithm) in self.tier.drain_files(step).items():
                files[name] = _copy_checked(src, record, algorithm, shared_dir / name)
                time.sleep(knobs.drain_delay_s())  # test-only: a slow shared tier
        except (OSError, CheckpointError) as e:
            self.abandon(shared_dir, e)
            raise
        self.land(step, shared_dir, files, **land_args)

    def close(self) -> None:
        self._promoter.close(0)  # the manager waited for what it needs; the thread ends after what is queued


def _copy_checked(src: Path, record: dict, algorithm: str, dst) -> dict:
    """Copy one local file to the shared tier; the bytes written must hash as the local manifest says (they are hashed
    as they pass, so a local file changed since its commit is caught here, not at the next load)."""
    try:
        written = storage.copy_file(src, dst)
    except OSError as e:
        if is_disk_full(e):
            raise CheckpointError(f"draining {src} to {dst} failed: no space left on device; free space in the "
                                  "shared tier (the local tier still holds the step)") from None
        raise CheckpointError(f"draining {src} to {dst} failed: {e.strerror or e}") from None
    if written.get("size") != record["size"] or written.get(algorithm) != record[algorithm]:
        raise CheckpointError(f"{src} changed since its local commit (its bytes no longer match its manifest); the "
                              "step is not drained")
    return written
