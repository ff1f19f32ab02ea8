"""Torch files in a checkpoint: what a rank writes (``<key>.pt`` per shared piece from rank 0, ``rank-NNNNN.pt`` per
rank), how they are written (torch.save through the storage medium: atomic, durable, checksummed as written) and THE
weights-only way they are read back, verified. Shared by the file backends (vanilla, concurrent), DCP's non-tensor
pieces, the just-in-time save and reader.py."""

from __future__ import annotations

import logging
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from .. import layout, storage
from ..errors import CheckpointError, first_line
from ..fsio import MemoryFile, verified_identity
from ..logs import EVERY_RANK
from ..state import CheckpointState

_log = logging.getLogger(__name__)


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


_RANK_FILE = re.compile(r"rank-\d{5,}\.pt")


def _no_zip_crc32() -> None:
    """torch.save's zip writer would crc32 every byte (~4x a memcpy of CPU); the manifest's checksum already covers
    each whole file, and torch.load does not need the zip crcs."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # older torch: no such option, the crcs stay
        return
    config.save.compute_crc32 = False


def save_pieces(step_dir: Path, pieces: dict[str, dict], rank: int) -> dict[str, dict]:
    """Write ``{filename: state_dict}`` durably (any medium); return their size/checksum records. Shared by every
    file backend."""
    _no_zip_crc32()
    files = {}
    for name, obj in pieces.items():
        files[name] = storage.write_with(step_dir / name, lambda w, obj=obj: torch.save(obj, w), sync_dir=False)
    storage.sync_dir(step_dir)
    return files


def payload_pieces(state: CheckpointState, rank: int, *, shared: bool | None = None) -> dict[str, dict]:
    """The files this rank writes and what goes in each (state_dicts taken now). ``shared``: this rank writes the
    shared pieces (default: rank 0; in the local tier, every node's leader)."""
    pieces = {}
    if shared if shared is not None else rank == 0:
        pieces.update({f"{key}.pt": piece.state_dict() for key, piece in state.shared().items()})
    pieces[rank_file(rank)] = {key: piece.state_dict() for key, piece in state.per_rank().items()}
    return pieces


def load_weights_only(f, where: str, *, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """THE weights-only loader of the checkpoint package (every backend, reader.py, DCP's non-tensor values):
    ``torch.load(weights_only=True)``, tensors and plain containers only; a pickled object is refused, never run.
    ``f``: a path (``mmap`` allowed: tensors are then views of the file's pages) or a file object; ``where``: what to
    call it in the one-line error."""
    try:
        return torch.load(f, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"refusing to load {where}: it contains pickled Python objects, not just tensors ({first_line(e)}); "
            "a checkpoint must load with weights_only=True"
        ) from None
    except OSError as e:
        raise CheckpointError(f"cannot read {where}: {e.strerror or e}") from None
    except (RuntimeError, EOFError, ValueError) as e:
        raise CheckpointError(f"{where} is not a readable torch file ({first_line(e)})") from None


def safe_load(path: Path, record: dict | None = None, algorithm: str = "", *, mmap: bool = False,
              verified: dict[str, memoryview] | None = None) -> Any:
    """One file through :func:`load_weights_only`. With the manifest's ``record``, the bytes are verified as they
    arrive (or taken from layout.verify, which just verified them): one read of the file, never a second pass to
    checksum it. ``mmap`` (no record): memory-mapped, nothing read up front (reader.py: comparing two large
    checkpoints does not hold both in RAM)."""
    if mmap:
        if record is not None:
            raise ValueError("safe_load: a memory-mapped load is not verified as it is read; pass no record")
        return load_weights_only(path, str(path), mmap=True)
    if record is not None:
        data = layout.take_verified(path, record, algorithm, verified)
        if isinstance(data, layout.Parsed):  # verify() parsed it already (parse_file)
            if data.error is not None:
                raise data.error
            return data.value
    else:
        try:
            data = path.read_bytes()
        except OSError as e:
            raise CheckpointError(f"cannot read {path}: {e.strerror}") from None
    return load_weights_only(MemoryFile(memoryview(data)), str(path))


# A verified file is parsed from a second, private mapping of that same file (torch.load(mmap=True), opened through
# /proc/self/fd: the name cannot be swapped for another file in between), and each of its storages is then copied once
# into memory of its own. That copy is torch's: on every intra-op thread and without the GIL, so it runs while the
# verifier reads the next file. Parsing from a file object copies each storage in one thread under the GIL: the
# verified load of `small` (224 MiB) took 0.30 s that way against 0.24 s this way from a cold page cache, 0.18 against
# 0.14 s from /dev/shm (2 cores, medians of 8). Most of what is left is the kernel faulting in the new pages.
_PROC_FD = Path("/proc/self/fd")


def parse_file(path: Path, data: memoryview) -> Any:
    """A verified file's bytes as its load reads them (Backend.parse_file), in memory of their own."""
    fd = _reopen_verified(path, verified_identity(data))
    if fd < 0:
        return load_weights_only(MemoryFile(data), str(path))
    try:
        return _owned(load_weights_only(f"{_PROC_FD}/{fd}", str(path), mmap=True), {})
    finally:
        os.close(fd)


def _reopen_verified(path: Path, identity: tuple[int, int] | None) -> int:
    """An open descriptor of ``path`` if it is still the file that verified (device and inode), else -1: gone, a link
    now or another file since, or no /proc to map it through. Then the verified bytes are parsed instead."""
    if identity is None or not _PROC_FD.is_dir():
        return -1
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return -1
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != identity:
        os.close(fd)
        return -1
    return fd


def _owned(value: Any, copies: dict) -> Any:
    """``value`` (modified in place) with every tensor moved out of the file's mapping: each storage copied once, so
    views of one storage stay views of one copy, and nothing the load keeps holds the file open (a deleted
    checkpoint's disk space, a tmpfs tier's memory) or sees it change."""
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor or value.layout != torch.strided:
            return value.clone()
        storage = value.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in copies:
            copies[key] = storage.clone()
        return torch.empty(0, dtype=value.dtype).set_(copies[key], value.storage_offset(), value.size(), value.stride())
    if isinstance(value, dict):
        for k, v in value.items():
            value[k] = _owned(v, copies)
    elif isinstance(value, list):
        value[:] = [_owned(v, copies) for v in value]
    elif type(value) is tuple:
        return tuple(_owned(v, copies) for v in value)
    return value


def read_section(step_dir: Path, manifest: dict, section: str) -> dict[str, Any]:
    """``<section>.pt`` of a checkpoint in this format (vanilla, concurrent), memory-mapped. See Backend.read_section."""
    name = f"{section}.pt"
    if name not in manifest["files"]:
        raise CheckpointError(f"{step_dir} holds no {section} state")
    path = layout.member(step_dir, name, manifest)
    if not storage.medium(path).filesystem:  # object storage (a tiered run's shared tier): read, not mapped
        return safe_load(path, manifest["files"][name], manifest["checksum"])
    return safe_load(path, mmap=True)  # verified by reader.locate just before


def write_sections(step_dir: Path, sections: dict[str, dict]) -> dict[str, dict]:
    """Write full state dicts ``{section: state_dict}`` (model, optimizer) as ``<section>.pt`` files in ``step_dir``
    (local or s3://); return their size/checksum records. For conversion (convert.py) into this format."""
    return save_pieces(step_dir, {f"{s}.pt": sd for s, sd in sections.items()}, rank=0)


def load_file(step_dir: Path, manifest: dict, name: str, verified: dict[str, memoryview] | None = None) -> Any:
    """A manifest-listed torch file of a checkpoint, read from inside its folder and verified (layout.member)."""
    return safe_load(layout.member(step_dir, name, manifest), manifest["files"][name], manifest["checksum"],
                     verified=verified)


def files_read(manifest: dict, rank: int) -> list[str]:
    """What ``load_pieces`` reads on ``rank``: every shared piece, and the rank's own file (rank 0's at a larger world
    size)."""
    files = manifest["files"]
    own = rank_file(rank) if rank_file(rank) in files else rank_file(0)
    return [name for name in files if name == own or not _RANK_FILE.fullmatch(name)]


def load_pieces(step_dir: Path, manifest: dict, state: CheckpointState, rank: int,
                verified: dict[str, memoryview] | None = None, *, shared_at: tuple[Path, dict] | None = None) -> None:
    """Restore ``state``: the shared pieces (``<key>.pt``) from ``step_dir``, or from ``shared_at`` (a folder and its
    verified manifest: the node leader's part in the local tier, tier.py), and this rank's own file."""
    files = manifest["files"]
    shared_dir, shared_manifest = shared_at or (step_dir, manifest)
    for key, piece in state.shared().items():
        name = f"{key}.pt"
        if name not in shared_manifest["files"]:
            raise CheckpointError(f"{shared_dir} has no {name!r}; it was saved by a run without {key}")
        piece.load_state_dict(load_file(shared_dir, shared_manifest, name, verified))
    own = rank_file(rank)
    if own in files:
        per_rank = load_file(step_dir, manifest, own, verified)
    else:
        # Resuming at a larger world size: the loader position is global (rank 0's serves every rank); the new
        # rank's RNG keeps its fresh seed. Said out loud because the run is then not bit-identical to the old one.
        per_rank = load_file(step_dir, manifest, rank_file(0), verified)
        per_rank.pop("rng", None)
        _log.info(f"rank {rank}: {step_dir} was saved by {manifest['world_size']} ranks; using rank 0's data "
                  "position, fresh RNG", extra=EVERY_RANK)
    for key, piece in state.per_rank().items():
        if key in per_rank:
            piece.load_state_dict(per_rank[key])
