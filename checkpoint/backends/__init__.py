"""Backends: how checkpoint bytes land. One backend per file; this is the one registry: `make_backend` / `loader_for`
pick the backend that writes / reads, `backend_class(name).read_section` reads a checkpoint's tensors for the tools
(reader.py, convert.py), and `check_combination` refuses what a backend cannot do, from its capabilities.

A backend's module is imported when it is first used: dcp pulls in torch.distributed.checkpoint (~0.6 s), which a
run on another backend, or a resume from another backend's checkpoint, should not pay at every restart. So the
capabilities are also in a table here (``CAPABILITIES``), equal to the class attributes (base.py checks it when a
backend class is defined), and the refusals never import a backend module.
"""

from __future__ import annotations

import importlib
import os

from .. import storage
from ..backend_names import BACKEND_NAMES
from ..errors import CheckpointError
from ..naming import setting
from .base import ASYNC_ALWAYS, ASYNC_OPTIONAL, Backend, Capabilities, PayloadHandle, RankInfo

#: backend name (as in manifest.json and --checkpoint-backend) -> "module:class" in this package
BACKENDS: dict[str, str] = {"vanilla": "vanilla:VanillaBackend", "concurrent": "concurrent:ConcurrentBackend",
                            "dcp": "dcp:DCPBackend"}
if tuple(BACKENDS) != BACKEND_NAMES:  # the names flags.py offers before torch loads are these
    raise ImportError(f"checkpoint/backend_names.py lists {BACKEND_NAMES}, the registry {tuple(BACKENDS)}")

#: backend name -> its capabilities (= the class attributes of the same names; see base.Backend for their meaning)
CAPABILITIES: dict[str, Capabilities] = {
    "vanilla": Capabilities(),
    "concurrent": Capabilities(asynchronous=ASYNC_ALWAYS),
    "dcp": Capabilities(sharded=True, remote_ok=True, asynchronous=ASYNC_OPTIONAL),
}

#: the format a just-in-time save (--jit-checkpoint, jit.py) is written in, by the one surviving rank that saves:
#: its limits are this backend's
JIT_FORMAT = "vanilla"

def backend_class(name: str) -> type[Backend]:
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(f".{module}", __package__), cls)


def capabilities(name: str) -> Capabilities:
    """What backend ``name`` can do, without importing its module."""
    if name not in CAPABILITIES:
        raise ValueError(f"unknown checkpoint backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    return CAPABILITIES[name]


def _how(able: list[str]) -> str:
    return " or ".join(setting("backend", n) for n in able)


def combination_refusal(name: str, *, sharded: bool = False, checkpoint_dir: str | os.PathLike | None = None,
                        async_save: bool | str = False, jit: bool = False, local_tier: bool = False) -> str | None:
    """Why a run cannot checkpoint this way, in one line, or None when it can. Every such refusal is here, derived from
    the backends' capabilities (a just-in-time save has those of ``JIT_FORMAT``).

    ``name``: --checkpoint-backend. ``sharded``: the model is sharded over ranks (--parallel fsdp under
    --distributed). ``checkpoint_dir``: --checkpoint-dir (object storage when ``s3://``). ``async_save``:
    --async-checkpoint (any true value). ``jit``: --jit-checkpoint. ``local_tier``: --local-checkpoint-dir (the
    backend then writes only there, whole files per rank, and the drain copies them to ``checkpoint_dir``, any medium)."""
    caps = capabilities(name)
    remote = checkpoint_dir is not None and not storage.medium(checkpoint_dir).filesystem
    jit_caps = CAPABILITIES[JIT_FORMAT]
    able = lambda attr: [n for n, c in CAPABILITIES.items() if getattr(c, attr)]  # noqa: E731
    if sharded and not caps.sharded:
        return (f"{setting('sharded', True)} shards the model over ranks; save it with {_how(able('sharded'))}: the "
                f"{name} backend writes one full copy from rank 0 (convert a DCP checkpoint afterwards with "
                "`python -m checkpoint convert SRC DST --to vanilla`)")
    if local_tier and caps.sharded:
        files = [n for n, c in CAPABILITIES.items() if not c.sharded]
        return (f"{setting('local_dir')} works with {_how(files)}; the {name} backend writes one collective metadata "
                "file that no node holds alone")
    if remote and not caps.remote_ok and not local_tier:
        return f"{setting('checkpoint_dir', checkpoint_dir)} is object storage: it needs {_how(able('remote_ok'))}"
    if jit and remote and not jit_caps.remote_ok:
        return f"{setting('jit', True)} writes to a local {setting('checkpoint_dir')}; it does not support s3://"
    if async_save and caps.asynchronous != ASYNC_OPTIONAL:
        optional = [n for n, c in CAPABILITIES.items() if c.asynchronous == ASYNC_OPTIONAL]
        always = [f"the {n} backend" for n, c in CAPABILITIES.items() if c.asynchronous == ASYNC_ALWAYS]
        tail = f"; {' and '.join(always)} {'is' if len(always) == 1 else 'are'} always asynchronous" if always else ""
        return f"{setting('async_save')} is for {_how(optional)}{tail}"
    if jit and sharded and not jit_caps.sharded:
        return (f"{setting('jit', True)} needs every rank to hold the full state (DDP); with sharded (FSDP) state no "
                f"survivor can save it: drop {setting('jit', True)}")
    return None


def check_combination(name: str, *, sharded: bool = False, checkpoint_dir: str | os.PathLike | None = None,
                      async_save: bool | str = False, jit: bool = False, local_tier: bool = False) -> None:
    """Raise CheckpointError with :func:`combination_refusal`'s line, if any. Call it before any training time is
    spent (train.py, at startup)."""
    why = combination_refusal(name, sharded=sharded, checkpoint_dir=checkpoint_dir, async_save=async_save, jit=jit,
                              local_tier=local_tier)
    if why is not None:
        raise CheckpointError(why)


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
