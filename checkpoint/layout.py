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

import logging
import json
import math
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
from .backends import BACKENDS  # the registry alone: the backend modules, which build on this one, load lazily
from .errors import CheckpointError
from .fsio import (CHECKSUM_ALGORITHM, HASHERS, atomic_write_bytes, checksum_bytes, fsync_dir, make_dirs,  # noqa: F401
                   not_regular)
from .knobs import fault_point

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
                              f"{CHECKSUM_ALGORITHM}, found {_show(marker)}; the checkpoint was damaged or tampered with")
    if checksum_bytes(raw, algorithm) != marker[f"manifest_{algorithm}"]:
        raise CheckpointError(f"{step_dir / MANIFEST} does not match its commit marker: corrupted or tampered with")
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError):
        raise CheckpointError(f"{step_dir / MANIFEST} is not valid JSON") from None
    return check_manifest(manifest, step_dir)


def _show(value, limit: int = 60) -> str:
    """A JSON value in an error message: short, and saying what kind of thing it is."""
    kind = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")
    text = json.dumps(value) if not isinstance(value, (dict, list)) else ""
    if len(text) > limit:
        text = text[:limit] + "..."
    return f"{kind} {text}" if text and value is not None else kind


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_manifest(manifest, step_dir: Path) -> dict:
    """The one place a manifest's structure is checked, so nothing that reads a verified manifest (verify, resolve, the
    backends' load paths, reader, convert, the CLI) can trip over a missing or mistyped field: anything off raises a
    CheckpointError naming manifest.json, which `latest` skips like any other invalid checkpoint."""
    where = storage.as_path(step_dir) / MANIFEST

    def bad(what: str):
        raise CheckpointError(f"{where} is malformed: {what}; the checkpoint was damaged or tampered with")

    if not isinstance(manifest, dict):
        bad(f"expected a JSON object, found {_show(manifest)}")
    if "format_version" not in manifest:
        bad("no format_version")
    version = manifest["format_version"]
    if version != FORMAT_VERSION or not _is_int(version):
        newer = ": written by a newer version; upgrade PyRecover" if _is_int(version) and version > FORMAT_VERSION else ""
        raise CheckpointError(f"{where} has format_version {json.dumps(version)[:40]}, this PyRecover reads "
                              f"{FORMAT_VERSION}{newer or ': not a manifest this PyRecover can read'}")
    fields = {
        "step": (lambda v: _is_int(v) and 0 <= v <= MAX_STEP, f"an integer from 0 to {MAX_STEP:.0e}"),
        "world_size": (lambda v: _is_int(v) and 1 <= v <= MAX_WORLD_SIZE, f"an integer from 1 to {MAX_WORLD_SIZE}"),
        "backend": (lambda v: v in BACKENDS, f"one of {', '.join(BACKENDS)}"),
        "checksum": (lambda v: isinstance(v, str) and v != "", "a checksum algorithm name"),
        "files": (lambda v: isinstance(v, dict), "an object of file name -> record"),
    }
    for key, (ok, expected) in fields.items():
        if key not in manifest:
            bad(f"no {key}")
        if not ok(manifest[key]):
            bad(f"{key} is {_show(manifest[key])}, expected {expected}")
    algorithm = manifest["checksum"]
    if algorithm not in HASHERS:
        raise CheckpointError(f"{where} uses checksum algorithm {algorithm[:40]!r}; this PyRecover verifies "
                              f"{' and '.join(HASHERS)}: upgrade PyRecover")
    for name, rec in manifest["files"].items():
        safe_relpath(name, step_dir)
        if not isinstance(rec, dict):
            bad(f"the record of {name!r} is {_show(rec)}, expected an object with size and {algorithm}")
        if "size" not in rec or not _is_int(rec["size"]) or not 0 <= rec["size"] <= MAX_FILE_SIZE:
            bad(f"the record of {name!r} has " + (f"size {_show(rec['size'])}" if "size" in rec else "no size")
                + f", expected an integer from 0 to {MAX_FILE_SIZE:.0e}")
        if not isinstance(rec.get(algorithm), str):
            bad(f"the record of {name!r} has no {algorithm} checksum string")
    named = STEP_DIR_RE.match(storage.as_path(step_dir).name)
    if named and int(named.group(1)) != manifest["step"]:
        bad(f"step is {manifest['step']} but the folder is {storage.as_path(step_dir).name}")
    if "created_unix" in manifest and not _is_number(manifest["created_unix"]):
        bad(f"created_unix is {_show(manifest['created_unix'])}, expected a number")
    problem = _schema_problem(manifest.get("meta", {}), META_SCHEMA, "meta")
    if problem:
        bad(problem)
    return manifest


