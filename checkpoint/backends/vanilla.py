"""The default backend: `torch.save` per piece, written atomically and fsynced, synchronously.

Files: one ``<key>.pt`` per shared piece (model, optimizer, ...; written by rank 0) and one ``rank-NNNNN.pt`` per rank
holding that rank's RNG and data-loader position.
"""

from __future__ import annotations

from pathlib import Path

from ..state import CheckpointState
from .base import Backend, CompletedPayload, PayloadHandle
from .torchfile import (files_read, load_pieces, parse_file, payload_pieces, read_section, save_pieces,
                        write_sections)


class VanillaBackend(Backend):
    name = "vanilla"
    # capabilities (base.Backend): the defaults -- full state from rank 0, local only, synchronous
    read_section = staticmethod(read_section)
    write_sections = staticmethod(write_sections)
    write_pieces = staticmethod(save_pieces)
    parse_file = staticmethod(parse_file)
    files_read = staticmethod(files_read)

    def save(self, step_dir: Path, state: CheckpointState, *, shared: bool | None = None,
             spares=None) -> PayloadHandle:  # noqa: ARG002 - torch.save makes its files anew
        self.check_state(state)
        pieces = payload_pieces(state, self.rank.rank, shared=self.rank.is_main if shared is None else shared)
        return CompletedPayload(save_pieces(step_dir, pieces, self.rank.rank))

    def load(self, step_dir: Path, manifest: dict, state: CheckpointState, *, verified: dict | None = None) -> None:
        load_pieces(step_dir, manifest, state, self.rank.rank, verified)

