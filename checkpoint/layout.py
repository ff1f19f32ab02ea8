"""The on-disk contract every backend shares: folders, part records, manifest, commit marker, `latest`, retention.

    <root>/step-00000123/
        ...payload files (backend specific)...
        part-rank-00000.json   one per rank, written after that rank's payload is durable
        manifest.json          written by rank 0 once all part records exist
        COMMITTED              written last; without it the folder is never loaded

A backend only writes payload files and returns their size/checksum records; committing is done here, the same way for
all of them, so `latest`, retention and verification cannot differ between backends.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from . import storage
from .errors import CheckpointError
from .fsio import CHECKSUM_ALGORITHM, atomic_write_bytes, checksum_file, fault_point, fsync_dir  # noqa: F401

FORMAT_VERSION = 1
STEP_DIR_RE = re.compile(r"^step-(\d{8,})$")
MANIFEST = "manifest.json"
COMMITTED = "COMMITTED"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def part_record_name(rank: int) -> str:
    return f"part-rank-{rank:05d}.json"


def safe_relpath(name: str, where: Path) -> str:
    """Refuse manifest entries that would escape the checkpoint folder (absolute paths, `..`)."""
    p = PurePosixPath(name)
    if not name or p.is_absolute() or ".." in p.parts or "\\" in name:
        raise CheckpointError(f"manifest of {where} names an unsafe path {name!r}; the checkpoint was tampered with")
    return name


# --- writing -------------------------------------------------------------------------------------------------------


def write_part_record(step_dir: Path, rank: int, files: dict[str, dict], run_id: str = "", error: str = "") -> None:
    """``error``: this rank's save failed (e.g. disk full); rank 0 then gives up on the commit instead of waiting."""
    record = {"rank": rank, "run_id": run_id, "files": files}
    if error:
        record["error"] = error
    storage.write_bytes(step_dir / part_record_name(rank), json.dumps(record, indent=1, sort_keys=True).encode())


def wait_for_part_records(step_dir: Path, world_size: int, timeout: float, run_id: str = "") -> list[dict]:
    """Rank 0 waits (on the filesystem, not a collective) until every rank's part record of THIS run exists.

    Filesystem coordination lets background writers commit without touching the training process group. Records
    carry the run id so a stale record left by a crashed earlier attempt can never complete a new commit.
    """
    deadline = time.monotonic() + timeout
    paths = [step_dir / part_record_name(r) for r in range(world_size)]
    delay = 0.002
    while True:
        records = [_read_record(p) for p in paths]
        missing = [p for p, r in zip(paths, records) if r is None or r.get("run_id", "") != run_id]
        failed = [r for r in records if r is not None and r.get("run_id", "") == run_id and r.get("error")]
        if failed:
            raise CheckpointError(f"{step_dir}: rank {failed[0]['rank']} failed to write its part ({failed[0]['error']})")
        if not missing:
            return records
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"{step_dir}: ranks {[paths.index(p) for p in missing]} did not finish writing within {timeout:.0f}s"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def _read_record(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def commit(step_dir: Path, step: int, world_size: int, backend: str, parts: list[dict], meta: dict | None = None) -> None:
    """Write manifest then COMMITTED (rank 0 only). After this returns the checkpoint is durable and loadable."""
    files: dict[str, dict] = {}
    for part in parts:
        for name, rec in part["files"].items():
            files[safe_relpath(name, step_dir)] = rec
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "backend": backend,
        "checksum": CHECKSUM_ALGORITHM,
        "files": dict(sorted(files.items())),
        "meta": meta or {},
        "created_unix": time.time(),
    }
    data = json.dumps(manifest, indent=1).encode()
    rec = storage.write_bytes(step_dir / MANIFEST, data)
    fault_point("after_manifest_before_commit", step_dir)
    storage.write_bytes(step_dir / COMMITTED, json.dumps({"manifest_crc32": rec["crc32"]}).encode())
    storage.sync_dir(step_dir.parent)


# --- reading -------------------------------------------------------------------------------------------------------


@dataclass
class CheckpointInfo:
    step: int
    path: Path
    committed: bool
    manifest: dict | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def size_bytes(self) -> int:
        if not self.manifest:
            return 0
        return sum(int(r.get("size", 0)) for r in self.manifest["files"].values())


def list_checkpoints(root: Path) -> list[CheckpointInfo]:
    """All step folders under ``root``, oldest first by NUMERIC step (step-99 < step-100 < step-1000)."""
    root = storage.as_path(root)
    if not root.is_dir():
        return []
    infos = []
    for entry in root.iterdir():
        m = STEP_DIR_RE.match(entry.name)
        if m and entry.is_dir():
            infos.append(CheckpointInfo(int(m.group(1)), entry, (entry / COMMITTED).exists()))
    return sorted(infos, key=lambda i: i.step)


