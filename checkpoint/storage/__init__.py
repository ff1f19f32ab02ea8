"""Where checkpoint bytes live, as plugins: one :class:`Medium` per kind of storage (posix.py: any POSIX filesystem;
s3.py: object storage), chosen once from a location by :func:`medium`. The functions below are what the layout, the
backends and the mirror call; none of them asks which medium it is."""

from __future__ import annotations

import os
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


__all__ = ["MEDIA", "Medium", "S3Path", "as_path", "check_owned", "checksum", "client_config", "copy_file", "is_link",
           "medium", "read_checked", "read_chunks", "read_small", "region", "rmtree", "sync_dir", "within",
           "write_bytes", "write_with"]
