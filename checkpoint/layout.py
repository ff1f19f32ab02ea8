"""The on-disk contract every backend shares: folders, part records, manifest, commit marker, `latest`, publishing.
What a manifest's meta may hold is schema.py; which steps a location keeps, retention.py; how a copy is written on a
medium (staged and renamed, or in place), route.py.

    <root>/step-00000123/
        ...payload files (backend specific)...
        part-rank-00000.json   one per rank, written after that rank's payload is durable
        manifest.json          written by rank 0 once all part records exist
        COMMITTED              written last; without it the folder is never loaded

A backend only writes payload files and returns their size/checksum records; committing is done here, the same way for
all of them, so `latest`, retention and verification cannot differ between backends.
"""

from __future__ import annotations

import logging
import json
import os
import re
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Callable

from . import storage
from .backend_table import BACKEND_NAMES  # the names alone: the registry imports torch, this module does not
from .errors import CheckpointError
from .fsio import (CHECKSUM_ALGORITHM, HASHERS, atomic_write_bytes, checksum_bytes, fsync_dir, make_dirs,  # noqa: F401
                   not_regular)
from .knobs import fault_point
from .naming import setting
from .schema import MAX_FILE_SIZE, MAX_STEP, MAX_WORLD_SIZE, is_int, is_number, meta_problem, show

_log = logging.getLogger(__name__)

FORMAT_VERSION = 1
STEP_DIR_RE = re.compile(r"^step-(\d{8,})$")
MANIFEST = "manifest.json"
COMMITTED = "COMMITTED"


def no_guard(what: str) -> None:  # noqa: ARG001 - fencing off (no lease: object storage, tools)
    return None


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def part_record_name(rank: int) -> str:
    return f"part-rank-{rank:05d}.json"


def safe_relpath(name: str, where: Path) -> str:
    """Refuse manifest entries that would escape the checkpoint folder (absolute paths, `..`)."""
    p = PurePosixPath(name)
    if not name or p.is_absolute() or ".." in p.parts or "\\" in name or "\0" in name:
        raise CheckpointError(f"manifest of {where} names an unsafe path {name!r}; the checkpoint was tampered with")
    return name


def member(step_dir: Path, name: str, manifest: dict) -> Path:
    """The path of a file that a load or a verify may read: named by a checksummed record in the (verified) manifest,
    inside ``step_dir`` -- no absolute path, no `..`, no symbolic link on the way. Every backend reads its files
    through here, so a resealed manifest (or a DCP ``.metadata``) cannot make a load read bytes from elsewhere; the
    bytes themselves are then checked against the record (fsio.read_verified, which also refuses a link swapped in
    after this check)."""
    safe_relpath(name, step_dir)
    if name not in manifest["files"]:
        raise CheckpointError(f"{step_dir} reads {name!r}, which its manifest does not list: a checkpoint's files are "
                              "only those its manifest records; the checkpoint was tampered with")
    at = storage.as_path(step_dir)
    for part in PurePosixPath(name).parts:
        at = at / part
        if storage.is_link(at):
            raise CheckpointError(f"{at} is a symbolic link; a checkpoint's files must be inside its folder, never "
                                  "links to elsewhere: the checkpoint was tampered with")
    return at


# Every name a PyRecover writer creates inside a step folder: payload files of every backend (``*.pt``; DCP's
# ``.metadata`` and ``__R_N.distcp``), part records, manifest, marker, and fsio's temporary names. A folder holding
# anything else is not only ours, and is never deleted (remove_step_dir).
OWN_FILE_RE = re.compile(r"^(manifest\.json|COMMITTED|part-rank-\d{5,}\.json|[A-Za-z0-9_-]+\.pt|__\d+_\d+\.distcp"
                         r"|\.metadata|\.metadata\.tmp|\.[^/]+\.tmp-[0-9a-f]{8})$")


