"""`python -m checkpoint list|verify|inspect PATH` — look at checkpoints without training; `convert` between formats.

    list DIR       every step folder under an experiment folder: step, size, committed, valid
    verify PATH    check sizes and checksums of one step folder, or of every committed one under DIR (exit 1 if bad)
    inspect PATH   what a checkpoint holds: manifest, files, tensors of the model section
    convert SRC DST --to vanilla|dcp
                   rewrite a checkpoint (step or experiment folder) in the other format under DST, committed
PATH/SRC/DST may be s3://bucket/prefix (AWS_* variables; the s3 extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import layout, logs, storage
from .errors import CheckpointError
from .reader import read_section

MiB = 1 << 20


def _targets(path: Path) -> list[layout.CheckpointInfo]:
    if layout.STEP_DIR_RE.match(path.name) or (path / layout.MANIFEST).exists():
        m = layout.STEP_DIR_RE.match(path.name)
        return [layout.CheckpointInfo(int(m.group(1)) if m else -1, path, (path / layout.COMMITTED).exists())]
    return layout.list_checkpoints(path)


def cmd_list(path: Path) -> int:
    infos = layout.list_checkpoints(path)
    if not infos:
        raise CheckpointError(f"no checkpoints under {path} (expected an experiment folder holding step-N folders)")
    latest = layout.resolve(path, "latest", quiet=True)
    print(f"{'step':>10}  {'size MiB':>9}  {'backend':<10} {'ranks':>5}  status")
    for info in infos:
        status, backend, ranks = "uncommitted (interrupted save)", "-", "-"
        if info.committed:
            try:
                info.manifest = layout.verify(info.path)
                status = "valid" + ("  <- latest" if latest and latest.step == info.step else "")
                backend, ranks = info.manifest["backend"], str(info.manifest["world_size"])
            except CheckpointError as e:
                status = f"INVALID: {e}"
        print(f"{info.step:>10}  {info.size_bytes / MiB:>9.1f}  {backend:<10} {ranks:>5}  {status}")
    return 0


def cmd_verify(path: Path) -> int:
    bad = 0
    targets = _targets(path)
    if not targets:
        print(f"error: no checkpoints under {path}", file=sys.stderr)
        return 2
    for info in targets:
        if not info.committed:
            print(f"{info.path}: not committed")
            bad += 1
            continue
        try:
            manifest = layout.verify(info.path)
            print(f"{info.path}: OK ({len(manifest['files'])} files verified)")
        except CheckpointError as e:
            print(f"{info.path}: FAILED: {e}")
            bad += 1
    return 1 if bad else 0


def cmd_inspect(path: Path) -> int:
    targets = _targets(path) if not path.is_file() else None
    if targets == []:
        raise CheckpointError(f"no checkpoints under {path} (expected a step-N folder or an experiment folder)")
    info = targets[-1] if targets else None
    if info is not None:
        manifest = layout.verify(info.path)
        print(json.dumps({k: v for k, v in manifest.items() if k != "files"}, indent=1))
        for name, rec in manifest["files"].items():
            print(f"  {name:<40} {rec['size'] / MiB:9.2f} MiB  crc32 {rec.get('crc32')}")
    tensors = read_section(info.path if info else path, "model")
    total = 0
    for name, t in tensors.items():
        if hasattr(t, "shape"):
            total += t.numel()
            print(f"  {name:<50} {str(t.dtype).replace('torch.', ''):<9} {list(t.shape)}")
    print(f"model: {len(tensors)} tensors, {total / 1e6:.2f}M elements")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("list", "verify", "inspect"):
        sub.add_parser(name).add_argument("path", type=storage.as_path)
    conv = sub.add_parser("convert", help="rewrite a checkpoint in another backend's format")
    conv.add_argument("src", help="step folder, or experiment folder (its latest)")
    conv.add_argument("dst", help="experiment folder (result: DST/step-N) or a step-N folder")
    conv.add_argument("--to", required=True, choices=["vanilla", "dcp"])
    logs.setup()  # e.g. convert's line
    try:
        args = p.parse_args(argv)  # inside: an s3:// path without a bucket is a CheckpointError too
        if args.cmd == "convert":
            from .convert import convert

            convert(args.src, args.dst, args.to)
            return 0
        if not args.path.exists():
            raise CheckpointError(f"{args.path} does not exist")
        return {"list": cmd_list, "verify": cmd_verify, "inspect": cmd_inspect}[args.cmd](args.path)
    except (CheckpointError, OSError) as e:  # bad input is one line, never a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
