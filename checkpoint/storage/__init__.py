"""Where checkpoint bytes live, as plugins: one :class:`Medium` per kind of storage (posix.py: any POSIX filesystem;
s3.py: object storage), chosen once from a location by :func:`medium`. The functions below are what the layout, the
backends and the mirror call; none of them asks which medium it is."""

from __future__ import annotations

import os
import threading
from typing import Callable, Iterator

from ..errors import CheckpointError
from ..fsio import CHECKSUM_ALGORITHM, ChecksumWriter
from .base import Medium
from .posix import Posix
from .s3 import S3, S3Path, client_config, region

MEDIA: tuple[Medium, ...] = (S3(), Posix())  # the first that claims a location is its medium; POSIX claims the rest


def medium(p) -> Medium:
    for m in MEDIA:
        if m.claims(p):
            return m
    raise CheckpointError(f"{p}: no storage medium for this location")


def as_path(p: "str | os.PathLike | S3Path"):
    """``--checkpoint-dir`` (or any location) as its medium's path object: ``s3://bucket/key`` an S3Path, else a
    pathlib.Path."""
    return medium(p).path(p)


def write_with(path, fill: Callable[[ChecksumWriter], None], *, sync_dir: bool = True) -> dict:
    """Write ``path`` durably and atomically via ``fill(writer)``; return its ``{"size", <algorithm>}`` record.
    ``sync_dir`` False: the caller syncs the folder once, after several files."""
    return medium(path).write_with(path, fill, sync_dir=sync_dir)


def write_bytes(path, data: bytes) -> dict:
    return write_with(path, lambda w: w.write(data))


def sync_dir(path) -> None:
    medium(path).sync_dir(path)


def checksum(path, algorithm: str = CHECKSUM_ALGORITHM) -> tuple[int, str]:
    return medium(path).checksum(path, algorithm)


def read_checked(path, size: int, algorithm: str, expected: str) -> memoryview:
    return medium(path).read_checked(path, size, algorithm, expected)


def read_small(path) -> bytes:
    """A small file whole (a manifest, a commit marker); on a filesystem only a regular file, never through a link."""
    return medium(path).read_small(path)


def read_chunks(path) -> Iterator[bytes]:
    return medium(path).read_chunks(path)


def copy_file(src, dst, *, before_chunk: Callable[[], None] | None = None) -> dict:
    """Copy ``src`` to ``dst`` (any media) durably and atomically, like :func:`write_with`; return the record of the
    bytes written, hashed as they passed. ``before_chunk``: called before each chunk (a test knob)."""
    def fill(w: ChecksumWriter) -> None:
        for chunk in read_chunks(src):
            if before_chunk is not None:
                before_chunk()
            w.write(chunk)

    return write_with(dst, fill)


class ReadAhead:
    """Reads files ahead of a load, on a background thread, so a restart's checkpoint read overlaps its setup (the
    process group's rendezvous, building the model, importing torch's compiler stack). ``plan()`` runs first, on the
    thread too (listing folders and reading a manifest take time on shared storage as well); it returns what to read,
    ``(label, [(path, size), ...])``, or None. Each file goes through its medium's ``prefetch``: into the page cache
    on a filesystem, into memory that the load's ``read_checked`` takes on object storage. A hint only: the load
    verifies every byte as always. ``then(path)``, if given, runs on the thread after each file read whole (the
    session verifies and parses it there: layout.VerifiedAhead). ``stop()`` ends it after the chunk (or the ``then``)
    in progress, or leaves the daemon thread behind if it does not end within ``timeout`` (a hung network
    filesystem), and the load reads the rest itself; ``release()``, after the load, drops what it fetched and the load
    did not take."""

    def __init__(self, plan: Callable[[], "tuple[str, list[tuple[object, int]]] | None"],
                 then: Callable[[object], None] | None = None):
        self.label, self.files, self.nbytes, self.bytes_read = "", [], 0, 0
        self._plan, self._then = plan, then
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pyrecover-read-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            planned = self._plan()
        except (OSError, CheckpointError, KeyError, ValueError, TypeError):
            planned = None  # the load says what is wrong, in its words
        if planned is None:
            return
        self.label, self.files = planned
        self.nbytes = sum(size for _, size in self.files)
        for path, size in self.files:
            if self._stop.is_set():
                break
            got = medium(path).prefetch(path, size, self._stop.is_set)
            self.bytes_read += got
            if got == size and self._then is not None and not self._stop.is_set():
                self._then(path)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until it has read everything (or found nothing to read); False if ``timeout`` passed first."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> int:
        """End the read-ahead; the bytes it read."""
        self._stop.set()
        self._thread.join(timeout)
        return self.bytes_read

    @property
    def ended(self) -> bool:
        return not self._thread.is_alive()

    def release(self) -> None:
        if self._thread.is_alive():  # left behind by stop(): it may still add what it fetches
            return
        for path, size in self.files:
            medium(path).forget(path, size)


def is_link(path) -> bool:
    return medium(path).is_link(path)


def within(inner, outer) -> bool:
    """``inner`` is the folder ``outer`` or inside it (locations on two media never are)."""
    m = medium(inner)
    return m is medium(outer) and m.within(inner, outer)


def check_owned(folder, owned: Callable[[str], object], why: str) -> None:
    """Refuse (CheckpointError, one line) to delete a folder that holds anything PyRecover cannot have written: it
    deletes only what it can prove is its own. ``why``: what the user can do instead."""
    found = medium(folder).strangers(folder, owned)
    if found:
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        raise CheckpointError(f"{folder} holds {', '.join(found[:3])}{more}, which PyRecover did not write, so it "
                              f"is not deleted; {why}")


def rmtree(path) -> None:
    """Remove a folder and everything under it, best effort. Only for what is provably ours: a staging folder by its
    name, or a folder :func:`check_owned` passed."""
    medium(path).rmtree(path)


__all__ = ["MEDIA", "Medium", "ReadAhead", "S3Path", "as_path", "check_owned", "checksum", "client_config",
           "copy_file", "is_link", "medium", "read_checked", "read_chunks", "read_small", "region", "rmtree",
           "sync_dir", "within", "write_bytes", "write_with"]
