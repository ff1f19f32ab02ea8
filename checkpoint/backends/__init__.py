"""Backends: how checkpoint bytes land. One backend per file; this is the one registry: `make_backend` / `loader_for`
pick the backend that writes / reads, `backend_class(name).read_section` reads a checkpoint's tensors for the tools
(reader.py, convert.py), and `check_combination` refuses what a backend cannot do, from its capabilities.

A backend's module is imported when it is first used: dcp pulls in torch.distributed.checkpoint (~0.6 s), which a
run on another backend, or a resume from another backend's checkpoint, should not pay at every restart. So the
capabilities are also in a table (``CAPABILITIES``, with the refusals derived from it, in ../backend_table.py: no torch,
so a command line refuses a combination before torch loads), equal to the class attributes (base.py checks it when a
backend class is defined), and the refusals never import a backend module. This package re-exports those names.
"""

from __future__ import annotations

import importlib

from ..backend_table import (ASYNC_ALWAYS, ASYNC_OPTIONAL, BACKEND_NAMES, CAPABILITIES, JIT_FORMAT,  # noqa: F401
                             Capabilities, capabilities, check_combination, combination_refusal)
from .base import Backend, PayloadHandle, RankInfo

#: backend name (as in manifest.json and --checkpoint-backend) -> "module:class" in this package
BACKENDS: dict[str, str] = {"vanilla": "vanilla:VanillaBackend", "concurrent": "concurrent:ConcurrentBackend",
                            "dcp": "dcp:DCPBackend"}
if tuple(BACKENDS) != BACKEND_NAMES:  # the names flags.py offers before torch loads are these
    raise ImportError(f"checkpoint/backend_table.py lists {BACKEND_NAMES}, the registry {tuple(BACKENDS)}")


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


__all__ = ["ASYNC_ALWAYS", "ASYNC_OPTIONAL", "BACKENDS", "CAPABILITIES", "Backend", "Capabilities", "PayloadHandle",
           "RankInfo", "backend_class", "capabilities", "check_combination", "combination_refusal", "loader_for",
           "make_backend"]