# Bounds on sealed numbers: anything beyond is not a value a run can have written, and would overflow what reads it.
MAX_STEP = 10**15
MAX_WORLD_SIZE = 1 << 24
MAX_FILE_SIZE = 1 << 50
MAX_INT = 1 << 63


def _is_number(value) -> bool:
    """A float (NaN and infinity too: a diverged run records its loss as it was), or an int in range."""
    return isinstance(value, float) or (_is_int(value) and abs(value) < MAX_INT)


def _is_count(value) -> bool:
    return _is_int(value) and 0 <= value < MAX_INT


def _is_token_rows(value) -> bool:
    """The card's probe: a rectangle of token ids (a batch of windows), what torch.tensor(..., long) takes."""
    return (isinstance(value, list) and all(isinstance(r, list) for r in value)
            and len({len(r) for r in value}) <= 1 and all(_is_count(t) and t < 1 << 31 for r in value for t in r))


def _is_shard_list(value) -> bool:
    """The card's shards of a folder/glob dataset: [[name, size in bytes], ...]."""
    return isinstance(value, list) and all(isinstance(r, list) and len(r) == 2 and isinstance(r[0], str)
                                           and _is_count(r[1]) for r in value)


_OPT_NUM = (_is_number, type(None))  # a loss or learning rate the card records as null when there was none
_OPT_STR = (str, type(None))

# Every field of a manifest's ``meta`` that some reader uses (list, inspect, retention --keep-best, validate, export,
# the resume checks), with what it must be: a type, a tuple of alternatives, a predicate, or a nested schema. Fields
# may be absent (older checkpoints; a just-in-time save has no eval); present, they must fit, or the manifest is
# malformed -- checked once, when it is read, so no reader has to defend itself.
META_SCHEMA = {
    "jit": bool,
    "tier": {"origin": str, "lineage": str, "job": str, "rank": _is_count, "leader": _is_count,
             "world_size": _is_count, "generation": _is_count},
    "card": {
        "model": {"preset": str, "params": _is_count, "config": dict},
        "data": {"dataset": str, "fingerprint": _OPT_STR, "tokenizer": _OPT_STR, "sequence_length": _is_count,
                 "eval_windows": _is_count, "shards": _is_shard_list},
        "hyperparameters": dict,
        "retention": {"keep": _is_count, "keep_every": _is_count, "keep_best": _is_count},
        "layout": {"device": _OPT_STR, "dtype": str, "attention": _OPT_STR, "world_size": _is_count},
        "versions": dict,
        "note": str,
        "flags": dict,
        "progress": {"step": _is_count, "tokens_seen": _is_count, "loss_last": _OPT_NUM, "loss_mean": _OPT_NUM,
                     "loss_steps": _is_count, "learning_rate": _OPT_NUM},
        "time": {"saved_utc": str, "run_wall_s": _is_number},
        "eval": {"probe_loss": _is_number, "eval_loss": _is_number, "probe_tokens": (_is_token_rows, type(None)),
                 "val_loss": _is_number, "val_ppl": _is_number, "val_tokens": _is_count},
    },
}


def _schema_problem(value, schema, where: str) -> str | None:
    """What in ``value`` does not fit ``schema`` (see META_SCHEMA), as one phrase; None if it fits."""
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return f"{where} is {_show(value)}, expected an object"
        for key, sub in schema.items():
            if key in value and (problem := _schema_problem(value[key], sub, f"{where}.{key}")):
                return problem
        return None
    alternatives = schema if isinstance(schema, tuple) else (schema,)
    for alt in alternatives:
        if isinstance(alt, type):
            if isinstance(value, alt) and not (alt is not bool and isinstance(value, bool)):
                return None
        elif alt(value):
            return None
    return f"{where} is {_show(value)}, which no PyRecover writes"


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
                              f"points to ({os.readlink(path)}) as --resume-from-checkpoint PATH if you trust it")
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
            "changed: repair or move them, resume from a copy (--resume-from-checkpoint PATH), or start a new run "
            "under another --experiment_name")
    return None


