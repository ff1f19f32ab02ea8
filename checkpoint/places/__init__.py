"""Where a run's committed steps live, nearest first. Every place is derived here, once, from the run's settings: no
other module turns a setting into a place's folder.

    place    its root (the run's folder there)            written by                 holds
    local    <local-dir>/<experiment>-<key>/               each rank, its own part    rank-N/step-M (tier.py)
    peer     <local-dir>/<experiment>-<key>/peer/          the buddy node's ranks     rank-N/step-M (peer.py)
    shared   <checkpoint-dir>/<experiment>/                every rank; rank 0 commits step-M (manager.py)
    mirror   <mirror-dir>/<experiment>/                    rank 0                     step-M (mirror.py)

``key`` names the shared run folder that the node-local places cache, so two runs of one experiment name on a node
(another --checkpoint-dir, the same --local-checkpoint-dir) neither sweep, retire nor count each other's steps.

A place's refusal (a local tier on object storage, a mirror inside the run folder) is one line, raised when the places
are built: before any file is touched.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar

from .. import storage
from ..errors import CheckpointError
from ..naming import setting

if TYPE_CHECKING:
    from ..settings import Settings

LOCAL, PEER, SHARED, MIRROR = "local", "peer", "shared", "mirror"
T = TypeVar("T")
PEER_DIR = "peer"


def rank_dir_name(rank: int) -> str:
    return f"rank-{rank:05d}"


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

    def first(self, *, node_local: Callable[[], T], run_folder: Callable[[], T]) -> T:
        """The machinery of the place every save lands in first: ``node_local()`` where the run has node-local
        places (which carry each step on to the run folder), else ``run_folder()``."""
        return node_local() if self.local is not None else run_folder()

    @property
    def copies(self) -> list[Place]:
        """The places that receive copies of the run folder's committed steps (rank 0 copies them): the mirror."""
        return self.whole_steps[1:]

    @property
    def whole_steps(self) -> list[Place]:
        """The places that hold whole steps (every rank's part in one folder), where `latest` is looked for on any
        rank: the shared run folder, then its mirror."""
        return [p for p in (self.shared, self.mirror) if p is not None]


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
