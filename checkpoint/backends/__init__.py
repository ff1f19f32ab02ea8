"""Backends: how checkpoint bytes land. One backend per file; `make_backend` is the only place that picks one.

A backend's module is imported when it is first used: dcp pulls in torch.distributed.checkpoint (~0.6 s), which a
run on another backend, or a resume from another backend's checkpoint, should not pay at every restart.
"""

from __future__ import annotations

import importlib

from .base import Backend, PayloadHandle, RankInfo

#: backend name (as in manifest.json and --checkpoint-backend) -> "module:class" in this package
BACKENDS: dict[str, str] = {"vanilla": "vanilla:VanillaBackend", "concurrent": "concurrent:ConcurrentBackend",
                            "dcp": "dcp:DCPBackend"}


def backend_class(name: str) -> type[Backend]:
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(f".{module}", __package__), cls)


def make_backend(name: str, rank: RankInfo, **options) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"unknown checkpoint backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    return backend_class(name)(rank, **options)


def loader_for(manifest: dict, rank: RankInfo) -> Backend:
    """The backend able to read a checkpoint is chosen by what wrote it (its manifest), not by the current flags, so a
    run saving with one backend can resume from another backend's checkpoint."""
    name = manifest.get("backend")
    if name not in BACKENDS:
        raise ValueError(f"checkpoint written by unknown backend {name!r}")
    return backend_class(name)(rank)


__all__ = ["Backend", "PayloadHandle", "RankInfo", "BACKENDS", "backend_class", "make_backend", "loader_for"]