class NoValidCheckpoint(CheckpointError):
    """`latest`: there are committed checkpoints, and none of them verifies."""


# --- retention -----------------------------------------------------------------------------------------------------


def eval_loss(info: CheckpointInfo) -> float | None:
    """The validation loss in a committed checkpoint's card (evaluation.py: the val loss; an older card's held-out
    eval loss), or None (none recorded, or unreadable)."""
    try:
        manifest = info.manifest or read_manifest(info.path)
    except (CheckpointError, OSError):
        return None
    recorded = manifest.get("meta", {}).get("card", {}).get("eval", {})
    value = recorded.get("val_loss", recorded.get("eval_loss"))
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def best_steps(infos: list[CheckpointInfo], k: int) -> list[int]:
    """The steps of the ``k`` committed checkpoints with the lowest eval loss, best first (ties: the newer)."""
    if k <= 0:
        return []
    scored = [(loss, -i.step) for i in infos if i.committed and (loss := eval_loss(i)) is not None]
    return [-neg_step for _, neg_step in sorted(scored)[:k]]


@dataclass(frozen=True)
class Retention:
    """Which committed checkpoints a location keeps (see apply_retention): the newest ``keep`` (0: all), every
    ``keep_every``-th step, the ``keep_best`` lowest eval losses. One value, given to the manager and to the mirror."""

    keep: int = 0
    keep_every: int = 0
    keep_best: int = 0

    def apply(self, root, **how) -> list[int]:
        return apply_retention(root, self.keep, keep_every=self.keep_every, keep_best=self.keep_best, **how)


def apply_retention(root: Path, keep: int, *, keep_every: int = 0, keep_best: int = 0,
                    in_flight: set[int] = frozenset(), guard: Callable[[str], None] = no_guard,
                    own_staging: str = "", label: str = "retention", quiet: bool = False,
                    salvage: Callable[[Path], None] | None = None) -> list[int]:
    """Delete committed checkpoints beyond the newest ``keep`` (by numeric step). Returns the deleted steps.

    Never deletes: the newest committed checkpoint, anything in flight, milestones (step % keep_every == 0), the
    ``keep_best`` ones with the lowest held-out eval loss (Lightning's save_top_k), and
    uncommitted folders newer than the newest committed one (they may be a save in progress on object storage, which
    writes in place). Also sweeps staging folders of other incarnations (``own_staging`` is ours): the lease makes
    them dead, since they can never be published. ``guard(what)`` raises if this incarnation is fenced. Called only
    after a new checkpoint has committed. ``label`` begins each log line (the mirror's retention says so); ``quiet``:
    no line per deletion (the local tier's, at every save). ``salvage``: see ``remove_step_dir``.
    """
    if keep <= 0:
        writing(root).sweep(root, own_staging, guard)
        return []
    infos = list_checkpoints(root)
    committed = [i for i in infos if i.committed]
    if not committed:
        return []
    newest = committed[-1].step
    keep_steps = {i.step for i in committed[-max(keep, 1):]} | {newest} | set(in_flight)
    keep_steps |= set(best_steps(committed, keep_best))
    doomed = [i for i in committed if i.step not in keep_steps and not (keep_every and i.step % keep_every == 0)]
    # Stale partial folders older than the newest commit are leftovers of a crash; they never become loadable.
    doomed += [i for i in infos if not i.committed and i.step < newest and i.step not in in_flight]
    removed = []
    for info in doomed:
        guard(f"delete {info.path.name}")
        fault_point("during_retention_delete", info.path)
        try:
            remove_step_dir(info.path, "retention keeps it: move them out to let it go", salvage=salvage)
        except CheckpointError as e:
            if str(info.path) not in _kept_foreign:  # once per folder and process: a save every N steps repeats it
                _kept_foreign.add(str(info.path))
                _log.warning(f"warning: {label}: {e}")
            continue
        removed.append(info.step)
        if not quiet:
            _log.info(f"{label}: removed {info.path.name}")
    if removed:
        storage.sync_dir(storage.as_path(root))
    writing(root).sweep(root, own_staging, guard)
    return removed


