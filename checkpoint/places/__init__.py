"""Where a run's committed steps live, nearest first. Every place is derived here, once, from the run's settings: no
other module turns a setting into a place's folder, and no other module spells a per-rank folder (``rank_dir_name``,
``rank_dirs``, ``PEER_DIR``).

    place    its root (the run's folder there)            written by                 holds
    local    <local-dir>/<experiment>-<key>/               each rank, its own part    rank-N/step-M (tier.py)
    peer     <local-dir>/<experiment>-<key>/peer/          the buddy node's ranks     rank-N/step-M (peer.py)
    shared   <checkpoint-dir>/<experiment>/                every rank; rank 0 commits step-M (../manager.py)
    mirror   <mirror-dir>/<experiment>/                    rank 0                     step-M (mirror.py)

The modules of this folder: the places' machinery. ``first.py``: the place every save lands in first (the run folder,
or ``nodelocal.py``: this node's tier and the copies of it, each a ``Replica``), and the committer it is handed, the
manager's side of a save; ``promoter.py``: the background copier that carries committed steps on (``tier.Drainer``,
``peer.PeerCopy``, ``mirror.Mirror``).

``key`` names the shared run folder that the node-local places cache, so two runs of one experiment name on a node
(another --checkpoint-dir, the same --local-checkpoint-dir) neither sweep, retire nor count each other's steps.

A place's refusal (a local tier on object storage, a mirror inside the run folder) is one line, raised when the places
are built: before any file is touched.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .. import storage
from ..errors import CheckpointError
from ..naming import setting

if TYPE_CHECKING:
    from .. import layout
    from ..settings import Settings

LOCAL, PEER, SHARED, MIRROR = "local", "peer", "shared", "mirror"
PEER_DIR = "peer"  # in a node-local run folder: the copies this node keeps of other nodes' ranks' parts
_RANK_DIR = re.compile(r"rank-(\d{5,})")


def rank_dir_name(rank: int) -> str:
    """The folder of one rank's parts in a node-local place."""
    return f"rank-{rank:05d}"


def rank_dirs(folder) -> list[Path]:
    """The per-rank folders in ``folder`` (a run's folder in a node-local tier, or its peer/ folder), by name; none
    where it is no local folder."""
    return sorted(p for p in folder.iterdir() if p.is_dir() and _RANK_DIR.fullmatch(p.name)) \
        if isinstance(folder, Path) and folder.is_dir() else []


def rank_of(rank_dir: Path) -> int:
    """The rank whose parts a per-rank folder (one of ``rank_dirs``) holds."""
    return int(_RANK_DIR.fullmatch(rank_dir.name).group(1))


def run_folder_name(origin: str, experiment: str) -> str:
    """The run's folder in a node-local place: its experiment name and a key of the shared run folder it caches."""
    where = origin if "://" in origin else os.path.realpath(origin)
    return f"{experiment}-{hashlib.sha256(where.encode()).hexdigest()[:8]}"


def tier_root(local_dir, experiment: str, origin: str) -> Path:
    """The run's folder in a node-local tier. ``origin``: the shared run folder (a path or an s3:// URI)."""
    return Path(local_dir) / run_folder_name(origin, experiment)


@dataclass(frozen=True)
class Place:
    kind: str  # LOCAL, PEER, SHARED or MIRROR
    root: Path  # the run's folder there
    setting: str  # what names it, for messages: naming.setting("checkpoint_dir", DIR)

    @property
    def per_rank(self) -> bool:
        """Its steps are kept in one folder per rank (a node holds only its own ranks' parts)."""
        return self.kind in (LOCAL, PEER)

    def rank_dir(self, rank: int) -> Path:
        assert self.per_rank, self.kind
        return self.root / rank_dir_name(rank)


