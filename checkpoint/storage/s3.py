"""Object storage (``s3://bucket/prefix``; the ``s3`` extra, s3torchconnector): the medium without rename, fsync or
folders, and without a need for them. An object appears whole when its upload completes (every write is atomic),
"folders" are key prefixes, and reads are strongly consistent after writes; so a checkpoint is written in place and
COMMITTED, written last, is what makes it one.

Configured by the standard AWS variables: ``AWS_ENDPOINT_URL`` (MinIO, SeaweedFS, Ceph...; path-style addressing is
then used), ``AWS_REGION`` (or ``AWS_DEFAULT_REGION``; default us-east-1), ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``
or ``AWS_PROFILE``. S3 errors become ``OSError`` with one readable line (``FileNotFoundError`` for a missing key), so a
failed save reads like a failed local write.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

from ..errors import CheckpointError
from ..fsio import CHECKSUM_ALGORITHM, ChecksumWriter, new_hasher
from .base import CHUNK, Medium

S3_SCHEME = "s3://"


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
    st_mode: int = stat.S_IFREG  # an object is always a plain file


class S3Path:
    """The subset of ``pathlib.Path`` that the checkpoint layout uses, over ``s3://bucket/key``.

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
            while chunk := reader.read(CHUNK):
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


class S3(Medium):
    name = "s3"
    filesystem = False

    def __init__(self):
        self._ahead: dict[tuple[str, int], bytearray] = {}  # prefetched objects, until read_checked takes them
        self._ahead_lock = threading.Lock()

    def connect(self) -> None:
        client()

    def prefetch(self, path: S3Path, size: int, stopped: Callable[[], bool]) -> int:
        """Into memory, kept for the load's ``read_checked`` (which still verifies it); an object cut short by
        ``stopped()`` or of another size is dropped."""
        data, done = bytearray(size), 0
        try:
            for chunk in path.read_chunks():
                if done + len(chunk) > size or stopped():
                    return 0
                data[done:done + len(chunk)] = chunk
                done += len(chunk)
        except (OSError, CheckpointError):
            return 0
        if done != size:
            return 0
        with self._ahead_lock:
            self._ahead[(str(path), size)] = data
        return size

    def forget(self, path: S3Path, size: int) -> None:
        with self._ahead_lock:
            self._ahead.pop((str(path), size), None)

    def claims(self, p) -> bool:
        return isinstance(p, S3Path) or (isinstance(p, str) and p.startswith(S3_SCHEME))

    def path(self, p) -> S3Path:
        return p if isinstance(p, S3Path) else S3Path.from_uri(str(p))

    def write_with(self, path: S3Path, fill: Callable[[ChecksumWriter], None], *, sync_dir: bool = True) -> dict:
        return path.write_with(fill)

    def sync_dir(self, path) -> None:
        """Nothing to make durable: an object is durable when its upload completes."""

    def checksum(self, path: S3Path, algorithm: str = CHECKSUM_ALGORITHM) -> tuple[int, str]:
        return path.checksum(algorithm)

    def read_checked(self, path: S3Path, size: int, algorithm: str, expected: str) -> memoryview:
        with self._ahead_lock:
            data = self._ahead.pop((str(path), size), None)
        if data is None:
            data = path.read_bytes()
        if len(data) != size:
            raise CheckpointError(f"{path} has {len(data)} bytes, manifest says {size}: truncated or replaced")
        h = new_hasher(algorithm)
        h.update(data)
        if h.hexdigest() != expected:
            raise CheckpointError(f"{path} fails its checksum ({algorithm}): the file is corrupted")
        return memoryview(data)

    def read_chunks(self, path: S3Path) -> Iterator[bytes]:
        yield from path.read_chunks()

    def strangers(self, folder: S3Path, owned: Callable[[str], object]) -> list[str]:
        return sorted(p.name + "/" if p.is_dir() else p.name for p in folder.iterdir()
                      if p.is_dir() or not owned(p.name))

    def rmtree(self, path: S3Path) -> None:
        try:
            path.rmtree()
        except OSError:
            pass

    def os_error(self, exc: BaseException, path) -> OSError | None:
        return s3_error(exc, str(path)) if type(exc).__name__ == "S3Exception" else None

    def is_link(self, path) -> bool:
        return False  # keys are names, never links

    def within(self, inner: S3Path, outer: S3Path) -> bool:
        a, b = str(inner).rstrip("/"), str(outer).rstrip("/")
        return a == b or a.startswith(b + "/")

    def location(self, path) -> str:
        return str(path)

    def ensure_writable(self, root: S3Path) -> None:
        root.ensure_writable()

    def dcp_writer(self, path: S3Path):
        from s3torchconnector.dcp import S3StorageWriter

        return S3StorageWriter(region(), str(path), s3client_config=client_config())

    def dcp_reader(self, path: S3Path, safe_mixin: type):
        if safe_mixin not in _reader_cls:
            from s3torchconnector.dcp import S3StorageReader

            _reader_cls[safe_mixin] = type("_SafeS3StorageReader", (safe_mixin, S3StorageReader), {})
        return _reader_cls[safe_mixin](region(), str(path), s3client_config=client_config())


_reader_cls: dict[type, type] = {}