def remove_step_dir(step_dir: Path, why: str, *, salvage: Callable[[Path], None] | None = None) -> None:
    """The one way a step folder is deleted: its commit marker first (a crash mid-way leaves an uncommitted folder,
    never a committed one with files missing), then the rest -- only if everything in it is a name PyRecover writes
    (storage.check_owned: no other file, no sub-folder, no symbolic link, never followed). Else CheckpointError,
    naming what is in the way; ``why`` says what to do. ``salvage(step_dir)``: runs once the folder is un-committed,
    before the rest goes, and may move files out (the local tier keeps its payload files to overwrite, tier.Spares)."""
    storage.check_owned(step_dir, OWN_FILE_RE.match, why)
    (storage.as_path(step_dir) / COMMITTED).unlink(missing_ok=True)
    if salvage is not None:
        salvage(step_dir)
    storage.rmtree(step_dir)


# --- writing -------------------------------------------------------------------------------------------------------


def write_part_record(step_dir: Path, rank: int, files: dict[str, dict], run_id: str = "", error: str = "") -> None:
    """``error``: this rank's save failed (e.g. disk full); rank 0 then gives up on the commit instead of waiting."""
    record = {"rank": rank, "run_id": run_id, "files": files}
    if error:
        record["error"] = error
    storage.write_bytes(step_dir / part_record_name(rank), json.dumps(record, indent=1, sort_keys=True).encode())


