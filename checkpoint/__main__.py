"""`python -m checkpoint list|verify|inspect PATH` — look at checkpoints without training; `convert` between formats.

    list DIR [--mirror MIRROR] [--local LOCAL]
                   one row per step of the run in experiment folder DIR: step, tokens, loss, eval (val) loss, time,
                   size, where it is held and its status (latest, the --keep-best ones, just-in-time saves). Held in:
                   `shared` (DIR), `mirror`, `local 2/2` (this node's local tier: its ranks' parts of the world's),
                   `peer: rank 1` (the peer copies this node holds for another node's ranks). The mirror and the
                   local tier are those DIR/places.json names (the run records them at every start), or MIRROR
                   and LOCAL (DIR itself may be a run's folder in a local tier)
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
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import layout, logs, naming, storage
from .errors import CheckpointError
from .fsio import MiB
from .backend_table import FORMATS  # convert's; convert itself (torch) loads when it runs
from .places import PEER_DIR, rank_dirs, rank_of, tier_root  # <tier>/rank-N, <tier>/peer/rank-N: parts by rank
from .retention import best_steps, eval_loss
from .naming import setting
from .settings import PLACES_RECORD


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




@dataclass
class _Place:
    """Where copies of the run's steps may be: ``root``, how it was found, whether it is there."""
    name: str
    root: object
    found: str = ""
    present: bool = True
    tier: bool = False  # a node-local tier: rank-N folders of parts and peer/rank-N folders of peer copies


@dataclass
class _Step:
    """One step's copies: full checkpoints (shared folder, mirror) and this node's parts (by rank)."""
    full: dict = field(default_factory=dict)  # place name -> CheckpointInfo
    local: dict = field(default_factory=dict)  # rank -> CheckpointInfo
    peer: dict = field(default_factory=dict)  # the sender's rank -> CheckpointInfo


def _checked(info: layout.CheckpointInfo) -> str:
    """``valid``, or what is wrong with the copy (a committed one is verified: sizes and checksums)."""
    if not info.committed:
        return "uncommitted (interrupted save)"
    try:
        info.manifest = layout.verify(info.path)
        return "valid"
    except CheckpointError as e:
        info.problems.append(str(e))
        return f"INVALID: {e}"


def cmd_list(path, local: Path | None = None, mirror=None) -> int:
    """One row per step with every place that holds it: the shared run folder, its mirror, this node's local tier
    (each rank's part) and the peer copies this node holds for ranks of another node."""
    places = _places(path, local, mirror)
    steps: dict[int, _Step] = {}
    for place in places:
        if not place.present:
            continue
        if not place.tier:
            for info in layout.list_checkpoints(place.root):
                steps.setdefault(info.step, _Step()).full[place.name] = info
            continue
        for kind, folder in (("local", place.root), ("peer", place.root / PEER_DIR)):
            for rank_dir in rank_dirs(folder):
                for info in layout.list_checkpoints(rank_dir):
                    getattr(steps.setdefault(info.step, _Step()), kind)[rank_of(rank_dir)] = info
    if not steps:
        if places[0].tier:
            raise CheckpointError(f"no local tier of this run at {places[0].root} (expected the run's "
                                  f"{setting('local_dir')}, whose <experiment>-<key> folder holds rank-N folders)")
        raise CheckpointError(f"no checkpoints under {path} (expected an experiment folder holding step-N folders)")
    status = {id(info): _checked(info) for s in steps.values()
              for info in (*s.full.values(), *s.local.values(), *s.peer.values())}

    def valid(info) -> bool:
        return status[id(info)] == "valid"

    # A row's checkpoint: its first valid full copy (shared folder, then mirror), the one `latest` would load
    main = {step: next((i for i in s.full.values() if valid(i)), None) for step, s in steps.items()}
    full = sorted((info for info in main.values() if info is not None), key=lambda i: i.step)
    latest = max((i.step for i in full), default=None)  # as resolve_latest over both: the newest that verifies
    # The --keep-best checkpoints (as the newest card says); without --keep-best, the single lowest eval loss.
    keep_best = _card(full[-1]).get("retention", {}).get("keep_best", 0) if full else 0
    best = best_steps(full, keep_best or 1)

    rows = []
    for step in sorted(steps):
        s, info = steps[step], main[step]
        parts = [i for i in (*s.local.values(), *s.peer.values()) if valid(i)]
        shown = info or (parts[0] if parts else None)  # whose card, backend and world size the row shows
        held = [name for name, i in s.full.items() if valid(i)]
        ranks = sorted(r for r, i in s.local.items() if valid(i))
        if ranks:
            world = shown.manifest["world_size"]
            held.append(f"local {len(ranks)}/{world}" + ("" if len(ranks) == world else f" ({_ranks(ranks)})"))
        if peers := sorted(r for r, i in s.peer.items() if valid(i)):
            held.append(f"peer: {_ranks(peers)}")
        problems = [(name, i) for name, i in s.full.items() if not valid(i)]
        problems += [(f"local {_ranks([r])}", i) for r, i in sorted(s.local.items()) if not valid(i)]
        problems += [(f"peer {_ranks([r])}", i) for r, i in sorted(s.peer.items()) if not valid(i)]
        notes = [f"{where}: {status[id(i)]}" for where, i in problems]
        if info is not None:
            marks = ["<- latest"] if step == latest else []
            if step in best:
                marks.append(f"best #{best.index(step) + 1}" if keep_best else "lowest eval")
            if info.manifest.get("meta", {}).get("jit"):
                marks.append("just-in-time")
            notes.insert(0, "  ".join(["valid"] + marks))
        elif "shared" in s.full:  # the shared folder's copy is the step's own word on it: no place named
            notes[0] = status[id(s.full["shared"])]
        elif parts:
            notes.insert(0, "valid parts")  # a part alone is not a checkpoint: a restart needs every rank's
        size = info.size_bytes if info is not None else sum(i.size_bytes for i in parts)
        rows.append((step, shown, size, "  ".join(held) or "-", "; ".join(notes)))

    if len(places) > 1 or places[0].tier:  # which folder each place is (a run with its shared folder alone: none)
        width = max(len(p.name) for p in places)
        for place in places:
            found = [place.found] if place.found else []
            print(f"{place.name:<{width}}  {place.root}" + (f"  ({'; '.join(found + ['none here'])})"
                                                            if not place.present else
                                                            f"  ({found[0]})" if found else ""))
    held_width = max(len("held in"), *(len(r[3]) for r in rows))
    print(f"{'step':>10} {'tokens':>8} {'loss':>8} {'eval':>8}  {'saved (UTC)':<19} {'size MiB':>9}  {'backend':<10} "
          f"{'ranks':>5}  {'held in':<{held_width}}  status")
    for step, info, size, held, text in rows:
        card = _card(info) if info is not None else {}
        progress, saved = card.get("progress", {}), card.get("time", {}).get("saved_utc", "")
        if not saved and info is not None:
            saved = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(info.manifest.get("created_unix", 0)))
        backend, ranks = (info.manifest["backend"], str(info.manifest["world_size"])) if info else ("-", "-")
        print(f"{step:>10} {_count(progress.get('tokens_seen')):>8} {_num(progress.get('loss_last')):>8} "
              f"{_num(eval_loss(info) if info is not None else None):>8}  "
              f"{saved.replace('T', ' ')[:19]:<19} {size / MiB:>9.1f}  {backend:<10} {ranks:>5}  "
              f"{held:<{held_width}}  {text}")
    return 0


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"


