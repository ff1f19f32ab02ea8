"""Read tensors out of any checkpoint of this project, whatever backend wrote it, without a GPU or a process group.

Used by `tests/check_weights_equality.py`, `python -m checkpoint inspect` and conversion. Tensors come back flattened to
dotted names (``layers.0.attention.wq.weight``, ``optimizer.state.layers.0.attention.wq.weight.exp_avg``) and are
memory-mapped where the format allows, so comparing two large checkpoints does not hold both in RAM. ``check_each``
runs a check on each committed checkpoint of a folder (`python -m checkpoint verify`, `python evaluation.py validate`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import torch

from . import layout, storage
from .backends import BACKENDS, backend_class
from .backends.torchfile import safe_load
from .errors import CheckpointError


def flatten(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from flatten(v, f"{prefix}{k}.")
    elif isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, torch.Tensor)) for v in obj):
        for i, v in enumerate(obj):
            yield from flatten(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], obj


def section_reader(backend: str) -> Callable[[Path, dict, str], dict[str, Any]]:
    """``(step_dir, manifest, section) -> nested state dict`` for checkpoints written by ``backend`` (the name in their
    manifest): the backend class's ``read_section``, from the one registry (checkpoint.backends). Importing the
    backend's module happens here, only for a checkpoint in its format (dcp: torch.distributed.checkpoint)."""
    if backend not in BACKENDS:
        raise CheckpointError(f"no reader for backend {backend!r}")
    return backend_class(backend).read_section


def locate(path: str | Path) -> tuple[Path, dict | None]:
    """A step folder (verified), an experiment folder (its `latest`), or a single `.pt` file (manifest None)."""
    p = storage.as_path(path)  # also s3://bucket/prefix
    if not p.exists():
        raise CheckpointError(f"{p} does not exist")
    if p.is_file():
        return p, None
    if (p / layout.COMMITTED).exists() or (p / layout.MANIFEST).exists():
        return p, layout.verify(p)
    info = layout.resolve(p, "latest", quiet=True)
    if info is None:
        raise CheckpointError(f"{p} holds no committed checkpoint (expected a step-N folder or an experiment folder)")
    return info.path, info.manifest


def read_section(path: str | Path, section: str = "model") -> dict[str, Any]:
    """Flat {name: tensor-or-value} of one section of a checkpoint."""
    where, manifest = locate(path)
    if manifest is None:
        data = safe_load(where, mmap=True)
        if section in data and isinstance(data[section], dict):  # a single file holding several sections
            data = data[section]
        elif section != "model":
            raise CheckpointError(f"{where} holds no {section} state")
    else:
        if manifest["backend"] not in BACKENDS:
            raise CheckpointError(f"{where}: no reader for backend {manifest['backend']!r}")
        data = section_reader(manifest["backend"])(where, manifest, section)
    return dict(flatten(data))


def targets(path: Path) -> list[layout.CheckpointInfo]:
    """One step folder (``path`` itself), or every step folder under an experiment folder."""
    if layout.STEP_DIR_RE.match(path.name) or (path / layout.MANIFEST).exists():
        m = layout.STEP_DIR_RE.match(path.name)
        return [layout.CheckpointInfo(int(m.group(1)) if m else -1, path, (path / layout.COMMITTED).exists())]
    return layout.list_checkpoints(path)


def check_each(path: Path, check: Callable[[layout.CheckpointInfo, dict], tuple[bool, str]]) -> int:
    """Run ``check(info, manifest) -> (ok, text)`` on one step folder or every committed one under ``path``, after its
    sizes and checksums verify; one line each. Exit code 1 if any failed."""
    found = targets(path)
    if not found:
        print(f"error: no checkpoints under {path}", file=sys.stderr)
        return 2
    bad = 0
    for info in found:
        if not info.committed:
            print(f"{info.path}: not committed")
            bad += 1
            continue
        try:
            ok, text = check(info, layout.verify(info.path))
        except CheckpointError as e:
            ok, text = False, f"FAILED: {e}"
        print(f"{info.path}: {text}")
        bad += not ok
    return 1 if bad else 0
