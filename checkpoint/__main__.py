"""`python -m checkpoint list|verify|inspect PATH` — look at checkpoints without training; `convert` between formats.

    list DIR [--local LOCAL]
                   every step folder under an experiment folder: step, tokens, loss, eval (val) loss, time, size, status
                   (latest, the --keep-best ones, just-in-time saves); with --local LOCAL (the run's
                   --local-checkpoint-dir), this node's local tier of the run: each rank's parts (DIR itself may be
                   a run's folder in a local tier)
    verify PATH    check sizes and checksums of one step folder, or of every committed one under DIR (exit 1 if bad)
    inspect PATH   what a checkpoint holds: manifest, card, files, tensors of the model section
    convert SRC DST --to vanilla|dcp
                   rewrite a checkpoint (step or experiment folder) in the other format under DST, committed
PATH/SRC/DST may be s3://bucket/prefix (AWS_* variables; the s3 extra).
The library knows no model, so what needs model.py lives beside it: `python evaluation.py validate PATH` recomputes
the probe loss from the weights; `python hf.py export SRC OUT --to hf` writes a Hugging Face Llama folder.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from . import layout, logs, storage
from .errors import CheckpointError
from .fsio import MiB
from .convert import FORMATS
from .reader import check_each, read_section, targets as _targets
from .tier import tier_root


def _card(info: layout.CheckpointInfo) -> dict:
    return (info.manifest or {}).get("meta", {}).get("card", {})


def _count(n) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(int(n))


def _num(x, fmt: str = ".4f") -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "-"


def cmd_list(path: Path, local: Path | None = None) -> int:
    if local is None and _rank_dirs(path):
        return _list_local(path)
    if local is not None:
        local = _local_run_folder(local, path)
    infos = layout.list_checkpoints(path)
    if not infos and local is not None:
        print(f"no checkpoints under {path} yet")
        return _list_local(local)
    if not infos:
        raise CheckpointError(f"no checkpoints under {path} (expected an experiment folder holding step-N folders)")
    try:
        latest = layout.resolve(path, "latest", quiet=True)
    except layout.NoValidCheckpoint:
        latest = None  # each is listed INVALID below, with its reason
    for info in infos:
        if info.committed:
            try:
                info.manifest = layout.verify(info.path)
            except CheckpointError as e:
                info.problems.append(str(e))
    # The --keep-best checkpoints (as the newest card says); without --keep-best, the single lowest eval loss.
    newest = next((i for i in reversed(infos) if i.manifest), None)
    keep_best = _card(newest).get("retention", {}).get("keep_best", 0) if newest else 0
    best = layout.best_steps([i for i in infos if i.manifest], keep_best or 1)
    print(f"{'step':>10} {'tokens':>8} {'loss':>8} {'eval':>8}  {'saved (UTC)':<19} {'size MiB':>9}  {'backend':<10} "
          f"{'ranks':>5}  status")
    for info in infos:
        card = _card(info)
        progress, saved = card.get("progress", {}), card.get("time", {}).get("saved_utc", "")
        if not saved and info.manifest:
            saved = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(info.manifest.get("created_unix", 0)))
        status, backend, ranks = "uncommitted (interrupted save)", "-", "-"
        if info.problems:
            status = f"INVALID: {info.problems[0]}"
        elif info.manifest:
            backend, ranks = info.manifest["backend"], str(info.manifest["world_size"])
            marks = ["<- latest"] if latest and latest.step == info.step else []
            if info.step in best:
                marks.append(f"best #{best.index(info.step) + 1}" if keep_best else "lowest eval")
            if info.manifest.get("meta", {}).get("jit"):
                marks.append("just-in-time")
            status = "  ".join(["valid"] + marks)
        print(f"{info.step:>10} {_count(progress.get('tokens_seen')):>8} {_num(progress.get('loss_last')):>8} "
              f"{_num(layout.eval_loss(info) if info.manifest else None):>8}  {saved.replace('T', ' ')[:19]:<19} "
              f"{info.size_bytes / MiB:>9.1f}  {backend:<10} {ranks:>5}  {status}")
    return _list_local(local) if local is not None else 0


def _local_run_folder(local: Path, run) -> Path:
    """The run's folder in the local tier ``local`` (its --local-checkpoint-dir, or that folder itself)."""
    return local if _rank_dirs(local) else tier_root(local, run.name, str(run))