def _places(run, local, mirror) -> list[_Place]:
    """The places to look in: the shared run folder ``run``; its mirror and this node's local tier as given
    (``--mirror``, ``--local``: a bad one is an error), else as the run's resolved config names them (absent ones are
    shown as such). ``run`` may itself be the run's folder in a local tier: then that alone."""
    if local is None and mirror is None and _is_tier(run):
        return [_Place("local", run, "this node", tier=True)]
    places = [_Place("shared", run)]
    recorded, spelled = _recorded(run)
    naming.spell_as(spelled)  # this tool's lines name the run's settings as its user typed them

    def found(name: str) -> str:
        return f"{spelled.get(name, name)} {recorded[name]} in {PLACES_RECORD}"
    if mirror is not None:
        root = mirror / run.name
        if not root.is_dir():
            root = mirror if layout.list_checkpoints(mirror) else None
        if root is None:
            raise CheckpointError(f"no mirror of this run at {mirror} (expected the run's {setting('mirror_dir')}, "
                                  f"holding {run.name}/step-N folders)")
        places.append(_Place("mirror", root, "--mirror"))
    elif recorded.get("mirror_dir"):
        root = storage.as_path(recorded["mirror_dir"]) / run.name
        places.append(_Place("mirror", root, found("mirror_dir"), present=root.is_dir()))
    if local is not None:
        root = local if _is_tier(local) else tier_root(local, run.name, str(run))
        if not _is_tier(root):
            raise CheckpointError(f"no local tier of this run at {root} (expected the run's {setting('local_dir')}, "
                                  "whose <experiment>-<key> folder holds rank-N folders)")
        places.append(_Place("local", root, "this node, --local", tier=True))
    elif recorded.get("local_dir"):
        root = tier_root(Path(recorded["local_dir"]), run.name, str(run))
        places.append(_Place("local", root, f"this node, {found('local_dir')}", present=_is_tier(root), tier=True))
    return places


def _recorded(run) -> tuple[dict, dict]:
    """What the run recorded of its places at its last start (PLACES_RECORD: the settings by name, paths absolute)
    and how its front end spells them; ({}, {}) when it recorded none (a copy, a run of an older PyRecover)."""
    try:
        record = json.loads(storage.read_small(run / PLACES_RECORD))
    except (OSError, ValueError, CheckpointError):
        return {}, {}
    places, spelled = (record.get("places"), record.get("spelled")) if isinstance(record, dict) else (None, None)
    if not isinstance(places, dict):
        return {}, {}
    places = {k: v for k, v in places.items() if isinstance(v, str) and v}
    return places, {k: v for k, v in spelled.items() if isinstance(v, str)} if isinstance(spelled, dict) else {}


def _is_tier(path) -> bool:
    """Whether ``path`` is a run's folder in a node-local tier: its ranks' folders, or only peer copies."""
    if not isinstance(path, Path) or path.name == PEER_DIR:  # peer/ holds rank folders too, of other nodes' ranks
        return False
    return bool(rank_dirs(path) or rank_dirs(path / PEER_DIR))


def cmd_verify(path: Path) -> int:
    from .reader import check_each  # torch: loaded for the commands that read tensors

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
    from .reader import read_section, targets as _targets  # torch

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
                                     help="this node's local tier of the run (default: as the run's "
                                          f"{PLACES_RECORD} names it)")
    sub.choices["list"].add_argument("--mirror", type=storage.as_path, default=None, metavar="MIRROR",
                                     help=f"the run's mirror (default: as its {PLACES_RECORD} names it)")
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
            return cmd_list(args.path, args.local, args.mirror)
        return {"verify": cmd_verify, "inspect": cmd_inspect}[args.cmd](args.path)
    except (CheckpointError, OSError) as e:  # bad input is one line, never a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