@dataclass(frozen=True)
class Places:
    """The places of one run. ``local`` and ``mirror`` are optional; ``peer`` needs ``local``."""

    shared: Place
    local: Place | None = None
    peer: Place | None = None
    mirror: Place | None = None

    @classmethod
    def of(cls, s: "Settings") -> "Places":
        """The places ``s`` names; a place that cannot work raises CheckpointError (one line)."""
        shared_root = storage.as_path(s.checkpoint_dir) / s.experiment
        shared = Place(SHARED, shared_root, setting("checkpoint_dir", s.checkpoint_dir))
        mirror = local = peer = None
        if s.mirror_dir:
            if why := _mirror_refusal(s.checkpoint_dir, s.mirror_dir, s.experiment):
                raise CheckpointError(why)
            mirror = Place(MIRROR, storage.as_path(s.mirror_dir) / s.experiment, setting("mirror_dir", s.mirror_dir))
        if s.local_dir:
            if why := _local_refusal(s):
                raise CheckpointError(why)
            root = tier_root(s.local_dir, s.experiment, str(shared_root))
            local = Place(LOCAL, root, setting("local_dir", s.local_dir))
            if s.peer:
                peer = Place(PEER, root / PEER_DIR, f"{local.setting} (peer copies)")
        elif s.peer:
            raise CheckpointError(f"{setting('peer', True)} needs {setting('local_dir')}: the peer copy is a second "
                                  "copy of the node-local tier's steps, on the next node")
        return cls(shared, local, peer, mirror)

    @property
    def ordered(self) -> list[Place]:
        """Nearest first."""
        return [p for p in (self.local, self.peer, self.shared, self.mirror) if p is not None]

    @property
    def copies(self) -> list[Place]:
        """The places that receive copies of the run folder's committed steps (rank 0 copies them): the mirror."""
        return self.whole_steps[1:]

    @property
    def whole_steps(self) -> list[Place]:
        """The places that hold whole steps (every rank's part in one folder), where `latest` is looked for on any
        rank: the shared run folder, then its mirror."""
        return [p for p in (self.shared, self.mirror) if p is not None]


class Replica:
    """One node-local copy of this rank's committed steps, as the node-local place (nodelocal.py) iterates them: the
    rank's own folder in its node's tier (tier.LocalTier) and the copy on the next node (peer.PeerCopy). A copy answers
    what concerns it; the defaults are those of a copy with nothing to send, protect, restore or say."""

    def submit(self, step: int, step_dir: Path | None) -> None:
        """``step_dir``: this rank's part of ``step``, committed in its tier, for the copy to take; None: this rank's
        save of ``step`` failed (a copy paired with another rank's tells it so)."""

    def protected(self) -> set[int]:
        """The local steps the copy still reads: the tier's retention keeps them."""
        return set()

    def restore(self, local: dict[int, layout.CheckpointInfo], floor: Callable[[], int | None],
                forks: list | None = None, *, below: int | None = None) -> list[int]:
        """Collective, at a restart: parts newer than ``floor()`` (a collective too, asked only by a copy that
        restores) that this rank lacks, brought into its tier and added to ``local``; the ranks that got one."""
        return []

    def retire_newer(self, step: int) -> None:
        """The run continues from ``step``: newer copies belong to a line it left."""

    def leave(self) -> None:
        """The process group failed (in-process recovery): stop without another collective."""

    def close(self) -> None:
        """The run ends: what is in flight finishes (bounded)."""

    def clear(self) -> None:
        """The run's final step is in the shared tier (or the run starts afresh): the copies have done their job."""

    def summary(self) -> str:
        return ""


def _local_refusal(s: "Settings") -> str | None:
    """Why the node-local tier cannot work with these settings, in one line, or None."""
    if not storage.medium(s.local_dir).filesystem:
        return f"{setting('local_dir', s.local_dir)} must be a folder on each node (/dev/shm/..., a local NVMe disk)"
    if s.local_every < 0 or s.local_keep < 1:
        return f"{setting('local_every')} must be at least 0 and {setting('local_keep')} at least 1"
    if s.local_every and s.when.every_steps % s.local_every:
        return (f"{setting('when.every_steps', s.when.every_steps)} must be a multiple of "
                f"{setting('local_every', s.local_every)}: the shared tier receives local steps")
    local = Path(s.local_dir).resolve()
    if storage.medium(s.checkpoint_dir).filesystem and local == Path(s.checkpoint_dir).resolve():
        return f"{setting('local_dir')} must differ from {setting('checkpoint_dir')} (the shared tier)"
    return None


def _mirror_refusal(checkpoint_dir: str, mirror_dir: str, experiment: str) -> str | None:
    """Why ``--mirror-dir`` cannot be used with ``--checkpoint-dir``, in one line, or None."""
    p_root, m_root = storage.as_path(checkpoint_dir) / experiment, storage.as_path(mirror_dir) / experiment
    primary, mirror = storage.medium(p_root).location(p_root), storage.medium(m_root).location(m_root)
    in_primary, in_mirror = storage.within(m_root, p_root), storage.within(p_root, m_root)
    if in_primary and in_mirror:
        alias = "" if primary == mirror else f" under another name (run folders {primary} and {mirror})"
        return (f"{setting('mirror_dir', mirror_dir)} is the {setting('checkpoint_dir')} itself{alias}; give the "
                "mirror another location (e.g. the shared filesystem or s3://bucket/prefix)")
    if in_primary or in_mirror:
        return (f"{setting('mirror_dir', mirror_dir)} and {setting('checkpoint_dir', checkpoint_dir)} hold one another "
                f"(run folders {primary} and {mirror}); give the mirror a separate location")
    return None
