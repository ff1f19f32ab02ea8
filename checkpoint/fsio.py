"""Durable file primitives: every byte a checkpoint writes goes through here.

The rule (POSIX): data is durable only after fsync of the file; a *name* is durable only after fsync of the directory
that holds it. So a file is written under a temporary name, flushed and fsynced, renamed into place with
``os.replace`` (atomic on one filesystem), and then the directory is fsynced. A reader therefore sees either the old
state or the complete new file, never a torn one.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import uuid
import zlib
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

CHECKSUM_ALGORITHM = "crc32"
_CHUNK = 8 << 20
WRITE_BEHIND = 16 << 20  # atomic_write starts writeback every this many bytes (ChecksumWriter._start_writeback)


# --- CRC-32 arithmetic ----------------------------------------------------------------------------------------------
# zlib.crc32(A + B) == _crc_mul(_x_pow_8n(len(B)), crc32(A)) ^ crc32(B). So a checksum computed elsewhere (the
# concurrent backend's checksum thread) joins the running one without a second pass, and a zip entry's crc32 follows
# from the whole-file crc32 before and after it. Polynomials are bit-reflected as in zlib (bit 31 is x^0).
_CRC_POLY = 0xEDB88320


def _crc_mul(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC-32 polynomial."""
    product = 0
    for bit in range(31, -1, -1):
        if a & (1 << bit):
            product ^= b
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1
    return product


_X_POW_2K = [1 << 30]  # x^(2^k) mod P; x^1 is bit 30
for _ in range(63):
    _X_POW_2K.append(_crc_mul(_X_POW_2K[-1], _X_POW_2K[-1]))


def _x_pow_8n(nbytes: int) -> int:
    """x^(8 * nbytes) mod P."""
    result, k, n = 1 << 31, 0, 8 * nbytes
    while n:
        if n & 1:
            result = _crc_mul(_X_POW_2K[k], result)
        n >>= 1
        k += 1
    return result


def crc32_of_suffix(crc_all: int, crc_prefix: int, suffix_len: int) -> int:
    """crc32(B) from crc32(A + B), crc32(A) and len(B)."""
    return crc_all ^ _crc_mul(_x_pow_8n(suffix_len), crc_prefix)


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """crc32(A + B) from crc32(A), crc32(B) and len(B) (zlib's crc32_combine)."""
    return _crc_mul(_x_pow_8n(len_b), crc_a) ^ crc_b


class ChecksumWriter:
    """A write-only file wrapper that computes size and checksum of what passes through it.

    Computing the checksum while writing means a save reads nothing back; ``zlib.crc32`` releases the GIL for large
    buffers, so it does not stall a training thread.
    """

    def __init__(self, raw: BinaryIO, write_behind: int = 0):
        self._raw = raw
        self.size = 0
        self.crc = 0
        self.error: OSError | None = None  # the first I/O error, which torch.save's zip writer would mask
        self._write_behind = write_behind
        self._hinted = 0

    def write(self, data, crc: int | None = None) -> int:
        """Write ``data``; ``crc`` = its crc32 if the caller already has it (then no pass over the bytes here)."""
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc) if crc is None else crc32_combine(self.crc, crc, len(view))
        self.size += len(view)
        try:
            written = self._raw.write(view)
        except OSError as e:
            self.error = self.error or e
            raise
        if self._write_behind and self.size - self._hinted >= self._write_behind:
            self._start_writeback()
        return written

    def _start_writeback(self) -> None:
        """Ask the kernel to start writing what we have written so far (POSIX_FADV_DONTNEED starts asynchronous
        writeback of dirty pages on Linux, as PostgreSQL's flush hints do). Without it nothing reaches the disk
        before the final fsync (dirty pages stay below the background threshold), so the disk idles while we write
        and the fsync then waits for everything. Durability is unchanged: the final fsync still decides. A hint
        only: if the file or platform does not support it, it is switched off."""
        try:
            os.posix_fadvise(self._raw.fileno(), self._hinted, self.size - self._hinted, os.POSIX_FADV_DONTNEED)
            self._hinted = self.size
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            self._write_behind = 0

    def flush(self) -> None:
        self._raw.flush()

    # torch.save probes these on file-like objects.
    def tell(self) -> int:
        return self.size

    def seekable(self) -> bool:
        return False

    def writable(self) -> bool:
        return True


def checksum_file(path: Path) -> tuple[int, str]:
    """(size, crc32 hex) of a file, streamed."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, f"{crc:08x}"


def checksum_bytes(data: bytes | memoryview) -> str:
    return f"{zlib.crc32(data):08x}"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")


@contextlib.contextmanager
def atomic_file(path: Path, *, fsync_parent: bool = True) -> Iterator[BinaryIO]:
    """Open a temporary file beside ``path`` for writing; on success flush, fsync, rename it over ``path`` and fsync
    the directory. On any error the temporary file is removed and ``path`` is untouched. The file is a real (seekable)
    file, for writers that patch a header afterwards (dataset.py's token cache)."""
    path = Path(path)
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as raw:
            yield raw
            raw.flush()
            fault_point("after_write_before_fsync", path)
            os.fsync(raw.fileno())
        fault_point("after_fsync_before_rename", path)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise
    if fsync_parent:
        fsync_dir(path.parent)


@contextlib.contextmanager
def real_io_errors(writer: ChecksumWriter) -> Iterator[ChecksumWriter]:
    """Re-raise the writer's own I/O error instead of what a caller turned it into: torch.save reports a failed write
    (e.g. ENOSPC) as "RuntimeError: unexpected pos" from its zip writer's __exit__, so callers could not say "disk
    full" in one line."""
    try:
        yield writer
    except Exception as e:
        if writer.error is not None and e is not writer.error:
            raise writer.error from None
        raise


def atomic_write(path: Path, fill: Callable[[ChecksumWriter], None], *, fsync_parent: bool = True) -> dict:
    """Write ``path`` atomically via ``fill(writer)``; return ``{"size", "crc32"}`` of the bytes written."""
    with atomic_file(path, fsync_parent=fsync_parent) as raw:
        with real_io_errors(ChecksumWriter(raw, write_behind=WRITE_BEHIND)) as writer:
            fill(writer)
    return {"size": writer.size, CHECKSUM_ALGORITHM: f"{writer.crc:08x}"}


def atomic_write_bytes(path: Path, data: bytes, *, fsync_parent: bool = True) -> dict:
    return atomic_write(path, lambda w: w.write(data), fsync_parent=fsync_parent)


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


# --- test-only fault injection -------------------------------------------------------------------------------------
# PYRECOVER_FAULT=<point>[:<n>] makes the process SIGKILL itself the n-th time (default 1st) it reaches <point>.
# PYRECOVER_FAULT=<point>:<n>:error raises an OSError there instead. Used by the fault-injection suite to kill a run at
# named moments inside the save path; never set in normal use. Read once so the hot path pays one dict lookup.
_FAULT = os.environ.get("PYRECOVER_FAULT", "")
_fault_hits: dict[str, int] = {}


def fault_point(name: str, where: object = "") -> None:
    if not _FAULT:
        return
    point, _, rest = _FAULT.partition(":")
    if point != name:
        return
    nth_str, _, action = rest.partition(":")
    nth = int(nth_str or 1)
    _fault_hits[name] = _fault_hits.get(name, 0) + 1
    if _fault_hits[name] != nth:
        return
    if action == "error":
        raise OSError(errno.EIO, f"injected I/O error at {name}", str(where))
    import signal

    print(f"[fault] SIGKILL at {name} ({where})", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
