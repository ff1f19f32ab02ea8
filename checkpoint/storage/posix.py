"""A POSIX filesystem (local disk, Lustre, GPFS, NFS, tmpfs): every write goes through fsio (temporary name, fsync,
rename, fsync of the folder; O_DIRECT where the filesystem takes it), and rename is atomic, so a checkpoint is
written aside and published whole (route.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

from ..errors import CheckpointError
from ..naming import setting
from ..fsio import (CHECKSUM_ALGORITHM, ChecksumWriter, atomic_write, checksum_file, fsync_dir, io_mode,
                    make_dirs, open_regular, read_regular, read_verified)
from .base import CHUNK, Medium


class Posix(Medium):
    name = "posix"
    filesystem = True

    def claims(self, p) -> bool:
        return True  # the medium of every path no other medium claims

    def path(self, p) -> Path:
        return Path(p)

    def write_with(self, path, fill: Callable[[ChecksumWriter], None], *, sync_dir: bool = True) -> dict:
        return atomic_write(path, fill, fsync_parent=sync_dir)

    def sync_dir(self, path) -> None:
        fsync_dir(path)

    def checksum(self, path, algorithm: str = CHECKSUM_ALGORITHM) -> tuple[int, str]:
        return checksum_file(path, algorithm)

    def read_checked(self, path, size: int, algorithm: str, expected: str) -> memoryview:
        return read_verified(path, size, algorithm, expected)

    def prefetch(self, path, size: int, stopped: Callable[[], bool]) -> int:
        """Through the page cache, the bytes dropped: the load's mapping then finds them there."""
        try:
            fd, _ = open_regular(path)  # a regular file only, never through a link, never waiting on a FIFO
        except (OSError, CheckpointError):
            return 0  # the load names what is wrong with it, in its words
        buf, done = bytearray(min(CHUNK, size)), 0
        try:
            while done < size and not stopped():
                n = os.preadv(fd, [buf], done)
                if n <= 0:
                    break
                done += n
        except OSError:
            pass
        finally:
            os.close(fd)
        return done

    def read_small(self, path) -> bytes:
        return read_regular(path)  # never through a link, never waiting on a FIFO

    def read_chunks(self, path) -> Iterator[bytes]:
        fd, _ = open_regular(path)
        with open(fd, "rb") as f:
            while chunk := f.read(CHUNK):
                yield chunk

    def strangers(self, folder, owned: Callable[[str], object]) -> list[str]:
        folder = Path(folder)
        if folder.is_symlink():
            return [f"{folder.name} itself (a symbolic link to {os.readlink(folder)})"]
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            return []
        found = []
        for e in entries:
            if e.is_symlink():
                found.append(f"{e.name} (a symbolic link)")
            elif e.is_dir(follow_symlinks=False):
                found.append(e.name + "/")
            elif not owned(e.name):
                found.append(e.name)
        return sorted(found)

    def rmtree(self, path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def is_link(self, path) -> bool:
        return Path(path).is_symlink()

    def within(self, inner, outer) -> bool:
        # one folder can have several names (a bind mount, a symbolic link): ask the kernel, not the strings
        (inner_chain, inner_missing), (outer_chain, outer_missing) = _where(os.path.realpath(inner)), _where(os.path.realpath(outer))
        if not outer_missing:  # outer exists: inner is in it if inner's path goes through it
            return outer_chain[0] in inner_chain
        # outer does not exist yet, so neither does anything in it: inner hangs below the same existing folder
        return inner_chain[0] == outer_chain[0] and inner_missing[:len(outer_missing)] == outer_missing

    def location(self, path) -> str:
        return os.path.realpath(path)

    def ensure_writable(self, root) -> None:
        probe = Path(root) / f".write-probe-{os.getpid()}"
        try:
            make_dirs(Path(root))
            try:
                probe.write_bytes(b"ok")
            finally:  # a full disk creates the file and then fails the write: never leave it behind
                probe.unlink(missing_ok=True)
        except OSError as e:
            raise CheckpointError(
                f"checkpoint directory {root} is not writable ({e.strerror or e}); free space or fix its permissions "
                f"there, or pass {setting('checkpoint_dir')} pointing to a writable path") from None

    def describe(self, root) -> str:
        return io_mode(Path(root))  # decided once per filesystem; every save and load then uses it

    def dcp_writer(self, path):
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(path, sync_files=True)

    def dcp_reader(self, path, safe_mixin: type):
        if safe_mixin not in _reader_cls:
            from torch.distributed.checkpoint import FileSystemReader

            _reader_cls[safe_mixin] = type("_SafeFileSystemReader", (safe_mixin, FileSystemReader), {})
        return _reader_cls[safe_mixin](path)


_reader_cls: dict[type, type] = {}


def _where(path: str) -> tuple[list[tuple[int, int]], tuple[str, ...]]:
    """A path as the kernel sees it: (device, inode) of its nearest existing folder and of every folder above that
    one, and the names below it that do not exist yet (a run folder is often created later)."""
    head, missing = path, []
    while True:
        try:
            st = os.stat(head)
            break
        except OSError:  # not there (or not searchable): compare by name from the folder above
            head, name = os.path.split(head)
            missing.insert(0, name)
    chain = [(st.st_dev, st.st_ino)]
    while head != os.path.dirname(head):
        head = os.path.dirname(head)
        st = os.stat(head)
        chain.append((st.st_dev, st.st_ino))
    return chain, tuple(missing)
