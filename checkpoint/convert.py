"""Rewrite a committed checkpoint in another backend's format: ``python -m checkpoint convert SRC DST --to vanilla|dcp``.

SRC is a step folder or an experiment folder (its `latest`); DST an experiment folder (the result goes to
``DST/step-N``, N = SRC's step) or a ``step-N`` folder. Model and optimizer are read as full tensors in this one process
(no process group, any source world size) and written as ``model.pt``/``optimizer.pt`` (vanilla) or as a one-rank DCP
checkpoint (which loads at any world size). Every other file — LR schedule, counters, run info, each rank's RNG and data
position — is the same vanilla-format file in every backend and is copied byte for byte, so a run resumed from the
converted checkpoint continues exactly like one resumed from the source. The result is committed like any checkpoint
(manifest with size + crc32 of every file, then COMMITTED) and records where it came from in ``meta``.
"""

from __future__ import annotations

import logging
from . import layout, storage
from .backend_table import FORMATS
from .backends import BACKENDS, backend_class
from .errors import CheckpointError
from .reader import locate, section_reader
from .state import TENSOR_SECTIONS

_log = logging.getLogger(__name__)


def _is_tensor_payload(name: str, backend: str) -> bool:
    """Files holding model/optimizer in a given format (not copied: rewritten)."""
    if backend == "dcp":
        return name == ".metadata" or name.endswith(".distcp")
    return name in ("model.pt", "optimizer.pt")


def convert(src, dst, to: str):
    """Convert SRC to format ``to`` under DST; return the new step folder."""
    if to not in FORMATS:
        raise CheckpointError(f"cannot convert to {to!r}; choose one of: {', '.join(FORMATS)}")
    where, manifest = locate(src)
    if manifest is None:
        raise CheckpointError(f"{where} is a single file; convert needs a committed checkpoint folder")
    frm = manifest["backend"]
    if frm not in BACKENDS:
        raise CheckpointError(f"{where}: no reader for backend {frm!r}")
    if frm == to or (to == "vanilla" and frm == "concurrent"):
        raise CheckpointError(f"{where} is already in {to} format (backend {frm}); nothing to convert")
    step = int(manifest["step"])
    dst = storage.as_path(dst)
    step_dir = dst if layout.STEP_DIR_RE.match(dst.name) else dst / layout.step_dir_name(step)
    if step_dir.name != layout.step_dir_name(step):
        raise CheckpointError(f"{where} is step {step}, but DST names {step_dir.name}; give the experiment folder, or "
                              f"{layout.step_dir_name(step)}")
    if (step_dir / layout.COMMITTED).exists():
        raise CheckpointError(f"{step_dir} already holds a committed checkpoint; choose another DST")
    if to == "dcp" and frm == "vanilla" and not storage.medium(where).filesystem:
        raise CheckpointError(f"{where}: reading a vanilla checkpoint from object storage is not supported; copy it first")
    if step_dir.exists():  # the leftover of an interrupted convert (never committed), and nothing else
        layout.remove_step_dir(step_dir, "choose another DST, or move them away")
    step_dir.mkdir(parents=True)

    sections = {s: section_reader(frm)(where, manifest, s) for s in TENSOR_SECTIONS}
    files: dict[str, dict] = {}
    for name, rec in manifest["files"].items():  # the non-tensor files are the same in every format
        if _is_tensor_payload(name, frm):
            continue
        algorithm = manifest["checksum"]
        data = storage.read_checked(storage.as_path(where) / name, rec["size"], algorithm, rec[algorithm])
        files[name] = storage.write_bytes(step_dir / name, data)
    files.update(backend_class(to).write_sections(step_dir, sections))  # vanilla: model.pt/optimizer.pt; dcp: one rank
    layout.commit(step_dir, step, int(manifest["world_size"]), to, [{"rank": 0, "files": files}],
                  meta={"converted_from": frm, "source": str(where)})
    _log.info(f"converted {where} ({frm}, {manifest['world_size']} rank(s)) -> {step_dir} ({to}, {len(files)} files, "
        f"committed)")
    return step_dir
