"""What a storage medium must do for a checkpoint folder: durable atomic writes, verified reads, listing what is not
ours, deletion, and the two questions the layout asks of a location. One subclass per medium, one file each; the
layout above never asks which medium it is writing to, only whether the medium is a filesystem (atomic rename, exclusive
create, links: see route.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Iterator

from ..fsio import CHECKSUM_ALGORITHM, ChecksumWriter

CHUNK = 8 << 20  # streamed reads and copies


class Medium(ABC):
    name: ClassVar[str]
    # A POSIX filesystem: rename is atomic (a save is written aside and published by rename), exclusive create works
    # (the run directory's lease), and paths are what the OS opens. Otherwise (object storage) a save is written in
    # place and COMMITTED, written last, is what publishes it.
    filesystem: ClassVar[bool]

    @abstractmethod
    def claims(self, p: Any) -> bool:
        """``p`` (a str or a path object) names a location on this medium."""

    @abstractmethod
    def path(self, p: Any) -> Any:
        """``p`` as this medium's path object (``/`` joins, ``exists``, ``iterdir``, ``read_bytes``, ``rename``...)."""

    @abstractmethod
    def write_with(self, path, fill: Callable[[ChecksumWriter], None], *, sync_dir: bool = True) -> dict:
        """Write ``path`` durably and atomically via ``fill(writer)``: the whole file or nothing is ever seen there.
        ``sync_dir`` False: the caller makes the folder's names durable once, after several files. Returns the
        file's ``{"size", <algorithm>}`` record."""

    @abstractmethod
    def sync_dir(self, path) -> None:
        """Make the names in a folder durable."""

    @abstractmethod
    def checksum(self, path, algorithm: str = CHECKSUM_ALGORITHM) -> tuple[int, str]:
        """(size, hex checksum) of a file, streamed."""

    @abstractmethod
    def read_checked(self, path, size: int, algorithm: str, expected: str) -> memoryview:
        """A file's bytes, verified against its record as they arrive (CheckpointError if they differ)."""

    def read_small(self, path) -> bytes:
        """A small file's bytes whole (a manifest, a commit marker), unverified: what a checksum then covers."""
        return path.read_bytes()

    def connect(self) -> None:
        """Make, on the calling thread, what this medium's first access needs (a client, its imports), so that later
        accesses from other threads import nothing."""

    def prefetch(self, path, size: int, stopped: Callable[[], bool]) -> int:
        """Read ``path`` (``size`` bytes) ahead of a load that will read it (storage.ReadAhead), checking
        ``stopped()`` between chunks; the bytes read. Nothing read here is trusted: the load's ``read_checked`` still
        verifies every byte. The default reads nothing."""
        return 0

    def forget(self, path, size: int) -> None:
        """Drop what ``prefetch`` kept of ``path`` and the load did not take."""

    @abstractmethod
    def read_chunks(self, path) -> Iterator[bytes]:
        """A file's bytes, streamed."""

    @abstractmethod
    def strangers(self, folder, owned: Callable[[str], object]) -> list[str]:
        """What in ``folder`` PyRecover cannot have written: a name ``owned`` refuses, a sub-folder, a link."""

    @abstractmethod
    def rmtree(self, path) -> None:
        """Remove a folder and everything under it, best effort."""

    @abstractmethod
    def is_link(self, path) -> bool:
        """``path`` is a symbolic link (never followed: a checkpoint's files are inside its folder)."""

    @abstractmethod
    def within(self, inner, outer) -> bool:
        """``inner`` is the folder ``outer`` or inside it, however either is spelled."""

    @abstractmethod
    def location(self, path) -> str:
        """``path`` in the one spelling used to compare and report locations."""

    @abstractmethod
    def ensure_writable(self, root) -> None:
        """Fail now (CheckpointError, one line), not at the first save, if ``root`` cannot be written."""

    def os_error(self, exc: BaseException, path) -> OSError | None:
        """The medium's own client exception (raised inside a library such as DCP) as one readable OSError, or None
        if ``exc`` is not one."""
        return None

    def describe(self, root) -> str | None:
        """One line for the log on how bytes land under ``root``, if there is anything to say."""
        return None

    @abstractmethod
    def dcp_writer(self, path):
        """torch.distributed.checkpoint's storage writer for ``path``."""

    @abstractmethod
    def dcp_reader(self, path, safe_mixin: type):
        """torch.distributed.checkpoint's storage reader for ``path``, with ``safe_mixin`` first in its bases."""
