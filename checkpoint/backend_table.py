"""The checkpoint backends as a table, stdlib only: their names (--checkpoint-backend, a manifest's ``backend``), the
formats `convert` writes, what each can do (``CAPABILITIES``) and every refusal of a flag combination derived from it
(``combination_refusal``). No backend module and no torch is imported: a command line refuses a combination before
torch loads (train.py's first lines), and layout.py checks a manifest's backend by name. backends/ (the registry)
re-exports these names and registers one class per name, in this order; each class declares the same capabilities
(base.Backend checks it when the class is defined).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import CheckpointError
from .naming import setting


BACKEND_NAMES: tuple[str, ...] = ("vanilla", "concurrent", "dcp")
FORMATS: tuple[str, ...] = ("vanilla", "dcp")  # what `python -m checkpoint convert --to` writes (convert.py)

#: values of ``Backend.asynchronous``
ASYNC_OPTIONAL = "optional"  # synchronous saves unless asked (--async-checkpoint): then they persist in the background
ASYNC_ALWAYS = "always"  # every save persists in the background by design; there is nothing to ask for


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, as the class attributes of the same names on its :class:`Backend` class (see there).
    Every refusal of a flag combination is derived from these, in one place: ``check_combination`` (below)."""

    sharded: bool = False
    remote_ok: bool = False
    asynchronous: str | None = None


#: backend name -> its capabilities (= the class attributes of the same names; see base.Backend for their meaning)
CAPABILITIES: dict[str, Capabilities] = {
    "vanilla": Capabilities(),
    "concurrent": Capabilities(asynchronous=ASYNC_ALWAYS),
    "dcp": Capabilities(sharded=True, remote_ok=True, asynchronous=ASYNC_OPTIONAL),
}

#: the format a just-in-time save (--jit-checkpoint, jit.py) is written in, by the one surviving rank that saves:
#: its limits are this backend's
JIT_FORMAT = "vanilla"


def capabilities(name: str) -> Capabilities:
    """What backend ``name`` can do, without importing its module."""
    if name not in CAPABILITIES:
        raise ValueError(f"unknown checkpoint backend {name!r}; choose one of: {', '.join(BACKEND_NAMES)}")
    return CAPABILITIES[name]


def _filesystem(checkpoint_dir) -> bool:
    from . import storage  # stdlib and numpy: needed only where a folder is named

    return storage.medium(checkpoint_dir).filesystem


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
    remote = checkpoint_dir is not None and not _filesystem(checkpoint_dir)
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
