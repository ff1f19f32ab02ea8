"""The default backend: `torch.save` per piece, written atomically and fsynced, synchronously.

Files: one ``<key>.pt`` per shared piece (model, optimizer, ...; written by rank 0) and one ``rank-NNNNN.pt`` per rank
holding that rank's RNG and data-loader position.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch

from .. import layout
from ..errors import CheckpointError
from ..fsio import MemoryFile, atomic_write, fsync_dir
from ..state import CheckpointState
from .base import Backend, CompletedPayload, PayloadHandle


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _no_zip_crc32() -> None:
    """torch.save's zip writer would crc32 every byte (~4x a memcpy of CPU); the manifest's checksum already covers
    each whole file, and torch.load does not need the zip crcs."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # older torch: no such option, the crcs stay
        return
    config.save.compute_crc32 = False


def save_pieces(step_dir: Path, pieces: dict[str, dict], rank: int) -> dict[str, dict]:
    """Write ``{filename: state_dict}`` durably; return their size/checksum records. Shared by every file backend."""
    _no_zip_crc32()
    files = {}
    for name, obj in pieces.items():
        files[name] = atomic_write(step_dir / name, lambda w, obj=obj: torch.save(obj, w), fsync_parent=False)
    fsync_dir(step_dir)
    return files


def payload_pieces(state: CheckpointState, rank: int) -> dict[str, dict]:
    """The files this rank writes and what goes in each (state_dicts taken now)."""
    pieces = {}
    if rank == 0:
        pieces.update({f"{key}.pt": piece.state_dict() for key, piece in state.shared().items()})
    pieces[rank_file(rank)] = {key: piece.state_dict() for key, piece in state.per_rank().items()}
    return pieces


def safe_load(path: Path, record: dict | None = None, algorithm: str = "") -> dict:
    """torch.load with weights_only=True: tensors and plain containers only; a pickled object is refused, never run.
    With the manifest's ``record``, the bytes are verified as they arrive (or taken from layout.verify, which just
    verified them): one read of the file, never a second pass to checksum it."""
    if record is not None:
        data = layout.take_verified(path, record, algorithm)
    else:
        try:
            data = path.read_bytes()
        except OSError as e:
            raise CheckpointError(f"cannot read {path}: {e.strerror}") from None
    try:
        return torch.load(MemoryFile(memoryview(data)), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "pickle error"
        raise CheckpointError(
            f"refusing to load {path}: it contains pickled Python objects, not just tensors ({first[:160]}); "
            "a checkpoint must load with weights_only=True"
        ) from None
    except (RuntimeError, EOFError, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable torch file ({str(e).splitlines()[0][:160]})") from None


def load_pieces(step_dir: Path, manifest: dict, state: CheckpointState, rank: int, log=print) -> None:
    files = manifest["files"]
    for key, piece in state.shared().items():
        name = f"{key}.pt"
        if name not in files:
            raise CheckpointError(f"{step_dir} has no {name!r}; it was saved by a run without {key}")
        piece.load_state_dict(safe_load(step_dir / name, files[name], manifest["checksum"]))
    own = rank_file(rank)
    if own in files:
        per_rank = safe_load(step_dir / own, files[own], manifest["checksum"])
    else:
        # Resuming at a larger world size: the loader position is global (rank 0's serves every rank); the new
        # rank's RNG keeps its fresh seed. Said out loud because the run is then not bit-identical to the old one.
        per_rank = safe_load(step_dir / rank_file(0), files[rank_file(0)], manifest["checksum"])
        per_rank.pop("rng", None)
        log(f"rank {rank}: {step_dir} was saved by {manifest['world_size']} ranks; using rank 0's data position, fresh RNG")
    for key, piece in state.per_rank().items():
        if key in per_rank:
            piece.load_state_dict(per_rank[key])


class VanillaBackend(Backend):
    name = "vanilla"

    def save(self, step_dir: Path, state: CheckpointState) -> PayloadHandle:
        return CompletedPayload(save_pieces(step_dir, payload_pieces(state, self.rank.rank), self.rank.rank))

    def load(self, step_dir: Path, manifest: dict, state: CheckpointState) -> None:
        load_pieces(step_dir, manifest, state, self.rank.rank)