def read_manifest(step_dir: Path) -> dict:
    """The manifest of a committed checkpoint, checked against the crc recorded in COMMITTED."""
    step_dir = storage.as_path(step_dir)
    if not (step_dir / COMMITTED).exists():
        raise CheckpointError(f"{step_dir} is not committed (no {COMMITTED} marker): it was interrupted while saving")
    try:
        marker = json.loads((step_dir / COMMITTED).read_text())
        raw = (step_dir / MANIFEST).read_bytes()
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{step_dir}: unreadable {MANIFEST}/{COMMITTED} ({e})") from None
    from .fsio import checksum_bytes

    if checksum_bytes(raw) != marker.get("manifest_crc32"):
        raise CheckpointError(f"{step_dir / MANIFEST} does not match its commit marker: corrupted or tampered with")
    try:
        manifest = json.loads(raw)
    except ValueError:
        raise CheckpointError(f"{step_dir / MANIFEST} is not valid JSON") from None
    for name in manifest.get("files", {}):
        safe_relpath(name, step_dir)
    return manifest


def verify(step_dir: Path, *, checksums: bool = True) -> dict:
    """Return the manifest if every listed file has its recorded size (and checksum); else raise CheckpointError."""
    manifest = read_manifest(step_dir)
    for name, rec in manifest["files"].items():
        path = storage.as_path(step_dir) / name
        if not path.is_file():
            raise CheckpointError(f"{path} is listed in the manifest but missing")
        if path.stat().st_size != rec["size"]:
            raise CheckpointError(f"{path} has {path.stat().st_size} bytes, manifest says {rec['size']}: truncated")
        if checksums and storage.checksum(path)[1] != rec[manifest.get("checksum", CHECKSUM_ALGORITHM)]:
            raise CheckpointError(f"{path} fails its checksum: the file is corrupted")
    return manifest


def resolve(root: Path, spec: str, *, warn=print) -> CheckpointInfo | None:
    """Turn `latest`, a step number, or a path into a verified checkpoint.

    `latest` walks back from the newest committed checkpoint, skipping (with a warning naming it) any that fails
    verification; it returns None when there is none. A step or path that is not a valid checkpoint is an error:
    the user asked for that one, so silently using another would be wrong.
    """
    root = storage.as_path(root)
    if spec == "latest":
        for info in reversed(list_checkpoints(root)):
            if not info.committed:
                warn(f"skipping {info.path}: not committed (interrupted save)")
                continue
            try:
                info.manifest = verify(info.path)
                return info
            except CheckpointError as e:
                warn(f"skipping {info.path}: {e}")
        return None
    if spec.isdigit():
        path = root / step_dir_name(int(spec))
    else:
        path = storage.as_path(spec)
        if path.name in (MANIFEST, COMMITTED) or path.is_file():
            path = path.parent
    if not path.exists():
        raise CheckpointError(f"checkpoint {spec!r} not found (looked for {path}); use `python -m checkpoint list {root}`")
    m = STEP_DIR_RE.match(path.name)
    info = CheckpointInfo(int(m.group(1)) if m else -1, path, (path / COMMITTED).exists())
    info.manifest = verify(path)
    info.step = int(info.manifest["step"])
    return info


# --- retention -----------------------------------------------------------------------------------------------------


def apply_retention(root: Path, keep: int, *, keep_every: int = 0, in_flight: set[int] = frozenset(), log=print) -> list[int]:
    """Delete committed checkpoints beyond the newest ``keep`` (by numeric step). Returns the deleted steps.

    Never deletes: the newest committed checkpoint, anything in flight, milestones (step % keep_every == 0), and
    uncommitted folders newer than the newest committed one (they may be someone's save in progress). Called only
    after a new checkpoint has committed.
    """
    if keep <= 0:
        return []
    infos = list_checkpoints(root)
    committed = [i for i in infos if i.committed]
    if not committed:
        return []
    newest = committed[-1].step
    keep_steps = {i.step for i in committed[-max(keep, 1):]} | {newest} | set(in_flight)
    doomed = [i for i in committed if i.step not in keep_steps and not (keep_every and i.step % keep_every == 0)]
    # Stale partial folders older than the newest commit are leftovers of a crash; they never become loadable.
    doomed += [i for i in infos if not i.committed and i.step < newest and i.step not in in_flight]
    for info in doomed:
        fault_point("during_retention_delete", info.path)
        # Remove the commit marker first so a crash mid-delete leaves an *uncommitted* folder, never a
        # committed one with missing files.
        try:
            (info.path / COMMITTED).unlink()
        except FileNotFoundError:
            pass
        storage.rmtree(info.path)
        log(f"retention: removed {info.path.name}")
    if doomed:
        storage.sync_dir(storage.as_path(root))
    return [i.step for i in doomed]


def ensure_writable(root: Path) -> None:
    """Fail at startup, not at the first save, if the checkpoint folder cannot be written (S3: bucket, credentials)."""
    if storage.is_remote(root):
        return storage.as_path(root).ensure_writable()
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
        probe = Path(root) / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(
            f"checkpoint directory {root} is not writable ({e.strerror}); pass --checkpoint-dir pointing to a writable path"
        ) from None
