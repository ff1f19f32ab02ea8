"""HOW bytes land: the protocol every backend implements.

A backend writes this rank's *payload* files into a step folder and reports their size/checksum records. It never
writes the manifest or the commit marker: `layout.commit` does that, identically for every backend.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from ..backend_table import ASYNC_ALWAYS, ASYNC_OPTIONAL, Capabilities  # noqa: F401 - torch-free
from ..errors import CheckpointError
from ..state import TENSOR_SECTIONS, CheckpointState, holds_dtensors

@dataclass(frozen=True)
class RankInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def from_main(self, value: Any) -> Any:
        """Rank 0's ``value``, on every rank (a broadcast over the process group; one process: ``value`` itself).
        Every rank calls it at the same point; what the other ranks pass is ignored."""
        if self.world_size > 1 and dist.is_initialized():
            box = [value]
            dist.broadcast_object_list(box, src=0)
            return box[0]
        return value

    def gather(self, value: Any) -> list:
        """Every rank's ``value``, in rank order, on every rank (an all-gather; one process: ``[value]``)."""
        if self.world_size > 1 and dist.is_initialized():
            out = [None] * self.world_size
            dist.all_gather_object(out, value)
            return out
        return [value]


class PayloadHandle(ABC):
    """What `Backend.save` returns. ``wait_staged`` returns once the state has been captured (the model and optimizer may
    change again); ``wait`` returns this rank's file records once they are durable, re-raising any background error."""

    @abstractmethod
    def wait_staged(self) -> None: ...

    @abstractmethod
    def wait(self) -> dict[str, dict]: ...

    @abstractmethod
    def done(self) -> bool: ...


class CompletedPayload(PayloadHandle):
    """A synchronous save: everything already happened."""

    def __init__(self, files: dict[str, dict]):
        self._files = files

    def wait_staged(self) -> None:
        pass

    def wait(self) -> dict[str, dict]:
        return self._files

    def done(self) -> bool:
        return True


class BackgroundTask:
    """Run ``fn`` in a daemon thread; ``wait()`` returns its result or re-raises its exception in the caller."""

    def __init__(self, fn: Callable[[], object], name: str):
        self._result: object = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            self._result = fn()
        except BaseException as e:  # re-raised by wait() in the training thread
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> object:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