def wait_for_part_records(step_dir: Path, world_size: int, timeout: float, run_id: str = "",
                          guard: Callable[[str], None] | None = None) -> list[dict]:
    """Rank 0 waits (on the filesystem, not a collective) until every rank's part record of THIS run exists.

    Filesystem coordination lets background writers commit without touching the training process group. Records
    carry the run id so a stale record left by a crashed earlier attempt can never complete a new commit. ``guard``
    raises once this incarnation is fenced: the new owner swept our staging folder, so a record may never come.
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
        if guard is not None:
            guard(f"commit {step_dir.name}")
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def _read_record(path: Path) -> dict | None:
    """A part record, or None while it is missing or not one (a record of this run is always a JSON object)."""
    try:
        record = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("files", {}), dict) else None


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
    write_commit(step_dir, json.dumps(manifest, indent=1).encode())


def write_commit(step_dir: Path, manifest: bytes) -> None:
    """Write the manifest's bytes, then COMMITTED (naming their checksum), then make the folder's name durable. Also
    how a copy of a checkpoint is committed (mirror.py): the same bytes give the same marker."""
    rec = storage.write_bytes(step_dir / MANIFEST, manifest)
    fault_point("after_manifest_before_commit", step_dir)
    marker = {f"manifest_{CHECKSUM_ALGORITHM}": rec[CHECKSUM_ALGORITHM]}
    storage.write_bytes(step_dir / COMMITTED, json.dumps(marker).encode())
    storage.sync_dir(step_dir.parent)


# --- reading -------------------------------------------------------------------------------------------------------


@dataclass
class CheckpointInfo:
    step: int
    path: Path
    committed: bool
    manifest: dict | None = None
    problems: list[str] = field(default_factory=list)
    # what verify() read and checked, by path, kept for the load that follows (one read per file, not two)
    verified: dict = field(default_factory=dict, repr=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "verified": {}}  # the bytes stay in the process that read them (rank 0's resolve)

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
        # A step folder that is a symbolic link is not one this project wrote (it publishes by rename): it is never
        # loaded, replaced, retired or deleted, so nothing outside the run directory is read or touched through it.
        if m and entry.is_dir() and not storage.is_link(entry):
            infos.append(CheckpointInfo(int(m.group(1)), entry, (entry / COMMITTED).exists()))
    return sorted(infos, key=lambda i: i.step)


def linked_step_dirs(root: Path) -> list[Path]:
    """Step-folder names under ``root`` that are symbolic links (ignored by list_checkpoints; named at resume)."""
    root = storage.as_path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if STEP_DIR_RE.match(p.name) and storage.is_link(p))


def read_manifest(step_dir: Path) -> dict:
    """The manifest of a committed checkpoint, checked against the crc recorded in COMMITTED."""
    step_dir = storage.as_path(step_dir)
    if not (step_dir / COMMITTED).exists():
        raise CheckpointError(f"{step_dir} is not committed (no {COMMITTED} marker): it was interrupted while saving")
    try:
        marker = json.loads(storage.read_small(step_dir / COMMITTED))
        raw = storage.read_small(step_dir / MANIFEST)
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{step_dir}: unreadable {MANIFEST}/{COMMITTED} ({e})") from None
    # The marker names its algorithm in its key: {"manifest_xxh3_64": ...}, or {"manifest_crc32": ...} from earlier
    # versions.
    algorithm = next((a for a in HASHERS if isinstance(marker, dict) and isinstance(marker.get(f"manifest_{a}"), str)),
                     None)
    if algorithm is None:
        raise CheckpointError(f"{step_dir / COMMITTED} is malformed: expected a JSON object holding manifest_"
                              f"{CHECKSUM_ALGORITHM}, found {show(marker)}; the checkpoint was damaged or tampered with")
    if checksum_bytes(raw, algorithm) != marker[f"manifest_{algorithm}"]:
        raise CheckpointError(f"{step_dir / MANIFEST} does not match its commit marker: corrupted or tampered with")
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError):
        raise CheckpointError(f"{step_dir / MANIFEST} is not valid JSON") from None
    return check_manifest(manifest, step_dir)


def check_manifest(manifest, step_dir: Path) -> dict:
    """The one place a manifest's structure is checked, so nothing that reads a verified manifest (verify, resolve, the
    backends' load paths, reader, convert, the CLI) can trip over a missing or mistyped field: anything off raises a
    CheckpointError naming manifest.json, which `latest` skips like any other invalid checkpoint."""
    where = storage.as_path(step_dir) / MANIFEST

    def bad(what: str):
        raise CheckpointError(f"{where} is malformed: {what}; the checkpoint was damaged or tampered with")

    if not isinstance(manifest, dict):
        bad(f"expected a JSON object, found {show(manifest)}")
    if "format_version" not in manifest:
        bad("no format_version")
    version = manifest["format_version"]
    if version != FORMAT_VERSION or not is_int(version):
        newer = ": written by a newer version; upgrade PyRecover" if is_int(version) and version > FORMAT_VERSION else ""
        raise CheckpointError(f"{where} has format_version {json.dumps(version)[:40]}, this PyRecover reads "
                              f"{FORMAT_VERSION}{newer or ': not a manifest this PyRecover can read'}")
    fields = {
        "step": (lambda v: is_int(v) and 0 <= v <= MAX_STEP, f"an integer from 0 to {MAX_STEP:.0e}"),
        "world_size": (lambda v: is_int(v) and 1 <= v <= MAX_WORLD_SIZE, f"an integer from 1 to {MAX_WORLD_SIZE}"),
        "backend": (lambda v: v in BACKEND_NAMES, f"one of {', '.join(BACKEND_NAMES)}"),
        "checksum": (lambda v: isinstance(v, str) and v != "", "a checksum algorithm name"),
        "files": (lambda v: isinstance(v, dict), "an object of file name -> record"),
    }
    for key, (ok, expected) in fields.items():
        if key not in manifest:
            bad(f"no {key}")
        if not ok(manifest[key]):
            bad(f"{key} is {show(manifest[key])}, expected {expected}")
    algorithm = manifest["checksum"]
    if algorithm not in HASHERS:
        raise CheckpointError(f"{where} uses checksum algorithm {algorithm[:40]!r}; this PyRecover verifies "
                              f"{' and '.join(HASHERS)}: upgrade PyRecover")
    for name, rec in manifest["files"].items():
        safe_relpath(name, step_dir)
        if not isinstance(rec, dict):
            bad(f"the record of {name!r} is {show(rec)}, expected an object with size and {algorithm}")
        if "size" not in rec or not is_int(rec["size"]) or not 0 <= rec["size"] <= MAX_FILE_SIZE:
            bad(f"the record of {name!r} has " + (f"size {show(rec['size'])}" if "size" in rec else "no size")
                + f", expected an integer from 0 to {MAX_FILE_SIZE:.0e}")
        if not isinstance(rec.get(algorithm), str):
            bad(f"the record of {name!r} has no {algorithm} checksum string")
    named = STEP_DIR_RE.match(storage.as_path(step_dir).name)
    if named and int(named.group(1)) != manifest["step"]:
        bad(f"step is {manifest['step']} but the folder is {storage.as_path(step_dir).name}")
    if "created_unix" in manifest and not is_number(manifest["created_unix"]):
        bad(f"created_unix is {show(manifest['created_unix'])}, expected a number")
    problem = meta_problem(manifest.get("meta", {}))
    if problem:
        bad(problem)
    return manifest


def verify(step_dir: Path, *, checksums: bool = True, keep: dict | None = None,
           ahead: VerifiedAhead | None = None) -> dict:
    """Return the manifest if every listed file has its recorded size (and checksum); else raise CheckpointError.
    ``keep``: receives, by path, what the load right after needs of each verified file (``take_verified``): the
    backend's parse of it (``Backend.parse_file``), else its bytes; what ``ahead`` already verified and parsed of a
    file with the same record is taken from there, not read again."""
    manifest = read_manifest(step_dir)
    algorithm = manifest["checksum"]
    listed = []
    for name, rec in manifest["files"].items():
        path = member(step_dir, name, manifest)
        try:
            st = path.stat()  # a stat never opens the file: nothing here waits on a FIFO
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointError(f"{path} is listed in the manifest but missing") from None
        if kind := not_regular(st.st_mode):
            raise CheckpointError(f"{path} is {kind}, not a regular file; the checkpoint was tampered with")
        if st.st_size != rec["size"]:
            raise CheckpointError(f"{path} has {st.st_size} bytes, manifest says {rec['size']}: truncated")
        listed.append((path, rec))
    if checksums:
        from .backends import backend_class  # the backends build on this module: imported when first verifying

        backend = backend_class(manifest["backend"])
        kept = _read_checked(listed, algorithm, keep is not None, backend.parse_file, ahead)
        if keep is not None:
            keep.update(kept)
        backend.check_files(step_dir, manifest)
    return manifest


@dataclass
class Parsed:
    """A verified file as the backend's load reads it (``value``), or the error that parsing it raised, which the
    load raises when it takes the file (a file that verifies but does not parse is the load's error, as before)."""
    value: object = None
    error: CheckpointError | None = None


class VerifiedAhead:
    """What a restart verified and parsed before its load asked (Session.read_ahead, on the read-ahead's thread), by
    (path, size, checksum algorithm, checksum). The load's verify() and take_verified() take a file from here instead
    of reading it again when the manifest they check lists that same size and checksum: the bytes checked against it
    are then the file as that manifest has it, whatever the file holds by now. It travels with the load as its
    ``ahead`` argument (Session.open hands it over once the read-ahead's thread has ended), and each file is taken
    only once: a parsed state is handed over, not copied."""

    def __init__(self) -> None:
        self._found: dict[tuple, Parsed] = {}

    @property
    def nbytes(self) -> int:
        """The size of the files held parsed (about the memory they take)."""
        return sum(key[1] for key in list(self._found))

    @staticmethod
    def _key(path, record: dict, algorithm: str) -> tuple:
        return str(path), int(record["size"]), algorithm, record[algorithm]

    def check(self, path, record: dict, algorithm: str, parse: Callable) -> None:
        """Read and check ``path`` against ``record``, and parse it as the load will (Backend.parse_file). A file that
        fails its check is not kept: the load reads it again, and says what is wrong."""
        data = storage.read_checked(path, record["size"], algorithm, record[algorithm])
        try:
            found = Parsed(value=parse(path, data))
        except CheckpointError as e:
            found = Parsed(error=e)
        self._found[self._key(path, record, algorithm)] = found

    def take(self, path, record: dict, algorithm: str) -> "Parsed | None":
        return self._found.pop(self._key(path, record, algorithm), None)

    def __len__(self) -> int:
        return len(self._found)

    def clear(self) -> None:
        self._found.clear()


def _read_checked(listed: list[tuple[Path, dict]], algorithm: str, keep: bool, parse,
                  ahead: VerifiedAhead | None) -> dict:
    """Read and check every listed file; with ``keep``, what the load needs of each, by path. With a ``parse``, each
    verified file is parsed while a thread reads the next one: the read (the kernel's, and xxh3) runs without the GIL,
    so it overlaps the parse's copy into new memory. Largest first, so the one parse nothing overlaps is a small
    one. Nothing is applied to any state here: a file that fails its check discards what was parsed before it."""
    kept: dict = {}
    if parse is not None and ahead is not None:  # read ahead, checked against the same record: not read again
        left = []
        for path, rec in listed:
            found = ahead.take(path, rec, algorithm)
            if found is None:
                left.append((path, rec))
            elif keep:
                kept[str(path)] = found
        listed = left
    if not (keep and parse):
        for path, rec in listed:
            data = storage.read_checked(path, rec["size"], algorithm, rec[algorithm])
            if keep:
                kept[str(path)] = data
        return kept
    order = sorted(listed, key=lambda f: -f[1]["size"])
    with ThreadPoolExecutor(1, thread_name_prefix="ckpt-verify") as reader:
        reads = [(path, reader.submit(storage.read_checked, path, rec["size"], algorithm, rec[algorithm]))
                 for path, rec in order]
        try:
            for path, read in reads:
                data = read.result()
                try:
                    kept[str(path)] = Parsed(value=parse(path, data))
                except CheckpointError as e:
                    kept[str(path)] = Parsed(error=e)
                del data
        except BaseException:
            for _, read in reads:
                read.cancel()
            raise
    return kept


def take_verified(path: Path, record: dict, algorithm: str, verified: dict | None):
    """What verify() kept of a manifest-listed file (its bytes, or its ``Parsed`` form), else its bytes, read now and
    verified as they arrive."""
    data = verified.pop(str(path), None) if verified else None
    return data if data is not None else storage.read_checked(path, record["size"], algorithm, record[algorithm])


def spec_dir(root: Path, spec: str) -> Path:
    """The step folder a step number (under ``root``) or a path names; a manifest or other file names its folder."""
    if spec.isdigit():
        return root / step_dir_name(int(spec))
    path = storage.as_path(spec)
    return path.parent if path.name in (MANIFEST, COMMITTED) or path.is_file() else path


def resolve(root: Path, spec: str, *, quiet: bool = False, keep: bool = False,
            ahead: VerifiedAhead | None = None) -> CheckpointInfo | None:
    """Turn `latest`, a step number, or a path into a verified checkpoint.

    `latest` walks back from the newest committed checkpoint, skipping (with a warning naming it) any that fails
    verification; it returns None when there is none. A step or path that is not a valid checkpoint is an error:
    the user asked for that one, so silently using another would be wrong.
    """
    root = storage.as_path(root)
    if spec == "latest":
        return resolve_latest([root], quiet=quiet, keep=keep, ahead=ahead)
    path = spec_dir(root, spec)
    if spec.isdigit() and storage.is_link(path):
        raise CheckpointError(f"{path} is a symbolic link, not a checkpoint this run wrote; pass the folder it "
                              f"points to ({os.readlink(path)}) as {setting('resume', 'PATH')} if you trust it")
    if not path.exists():
        raise CheckpointError(f"checkpoint {spec!r} not found (looked for {path}); use `python -m checkpoint list {root}`")
    m = STEP_DIR_RE.match(path.name)
    info = CheckpointInfo(int(m.group(1)) if m else -1, path, (path / COMMITTED).exists())
    info.manifest = verify(path, keep=info.verified if keep else None, ahead=ahead)
    info.step = int(info.manifest["step"])
    return info


def resolve_latest(roots: list, *, quiet: bool = False, keep: bool = False,
                   ahead: VerifiedAhead | None = None) -> CheckpointInfo | None:
    """The newest (by numeric step) committed checkpoint under any of ``roots`` that verifies; on a tie the earlier
    root wins. Each one skipped is named in a warning. A root that cannot be listed (gone, unreachable) is skipped with
    a warning when another root answers; when none found a checkpoint, its error is raised: starting fresh over a
    checkpoint folder that cannot be read would lose the run."""
    warn = (lambda m: None) if quiet else (lambda m: _log.warning(f"warning: {m}"))
    candidates, unreadable = [], []
    for order, root in enumerate(storage.as_path(r) for r in roots):
        try:
            candidates += [(info.step, -order, info) for info in list_checkpoints(root)]
            for link in linked_step_dirs(root):
                warn(f"skipping {link}: a symbolic link, not a checkpoint this run wrote (never followed)")
        except OSError as e:
            unreadable.append(f"cannot list {root}: {e.strerror or e}")
            warn(f"skipping {root}: {e.strerror or e}")
    invalid = []
    for _, _, info in sorted(candidates, key=lambda c: c[:2], reverse=True):
        if not info.committed:
            warn(f"skipping {info.path}: not committed (interrupted save)")
            continue
        try:
            info.manifest = verify(info.path, keep=info.verified if keep else None, ahead=ahead)
            return info
        except CheckpointError as e:
            invalid.append(str(e))
            warn(f"skipping {info.path}: {e}")
        except OSError as e:  # e.g. an object store that stopped answering mid-way
            invalid.append(f"{info.path}: {e.strerror or e}")
            warn(f"skipping {info.path}: {e.strerror or e}")
    if unreadable:
        raise CheckpointError(f"{unreadable[0]}; no other checkpoint location has a valid checkpoint")
    if invalid:  # committed once, none verifies now: starting over would bury the run under a fresh one
        raise NoValidCheckpoint(
            f"none of the {len(invalid)} committed checkpoint(s) verifies (the newest: {invalid[0]}); nothing was "
            f"changed: repair or move them, resume from a copy ({setting('resume', 'PATH')}), or start a new run "
            f"under another {setting('experiment')}")
    return None


class NoValidCheckpoint(CheckpointError):
    """`latest`: there are committed checkpoints, and none of them verifies."""


# --- staging, publishing, start-up sweep, retiring an abandoned line (local filesystems) --------------------------------
# A save is written into <root>/.staging-<run_id>/step-N/ and committed there (manifest, COMMITTED); publishing renames
# the committed folder to <root>/step-N. A checkpoint is therefore visible only once complete, and an existing committed
# step-N stays valid until its replacement is committed: replacing it is rename(old -> .trash-*), rename(new -> step-N).
# A crash between those two renames leaves both copies committed; the start-up sweep (``recover``) publishes the staged
# one. Object storage has no rename: there, saves are written in place and COMMITTED is still written last.

STAGING_PREFIX = ".staging-"
TRASH_PREFIX = ".trash-"
RETIRED_DIR = "retired"


def staging_dir(root: Path, run_id: str, step: int) -> Path:
    return storage.as_path(root) / f"{STAGING_PREFIX}{run_id}" / step_dir_name(step)


def publish(staged: Path, root: Path, step: int, *, guard: Callable[[str], None] = no_guard, tag: str = "",
            replace_valid: bool = True) -> Path:
    """Make the committed folder ``staged`` the checkpoint ``root/step-N`` (see above); the one way a step folder is
    replaced. ``replace_valid`` False: a ``step-N`` that exists and verifies is kept and ``staged`` discarded (a
    just-in-time save racing a periodic one of the same step). Returns the final path."""
    target = Path(root) / step_dir_name(step)
    trash = None
    if target.is_symlink():  # not ours (list_checkpoints ignores it): kept, under a name nothing here reads
        aside = target.with_name(f"{target.name}.link-{tag or uuid.uuid4().hex[:8]}")
        guard(f"move the link {target.name} aside")
        target.rename(aside)
        _log.warning(f"warning: {target} was a symbolic link to {os.readlink(aside)}, not a checkpoint this run wrote; "
                     f"renamed it {aside.name} to publish step {step}")
    if target.exists() and not replace_valid:
        try:
            verify(target)
            shutil.rmtree(staged, ignore_errors=True)
            return target
        except CheckpointError:
            pass  # replaced below: the broken copy stays in place until the new one is committed
    if target.exists():
        guard(f"replace {target.name}")
        trash = target.with_name(f"{TRASH_PREFIX}{target.name}-{tag or uuid.uuid4().hex[:8]}")
        target.rename(trash)  # the old copy stays committed (in the trash) until the new one is in place
        fault_point("between_replace_renames", target)
    else:
        guard(f"publish {target.name}")
    try:
        staged.rename(target)
    except OSError:
        if trash is not None:
            trash.rename(target)  # put the old checkpoint back: it stays `latest`
        raise
    fsync_dir(Path(root))
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    return target


def recover(root: Path, own_staging: str = "") -> None:
    """At start, by the new owner, before `latest` is resolved: finish a replacement a crash interrupted (publish a
    committed staged step whose step-N is missing), then remove what no incarnation can use any more: other staging
    folders and trash. An uncommitted step folder (object storage, an older version, a lost marker) is left to `latest`
    (skipped, named) and then to retirement or retention."""
    root = Path(root)
    if not root.is_dir():
        return
    removed = []
    for stage in sorted(p for p in root.iterdir() if p.name.startswith(STAGING_PREFIX) and p.name != own_staging
                        and not p.is_symlink()):
        for staged in sorted(stage.iterdir()) if stage.is_dir() else []:
            m = STEP_DIR_RE.match(staged.name)
            if m and (staged / COMMITTED).exists() and not (root / staged.name).exists():
                staged.rename(root / staged.name)
                _log.info(f"run directory: published {staged.name}, committed before a crash interrupted its replacement")
            else:
                removed.append(f"{stage.name}/{staged.name}")
        shutil.rmtree(stage, ignore_errors=True)
    for p in sorted(root.iterdir()):
        if p.name.startswith(TRASH_PREFIX):
            removed.append(p.name)
            shutil.rmtree(p, ignore_errors=True)
    fsync_dir(root)
    if removed:
        _log.info(f"run directory: removed what interrupted saves left ({', '.join(removed)}); the committed checkpoints "
            "are untouched")


def sweep_other_staging(root: Path, own_staging: str, guard: Callable[[str], None]) -> None:
    if not root.is_dir():
        return
    for p in root.iterdir():
        if (p.name.startswith(STAGING_PREFIX) and p.name != own_staging) or p.name.startswith(TRASH_PREFIX):
            guard(f"delete {p.name}")
            shutil.rmtree(p, ignore_errors=True)


def retire_newer(root: Path, step: int, *, keep_files: tuple[str, ...] = (), guard: Callable[[str], None] = no_guard
                 ) -> Path | None:
    """The run continues from ``step``: move every checkpoint newer than it (a line the user left) to
    ``root/retired/<UTC time>-after-step-<step>/``, with a copy of ``keep_files``, so `latest` can never return to that
    line. Nothing is deleted. Returns the folder, or None if there was nothing to retire. Object storage (a mirror,
    mirror.py) too: there a move is a copy, and the source loses its COMMITTED before any other object."""
    root = storage.as_path(root)
    newer = [i for i in list_checkpoints(root) if i.step > step]
    if not newer:
        return None
    guard("retire the checkpoints of an abandoned line")
    dest = root / RETIRED_DIR / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-after-step-{step}"
    make_dirs(dest)
    for name in keep_files:
        if (root / name).is_file():
            storage.copy_file(root / name, dest / name)
    for info in newer:
        info.path.rename(dest / info.path.name)
    storage.sync_dir(dest)
    storage.sync_dir(root)
    _log.info(f"run directory: continuing from step {step}; moved the newer checkpoints of the abandoned line "
        f"({', '.join(str(i.step) for i in newer)}) to {dest} (delete it when you no longer need them)")
    return dest


def ensure_writable(root: Path) -> None:
    """Fail at startup, not at the first save, if the checkpoint folder cannot be written (S3: bucket, credentials)."""
    storage.medium(root).ensure_writable(storage.as_path(root))