def _rank_dirs(path: Path) -> list[Path]:
    """The rank folders of a node-local tier folder (tier.py), if ``path`` is one."""
    return sorted(p for p in path.iterdir() if p.is_dir() and re.fullmatch(r"rank-\d{5,}", p.name)) \
        if isinstance(path, Path) and path.is_dir() else []


def _list_local(folder: Path) -> int:
    """Each rank's parts in this node's local tier (verified; a part alone is not a checkpoint: the run agrees at
    restart on a step every rank holds)."""
    ranks = _rank_dirs(folder)
    if not ranks:
        raise CheckpointError(f"no local tier of this run at {folder} (expected the run's --local-checkpoint-dir, "
                              "whose <experiment>-<key> folder holds rank-N folders)")
    print(f"\nlocal tier {folder} (this node):")
    print(f"{'rank':>6} {'step':>10}  {'size MiB':>9}  status")
    for rank_dir in ranks:
        for info in layout.list_checkpoints(rank_dir):
            status = "uncommitted (interrupted save)"
            if info.committed:
                try:
                    info.manifest = layout.verify(info.path)
                    shared = any(n.endswith(".pt") and not n.startswith("rank-") for n in info.manifest["files"])
                    status = "valid" + ("  (with the replicated pieces: node leader)" if shared else "")
                except CheckpointError as e:
                    status = f"INVALID: {e}"
            print(f"{rank_dir.name[5:].lstrip('0') or '0':>6} {info.step:>10}  {info.size_bytes / MiB:>9.1f}  {status}")
    return 0


def cmd_verify(path: Path) -> int:
    return check_each(path, lambda info, manifest: (True, f"OK ({len(manifest['files'])} files verified)"))


def _show_card(card: dict) -> None:
    """The card as `section.key: value` lines (the probe's tokens as their count; the long flags section last)."""
    for section, values in sorted(card.items(), key=lambda item: item[0] == "flags"):
        if not isinstance(values, dict):
            print(f"  {section}: {values}")
            continue
        for key, value in values.items():
            if key == "probe_tokens":
                value = f"{len(value)} x {len(value[0]) if value else 0} tokens"
            elif isinstance(value, dict):
                value = ", ".join(f"{k}={v}" for k, v in value.items())
            print(f"  {section}.{key}: {value}")


def cmd_inspect(path: Path) -> int:
    targets = _targets(path) if not path.is_file() else None
    if targets == []:
        raise CheckpointError(f"no checkpoints under {path} (expected a step-N folder or an experiment folder)")
    info = targets[-1] if targets else None
    if info is not None:
        manifest = layout.verify(info.path)
        meta = manifest.get("meta", {})
        print(json.dumps({k: v for k, v in manifest.items() if k not in ("files", "meta")}, indent=1))
        extra = {k: v for k, v in meta.items() if k != "card"}
        if extra:
            print(f"meta: {json.dumps(extra)}")
        if meta.get("card"):
            print("card:")
            _show_card(meta["card"])
        algorithm = manifest.get("checksum", "crc32")
        print("files:")
        for name, rec in manifest["files"].items():
            print(f"  {name:<40} {rec['size'] / MiB:9.2f} MiB  {algorithm} {rec.get(algorithm)}")
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
    sub.choices["list"].add_argument("--local", type=Path, default=None, metavar="LOCAL",
                                     help="also this node's local tier of the run: its --local-checkpoint-dir")
    conv = sub.add_parser("convert", help="rewrite a checkpoint in another backend's format")
    conv.add_argument("src", help="step folder, or experiment folder (its latest)")
    conv.add_argument("dst", help="experiment folder (result: DST/step-N) or a step-N folder")
    conv.add_argument("--to", required=True, choices=FORMATS)
    logs.setup()  # e.g. convert's line
    try:
        args = p.parse_args(argv)  # inside: an s3:// path without a bucket is a CheckpointError too
        if args.cmd == "convert":
            from .convert import convert

            convert(args.src, args.dst, args.to)
            return 0
        if not args.path.exists():
            raise CheckpointError(f"{args.path} does not exist")
        if args.cmd == "list":
            return cmd_list(args.path, args.local)
        return {"verify": cmd_verify, "inspect": cmd_inspect}[args.cmd](args.path)
    except (CheckpointError, OSError) as e:  # bad input is one line, never a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
