"""Read tensors out of any checkpoint of this project, whatever backend wrote it, without a GPU or a process group.

Used by `tests/check_weights_equality.py`, `python -m checkpoint inspect` and conversion. Tensors come back flattened to
dotted names (``layers.0.attention.wq.weight``, ``optimizer.state.layers.0.attention.wq.weight.exp_avg``) and are
memory-mapped where the format allows, so comparing two large checkpoints does not hold both in RAM.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import torch

from . import layout, storage
from .errors import CheckpointError

SECTIONS = ("model", "optimizer")


def flatten(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from flatten(v, f"{prefix}{k}.")
    elif isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, torch.Tensor)) for v in obj):
        for i, v in enumerate(obj):
            yield from flatten(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], obj


def _load_mmap(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - any failure here is "not a readable checkpoint file"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"cannot read {path} as a weights-only torch file: {first[:200]}") from None


def _vanilla_section(step_dir: Path, manifest: dict, section: str) -> dict[str, Any]:
    name = f"{section}.pt"
    if name not in manifest["files"]:
        raise CheckpointError(f"{step_dir} holds no {section} state")
    return _load_mmap(step_dir / name)


#: backend name (as in manifest.json) -> function(step_dir, manifest, section) -> nested state dict.
#: Other backends register their reader here (e.g. dcp), so every tool reads every format.
SECTION_READERS: dict[str, Callable[[Path, dict, str], dict[str, Any]]] = {
    "vanilla": _vanilla_section,
    "concurrent": _vanilla_section,
}


def _dcp_section(step_dir: Path, manifest: dict, section: str) -> dict[str, Any]:
    from .backends.dcp import read_section as read_dcp  # imports torch.distributed.checkpoint only when needed

    return read_dcp(step_dir, manifest, section)


SECTION_READERS["dcp"] = _dcp_section  # sharded, any world size: full tensors, no process group


def locate(path: str | Path) -> tuple[Path, dict | None]:
    """A step folder (verified), an experiment folder (its `latest`), or a single `.pt` file (manifest None)."""
    p = storage.as_path(path)  # also s3://bucket/prefix
    if not p.exists():
        raise CheckpointError(f"{p} does not exist")
    if p.is_file():
        return p, None
    if (p / layout.COMMITTED).exists() or (p / layout.MANIFEST).exists():
        return p, layout.verify(p)
    info = layout.resolve(p, "latest", warn=lambda m: None)
    if info is None:
        raise CheckpointError(f"{p} holds no committed checkpoint (expected a step-N folder or an experiment folder)")
    return info.path, info.manifest


def read_section(path: str | Path, section: str = "model") -> dict[str, Any]:
    """Flat {name: tensor-or-value} of one section of a checkpoint."""
    where, manifest = locate(path)
    if manifest is None:
        data = _load_mmap(where)
        if section in data and isinstance(data[section], dict):  # a single file holding several sections
            data = data[section]
        elif section != "model":
            raise CheckpointError(f"{where} holds no {section} state")
    else:
        reader = SECTION_READERS.get(manifest["backend"])
        if reader is None:
            raise CheckpointError(f"{where}: no reader for backend {manifest['backend']!r}")
        data = reader(where, manifest, section)
    return dict(flatten(data))
