"""Where checkpoint files live: the local filesystem (``pathlib.Path``, via fsio) or an S3 object store (:class:`S3Path`).

layout.py and manager.py work on *paths*; they call the few functions below for what differs between the two, and
``as_path`` turns ``--checkpoint-dir`` into the right kind. For a local ``Path`` every function is exactly the fsio
primitive it replaces (atomic write + fsync, directory fsync, streamed checksum, rmtree), so the local path is unchanged.

S3 (``s3://bucket/prefix``; the ``s3`` extra, s3torchconnector) is configured by the standard AWS variables:
``AWS_ENDPOINT_URL`` (e.g. a MinIO/SeaweedFS/Ceph endpoint; path-style addressing is then used), ``AWS_REGION`` (or
``AWS_DEFAULT_REGION``; default us-east-1), ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` or ``AWS_PROFILE``.
An object store has no rename, no fsync and no directories, and needs none of them here: an object becomes visible
whole when its upload completes (so every write is atomic), "directories" are key prefixes, and S3 reads are strongly
consistent after writes. The commit protocol is the same: part records, then manifest, then COMMITTED, written last.

S3 errors become ``OSError`` with one readable line (``FileNotFoundError`` for a missing key), so the manager reports a
failed save exactly like a failed local write.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from .errors import CheckpointError
from .fsio import CHECKSUM_ALGORITHM, ChecksumWriter, atomic_write, checksum_file, fsync_dir, new_hasher, read_verified

S3_SCHEME = "s3://"
_CHUNK = 8 << 20


# --- dispatch: one function per operation that differs -------------------------------------------------------------


def as_path(p: "str | os.PathLike | S3Path") -> "Path | S3Path":
    """``s3://bucket/key`` (or an S3Path) -> S3Path; anything else -> pathlib.Path."""
    if isinstance(p, S3Path):
        return p
    if isinstance(p, str) and p.startswith(S3_SCHEME):
        return S3Path.from_uri(p)
    return Path(p)


def is_remote(p) -> bool:
    return isinstance(p, S3Path) or (isinstance(p, str) and p.startswith(S3_SCHEME))


def write_with(path, fill: Callable[[ChecksumWriter], None]) -> dict:
    """Write ``path`` durably and atomically via ``fill(writer)``; return its ``{"size", <algorithm>}`` record."""
    if isinstance(path, S3Path):
        return path.write_with(fill)
    return atomic_write(path, fill)


def write_bytes(path, data: bytes) -> dict:
    return write_with(path, lambda w: w.write(data))


def sync_dir(path) -> None:
    """Make the names in a folder durable (fsync the directory). Object stores: nothing to do."""
    if not isinstance(path, S3Path):
        fsync_dir(path)


def checksum(path, algorithm: str = CHECKSUM_ALGORITHM) -> tuple[int, str]:
    """(size, hex checksum) of a file, streamed."""
    if isinstance(path, S3Path):
        return path.checksum(algorithm)
    return checksum_file(path, algorithm)


def read_checked(path, size: int, algorithm: str, expected: str) -> memoryview:
    """A file's bytes, verified against its manifest record as they arrive (raises CheckpointError if they differ)."""
    if not isinstance(path, S3Path):
        return read_verified(path, size, algorithm, expected)
    data = path.read_bytes()
    if len(data) != size:
        raise CheckpointError(f"{path} has {len(data)} bytes, manifest says {size}: truncated or replaced")
    h = new_hasher(algorithm)
    h.update(data)
    if h.hexdigest() != expected:
        raise CheckpointError(f"{path} fails its checksum ({algorithm}): the file is corrupted")
    return memoryview(data)


def read_chunks(path) -> Iterator[bytes]:
    """A file's bytes, streamed in chunks (local or s3://)."""
    if isinstance(path, S3Path):
        yield from path.read_chunks()
        return
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


def copy_file(src, dst, *, before_chunk: Callable[[], None] | None = None) -> dict:
    """Copy ``src`` to ``dst`` (either local or s3://) durably and atomically, like :func:`write_with`; return the
    record of the bytes written, hashed as they passed. ``before_chunk``: called before each chunk (a test knob)."""
    def fill(w: ChecksumWriter) -> None:
        for chunk in read_chunks(src):
            if before_chunk is not None:
                before_chunk()
            w.write(chunk)

    return write_with(dst, fill)


def strangers(folder, owned: Callable[[str], object]) -> list[str]:
    """What in ``folder`` PyRecover cannot have written: a name ``owned`` refuses, a sub-folder, a symbolic link (never
    followed). The folder itself as a link to elsewhere is a stranger too."""
    if isinstance(folder, S3Path):
        return sorted(p.name + "/" if p.is_dir() else p.name for p in folder.iterdir()
                      if p.is_dir() or not owned(p.name))
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


