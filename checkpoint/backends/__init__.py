"""Backends: how checkpoint bytes land. One backend per file; `make_backend` is the only place that picks one."""

from __future__ import annotations

from .base import Backend, PayloadHandle, RankInfo
from .concurrent import ConcurrentBackend
from .dcp import DCPBackend
from .vanilla import VanillaBackend

BACKENDS: dict[str, type[Backend]] = {"vanilla": VanillaBackend, "concurrent": ConcurrentBackend, "dcp": DCPBackend}


def make_backend(name: str, rank: RankInfo, **options) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"unknown checkpoint backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    return BACKENDS[name](rank, **options)


def loader_for(manifest: dict, rank: RankInfo) -> Backend:
    """The backend able to read a checkpoint is chosen by what wrote it (its manifest), not by the current flags, so a
    run saving with one backend can resume from another backend's checkpoint."""
    for cls in BACKENDS.values():
        if cls.owns(manifest):
            return cls(rank)
    raise ValueError(f"checkpoint written by unknown backend {manifest.get('backend')!r}")


__all__ = ["Backend", "PayloadHandle", "RankInfo", "BACKENDS", "make_backend", "loader_for"]