_kept_foreign: set[str] = set()


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


def _sweep_other_staging(root: Path, own_staging: str, guard: Callable[[str], None]) -> None:
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


# --- how a copy of a checkpoint is written and made visible, per medium ---------------------------------------------


class _Staged:
    """A filesystem: written into a staging folder of the writer (``tag``), published by rename (see above)."""

    def save_dir(self, root, tag: str, step: int) -> Path:
        return staging_dir(root, tag, step)

    def prepare(self, step_dir: Path) -> None:
        """An empty folder: what is there is the writer's own leftover of a failed attempt (the name proves it)."""
        if step_dir.exists():
            storage.rmtree(step_dir)
        step_dir.mkdir(parents=True)

    def publish(self, written: Path, root, step: int, *, guard: Callable[[str], None], tag: str) -> Path:
        return publish(written, root, step, guard=guard, tag=tag)

    def discard(self, written: Path) -> None:
        storage.rmtree(written)  # even committed, it was never published

    def recover(self, root, own_staging: str, guard: Callable[[str], None], *, label: str, mine: bool) -> None:
        guard(f"clean up the {label}")
        recover(root, own_staging=own_staging)

    def sweep(self, root, own_staging: str, guard: Callable[[str], None]) -> None:
        _sweep_other_staging(Path(root), own_staging, guard)

    def retire_newer(self, root, step: int, *, keep_files: tuple[str, ...], guard: Callable[[str], None]) -> None:
        retire_newer(root, step, keep_files=keep_files, guard=guard)

    def close(self, root, own_staging: str) -> None:
        try:  # the staging folder, once empty (every save published)
            (Path(root) / own_staging).rmdir()
        except OSError:
            pass


class _InPlace:
    """Object storage (no rename): written in place as ``step-N``; COMMITTED, written last, makes it a checkpoint."""

    def save_dir(self, root, tag: str, step: int):
        return storage.as_path(root) / step_dir_name(step)

    def prepare(self, step_dir) -> None:
        """An earlier attempt at this step is un-committed first, so a crash here leaves nothing `latest` picks; the
        previous checkpoints stay intact."""
        if step_dir.exists():
            remove_step_dir(step_dir, "move them out of the checkpoint folder")
        step_dir.mkdir(parents=True)

    def publish(self, written, root, step: int, *, guard: Callable[[str], None], tag: str):
        return written  # COMMITTED published it

    def discard(self, written) -> None:
        if not (written / COMMITTED).exists():
            storage.rmtree(written)

    def recover(self, root, own_staging: str, guard: Callable[[str], None], *, label: str, mine: bool) -> None:
        """``mine``: nothing else writes here (a mirror, written by this run's copier alone), so an uncommitted step
        folder is an interrupted copy and goes. Otherwise (no lease on object storage) it is left to `latest`
        (skipped, named) and to retention."""
        if not mine:
            return
        for info in list_checkpoints(root):
            if not info.committed:
                guard(f"delete the interrupted {label} copy {info.path.name}")
                remove_step_dir(info.path, f"move them out of the {label}")
                _log.info(f"{label}: removed {info.path}, an interrupted copy")

    def sweep(self, root, own_staging: str, guard: Callable[[str], None]) -> None:
        """No staging folders: nothing to sweep."""

    def retire_newer(self, root, step: int, *, keep_files: tuple[str, ...], guard: Callable[[str], None]) -> None:
        """Nothing moves: without a lease a second writer may be live here, and a move is a copy of every object. A
        resumed run's newer checkpoints stay (docs/checkpointing.md, known limits)."""

    def close(self, root, own_staging: str) -> None:
        pass


def writing(root) -> "_Staged | _InPlace":
    """How copies of checkpoints are written under ``root``: decided by its medium, once."""
    return _STAGED if storage.medium(root).filesystem else _IN_PLACE


_STAGED, _IN_PLACE = _Staged(), _InPlace()