def check_owned(folder, owned: Callable[[str], object], why: str) -> None:
    """Refuse (CheckpointError, one line) to delete a folder that holds anything PyRecover cannot have written: it
    deletes only what it can prove is its own. ``why``: what the user can do instead."""
    found = strangers(folder, owned)
    if found:
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        raise CheckpointError(f"{folder} holds {', '.join(found[:3])}{more}, which PyRecover did not write, so it "
                              f"is not deleted; {why}")


def rmtree(path) -> None:
    """Remove a folder and everything under it; best effort, like ``shutil.rmtree(ignore_errors=True)``. Only for
    what is provably ours: a staging folder by its name, or a folder :func:`check_owned` passed."""
    if isinstance(path, S3Path):
        try:
            path.rmtree()
        except OSError:
            pass
    else:
        shutil.rmtree(path, ignore_errors=True)


# --- S3 -------------------------------------------------------------------------------------------------------------


def region() -> str:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"


def client_config():
    """S3ClientConfig for s3torchconnector: path-style addressing when a custom endpoint is set (MinIO, SeaweedFS,
    Ceph...; there is no environment variable for it), else the defaults (virtual-hosted style on AWS)."""
    from s3torchconnector import S3ClientConfig

    return S3ClientConfig(force_path_style=True) if os.environ.get("AWS_ENDPOINT_URL") else S3ClientConfig()


_client = None


def client():
    """One s3torchconnector client per process (it is thread-safe and re-creates itself after a fork)."""
    global _client
    if _client is None:
        try:
            from s3torchconnector._s3client import S3Client
        except ImportError as e:
            raise CheckpointError(
                f"s3:// checkpoint directories need the s3 extra ({e}): pip install 's3torchconnector[dcp]'"
            ) from None
        _client = S3Client(region(), s3client_config=client_config())
    return _client


def s3_error(exc: BaseException, uri: str) -> OSError:
    """An s3torchconnector S3Exception (or anything else from the S3 client) as one readable OSError line."""
    text = str(exc)
    first = (text.strip().splitlines() or [type(exc).__name__])[0]
    bucket = uri[len(S3_SCHEME):].split("/", 1)[0] if uri.startswith(S3_SCHEME) else "?"
    endpoint = os.environ.get("AWS_ENDPOINT_URL", "AWS S3")
    if "The key does not exist" in text or "The object was not found" in text:
        return FileNotFoundError(errno.ENOENT, "no such object", uri)
    if "NoSuchBucket" in text or "The bucket does not exist" in text:
        return OSError(errno.ENOENT, f"S3 bucket {bucket!r} does not exist at {endpoint}", uri)
    if "No signing credentials" in text:
        return OSError(errno.EACCES, "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
                                     "AWS_PROFILE)", uri)
    if "Forbidden" in text or "AccessDenied" in text or "InvalidAccessKeyId" in text:
        return OSError(errno.EACCES, f"S3 at {endpoint} rejected the credentials or denied access to bucket "
                                     f"{bucket!r} ({first[:160]}); check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY", uri)
    return OSError(errno.EIO, f"S3 request to {endpoint} failed: {first[:200]}", uri)


@dataclass(frozen=True)
class _Stat:
    st_size: int