class Backend(ABC):
    name: str = "?"
    #: how many saves may be in flight at once (1 = the next save waits for the previous one)
    max_in_flight: int = 1
    #: a save overwrites the files handed to it (``save``'s ``spares``) instead of making new ones: only then does the
    #: local tier keep a retired step's payload files for it (tier.Spares)
    reuses_files: bool = False

    # --- capabilities (class attributes; mirrored in backends.CAPABILITIES, readable without importing the backend's
    # module: a subclass whose values differ from that table fails at its definition) ---
    #: saves *sharded* state: every rank writes its own share (FSDP shards as DTensors), so the model/optimizer pieces
    #: are built with ``ModelState(model, sharded=True)`` / ``OptimizerState(model, optimizer, sharded=True)``.
    #: False: one full copy, gathered on and written by rank 0 (pieces with ``sharded=False``).
    sharded: bool = False
    #: can write to object storage (``--checkpoint-dir s3://...``)
    remote_ok: bool = False
    #: when saves persist in the background (training continues while the bytes land): None = never (every save is
    #: durable when ``save`` returns); ASYNC_OPTIONAL = when asked (--async-checkpoint, the ``async_save`` option);
    #: ASYNC_ALWAYS = always, by design (nothing to ask for: --async-checkpoint is refused as meaningless)
    asynchronous: str | None = None

    def __init__(self, rank: RankInfo):
        self.rank = rank

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        from . import CAPABILITIES  # the package is initialised before any backend module is imported

        declared = CAPABILITIES.get(cls.name)
        if declared is not None and declared != cls.capabilities():
            raise TypeError(f"{cls.__name__} declares {cls.capabilities()}, but checkpoint.backends.CAPABILITIES"
                            f"[{cls.name!r}] says {declared}: keep the two equal")

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities(sharded=cls.sharded, remote_ok=cls.remote_ok, asynchronous=cls.asynchronous)

    @staticmethod
    def read_section(step_dir: Path, manifest: dict, section: str) -> dict[str, Any]:
        """One section (model, optimizer, ...) of a committed checkpoint written by this backend, as the nested state
        dict of full tensors, in this process, with no process group and no model (checkpoint/reader.py)."""
        raise NotImplementedError

    @staticmethod
    def write_sections(step_dir: Path, sections: dict[str, dict]) -> dict[str, dict]:
        """Write full state dicts ``{section: state_dict}`` (model, optimizer) in this backend's format under
        ``step_dir`` (any medium), as one rank would; return their size/checksum records (convert.py)."""
        raise NotImplementedError

    #: how this backend's load reads one verified file (``(path, bytes) -> object``): layout.verify then parses each
    #: file while it reads the next, for the load that follows. None: the load reads the bytes itself
    parse_file: Callable[[Path, memoryview], Any] | None = None

    @staticmethod
    def files_read(manifest: dict, rank: int) -> list[str]:
        """The manifest's files that a load on ``rank`` reads whole: what a restart reads ahead while it sets up
        (Session.read_ahead). The default: none known before the load plans its reads (DCP)."""
        return []

    @staticmethod
    def write_pieces(step_dir: Path, pieces: dict[str, dict], rank: int) -> dict[str, dict]:
        """Write ``{file name: state dict}`` as this rank's files, durably; return their records. Formats of one
        torch file per piece only (the just-in-time save writes the run's files this way, manager.save_alone)."""
        raise NotImplementedError

    @staticmethod
    def check_files(step_dir: Path, manifest: dict) -> None:
        """What ``verify`` cannot see from the manifest alone: every file this backend's load would open, as named
        inside its own payload (DCP's ``.metadata``), must be one the manifest records, inside the folder (through
        layout.member); else CheckpointError. The default: the backend opens only the manifest's names."""

    def check_state(self, state: CheckpointState) -> None:
        """Refuse model/optimizer pieces built for the other mode than this backend saves (``sharded``) where the
        modes differ -- a model holding DTensors (FSDP); for any other model both give the same plain tensors. Called
        at the start of ``save``."""
        for key in TENSOR_SECTIONS:
            piece = state.get(key)
            mode = getattr(piece, "sharded", None)
            if mode is None or mode == self.sharded or not holds_dtensors(piece.model):
                continue
            raise CheckpointError(f"the {self.name} backend saves {'sharded' if self.sharded else 'full'} state, but "
                                  f"the {key} piece was built with sharded={mode}; build it with "
                                  f"{type(piece).__name__}(..., sharded={self.sharded})")

    @abstractmethod
    def save(self, step_dir: Path, state: CheckpointState, *, shared: bool | None = None,
             spares=None) -> PayloadHandle:
        """Write this rank's share of ``state`` under ``step_dir`` (already created). ``shared``: this rank writes
        the shared (replicated) pieces of a non-sharded state (None: rank 0; in the node-local tier every node's first
        rank, so each node can restore from its own memory). ``spares``: files the save may overwrite instead of
        creating new ones (``take(nbytes) -> Path | None``: the local tier's retired payload files, tier.Spares)."""

    @abstractmethod
    def load(self, step_dir: Path, manifest: dict, state: CheckpointState, *, verified: dict | None = None) -> None:
        """Restore ``state`` in place from a verified checkpoint folder. ``verified``: the bytes verify() already read
        and checked, by path (CheckpointInfo.verified); a file not there is read and verified as it arrives."""


    def close(self) -> None:
        """Release background resources; in-flight saves have been waited for by the manager."""