class S3Path:
    """The subset of ``pathlib.Path`` that layout.py and manager.py use, over ``s3://bucket/key``.

    Deliberately not ``os.PathLike``: passing one to ``open()`` or ``Path()`` fails loudly instead of silently writing a
    local folder called ``s3:``.
    """

    def __init__(self, bucket: str, key: str = "", *, is_dir_hint: bool | None = None):
        self.bucket = bucket
        self.key = key.strip("/")
        self._is_dir_hint = is_dir_hint

    @classmethod
    def from_uri(cls, uri: str) -> "S3Path":
        rest = uri[len(S3_SCHEME):]
        bucket, _, key = rest.partition("/")
        if not bucket:
            raise CheckpointError(f"{uri!r} names no bucket; use s3://BUCKET/PREFIX")
        return cls(bucket, key)

    # -- pure path operations --
    def __str__(self) -> str:
        return f"{S3_SCHEME}{self.bucket}/{self.key}" if self.key else f"{S3_SCHEME}{self.bucket}"

    def __repr__(self) -> str:
        return f"S3Path({str(self)!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, S3Path) and (self.bucket, self.key) == (other.bucket, other.key)

    def __hash__(self) -> int:
        return hash((self.bucket, self.key))

    def __truediv__(self, name: str) -> "S3Path":
        name = str(name).strip("/")
        return S3Path(self.bucket, f"{self.key}/{name}" if self.key else name)

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1] if self.key else ""

    @property
    def parent(self) -> "S3Path":
        return S3Path(self.bucket, self.key.rsplit("/", 1)[0] if "/" in self.key else "")

    def with_name(self, name: str) -> "S3Path":
        return self.parent / name

    @property
    def _prefix(self) -> str:
        return f"{self.key}/" if self.key else ""

    # -- requests --
    def _call(self, fn, *args):
        try:
            return fn(*args)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - s3torchconnector.S3Exception and client-construction errors
            raise s3_error(e, str(self)) from None

    def _list(self, prefix: str, delimiter: str = "", max_keys: int = 1000) -> Iterator:
        def pages():
            return list(client().list_objects(self.bucket, prefix, delimiter, max_keys))

        if max_keys < 1000:  # a probe: the first page is enough
            def first():
                return next(iter(client().list_objects(self.bucket, prefix, delimiter, max_keys)), None)

            page = self._call(first)
            return [page] if page is not None else []
        return self._call(pages)

    def _keys(self) -> list[str]:
        return [o.key for page in self._list(self._prefix) for o in page.object_info]

    def is_file(self) -> bool:
        try:
            self._call(client().head_object, self.bucket, self.key)
            return True
        except FileNotFoundError:
            return False

    def is_dir(self) -> bool:
        if self._is_dir_hint is not None:
            return self._is_dir_hint
        return any(page.object_info or page.common_prefixes for page in self._list(self._prefix, max_keys=1))

    def exists(self) -> bool:
        return (bool(self.key) and self.is_file()) or self.is_dir()

    def iterdir(self) -> Iterator["S3Path"]:
        """Children one level down: common prefixes are folders, objects are files."""
        out = []
        for page in self._list(self._prefix, "/"):
            for p in page.common_prefixes:
                out.append(S3Path(self.bucket, p, is_dir_hint=True))
            for o in page.object_info:
                if o.key != self._prefix:  # SeaweedFS lists a folder's own marker key
                    out.append(S3Path(self.bucket, o.key, is_dir_hint=False))
        return iter(out)

    def stat(self) -> _Stat:
        return _Stat(int(self._call(client().head_object, self.bucket, self.key).size))

    def read_bytes(self) -> bytes:
        return self._call(lambda: client().get_object(self.bucket, self.key).read())

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def read_chunks(self) -> Iterator[bytes]:
        try:
            reader = client().get_object(self.bucket, self.key)
            while chunk := reader.read(_CHUNK):
                yield chunk
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - as in _call
            raise s3_error(e, str(self)) from None

    def checksum(self, algorithm: str = CHECKSUM_ALGORITHM) -> tuple[int, str]:
        h, size = new_hasher(algorithm), 0
        for chunk in self.read_chunks():
            h.update(chunk)
            size += len(chunk)
        return size, h.hexdigest()

    def write_with(self, fill: Callable[[ChecksumWriter], None]) -> dict:
        """Upload what ``fill`` writes; the object appears (whole) when the upload completes, so this is atomic."""
        def upload() -> ChecksumWriter:
            with client().put_object(self.bucket, self.key) as raw:
                writer = ChecksumWriter(raw)
                fill(writer)
            return writer

        return self._call(upload).record()

    def write_bytes(self, data: bytes) -> dict:
        return self.write_with(lambda w: w.write(data))

    def unlink(self, missing_ok: bool = False) -> None:
        self._call(client().delete_object, self.bucket, self.key)  # deleting a missing key is not an error on S3

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Folders are key prefixes: nothing to create."""

    def rename(self, target: "S3Path") -> "S3Path":
        """Move every object under this prefix (S3 has no rename): copy them all, then delete, the commit marker
        first -- a crash part-way leaves the source whole or uncommitted, never committed with objects missing."""
        keys = self._keys()
        for key in keys:
            self._call(client().copy_object, self.bucket, key, target.bucket, target._prefix + key[len(self._prefix):])
        for key in sorted(keys, key=lambda k: k.rsplit("/", 1)[-1] != "COMMITTED"):
            self._call(client().delete_object, self.bucket, key)
        return target

    def rmtree(self) -> None:
        for key in self._keys():
            self._call(client().delete_object, self.bucket, key)
        # SeaweedFS keeps an emptied folder listed as a common prefix until its marker key "prefix/" is deleted (a
        # no-op on AWS S3). Never treat a prefix as a checkpoint by itself anyway: COMMITTED decides.
        self._call(client().delete_object, self.bucket, self._prefix)

    def ensure_writable(self) -> None:
        """Startup check: the bucket exists, the credentials work, and we may write (probe object put + delete)."""
        try:
            self._list(self._prefix, "/", max_keys=1)
            probe = self / f".write-probe-{os.getpid()}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            raise CheckpointError(f"checkpoint directory {self} is not usable: {e.strerror}; check the bucket and "
                                  "the AWS_* variables (AWS_ENDPOINT_URL, AWS_REGION, credentials)") from None
