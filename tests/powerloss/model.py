"""The persistence model: which states a power cut after the k-th recorded operation may leave on disk.

What survives is decided per profile (``PROFILES``):

``posix`` (strict POSIX, the weakest promise a program may rely on)
    A file's data is durable up to its last ``fsync``/``fdatasync``. A create, mkdir, link, unlink, rmdir or rename
    is durable once a folder it touches is fsynced; a rename is one atomic operation. Unsynced operations may each
    survive or not, in any combination; an unsynced write may also survive torn (any subset of its 4 KiB pages) or
    as zeros (its size reached the disk, its data did not).
``ext4`` (``data=ordered`` with delayed allocation, the Linux default)
    Metadata goes through one ordered journal: an fsync of any file or folder commits every earlier namespace
    operation, and a crash keeps a prefix of the uncommitted ones. Unsynced data is lost (delayed allocation), except
    that a rename over an existing file carries the renamed file's data with it (``auto_da_alloc``); a crash may keep
    a prefix of a file's unsynced writes, the last one torn at a page.
``nfs`` (NFS-like client caching)
    Unsynced data is lost. A rename (or a RENAME_EXCHANGE swap) is not atomic: its new name and the removal of its
    old name become durable separately, each with an fsync of its own folder, and a crash may keep either, both or
    neither.

``states(ops, k, profile, variants, seed)`` yields the distinct durable states after the first k operations: the
state with only what was made durable, then seeded variants that also keep unsynced operations the profile allows.
A state is a dict ``path -> ("dir",) | ("symlink", target) | ("file", spec)``; ``spec`` says which writes and
truncates build the file's bytes, so equal states compare equal without reading any data, and ``materialize``
builds the bytes only for the states that are run.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

PAGE = 4096
PROFILES = ("posix", "ext4", "nfs")
NAMESPACE = {"create", "mkdir", "symlink", "link", "unlink", "rmdir", "rename", "rename-new", "rename-old", "exchange",
             "exchange-new", "exchange-old"}
DATA = {"write", "truncate"}


def load(log_dir: Path) -> list[list]:
    with open(Path(log_dir) / "ops.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def first_op_after_barrier(ops: list[list]) -> int:
    return next(i for i, op in enumerate(ops) if op[0] == "barrier") + 1


@dataclass
class _Replay:
    """Everything made durable by the first k operations, and what is still pending."""
    ns: list = field(default_factory=list)  # [index, op, touched folders, durable?]
    data: dict = field(default_factory=dict)  # node -> [op index]
    synced: dict = field(default_factory=dict)  # node -> how many of its data ops are durable
    symlinks: dict = field(default_factory=dict)  # node -> target
    folders: set = field(default_factory=lambda: {0})


def _touched(op: list) -> tuple:
    name = op[0]
    if name in ("rename", "exchange"):
        return (op[2], op[4])
    if name in ("rename-new", "exchange-new"):
        return (op[4],)
    return (op[2],)


def _replay(ops: list[list], k: int, profile: str) -> _Replay:
    r = _Replay()
    for i, op in enumerate(ops[:k]):
        name = op[0]
        if name == "barrier":
            for entry in r.ns:
                entry[3] = True
            for node, idx in r.data.items():
                r.synced[node] = len(idx)
        elif name in NAMESPACE:
            if name == "mkdir":
                r.folders.add(op[4])
            if name == "symlink":
                r.symlinks[op[4]] = op[5]
            if name in ("rename", "exchange") and profile == "nfs":  # not atomic: each folder's half on its own
                r.ns.append([i, [name + "-new", *op[1:]], (op[4],), False])
                r.ns.append([i, [name + "-old", *op[1:]], (op[2],), False])
                continue
            entry = [i, op, _touched(op), False]
            if name == "rename" and profile == "ext4" and op[7] is not None and op[6] in r.data:
                entry.append((op[6], len(r.data[op[6]])))  # auto_da_alloc: the data goes with the rename
            r.ns.append(entry)
        elif name in DATA:
            r.data.setdefault(op[2], []).append(i)
        elif name == "fsync":
            r.synced[op[2]] = len(r.data.get(op[2], []))
            if profile == "ext4":  # one journal: any fsync commits all earlier metadata
                for entry in r.ns:
                    entry[3] = True
        elif name == "fsyncdir":
            folder = op[2]
            for entry in r.ns:
                if profile == "ext4" or folder in entry[2]:
                    entry[3] = True
    return r


def _namespace(r: _Replay, kept_ns: set) -> tuple[dict, dict]:
    """Replay the durable (and kept) namespace operations in log order: folder -> {name: node}; plus the data
    flushed by an ext4 rename-over-existing that made it."""
    entries: dict[int, dict[str, int]] = {0: {}}
    flushed: dict[int, int] = {}
    for pos, entry in enumerate(r.ns):
        if not (entry[3] or pos in kept_ns):
            continue
        op = entry[1]
        name = op[0]
        if name in ("create", "symlink", "link"):
            entries.setdefault(op[2], {})[op[3]] = op[4]
        elif name == "mkdir":
            entries.setdefault(op[2], {})[op[3]] = op[4]
            entries.setdefault(op[4], {})
        elif name in ("unlink", "rmdir"):
            if entries.get(op[2], {}).get(op[3]) == op[4]:
                del entries[op[2]][op[3]]
        elif name in ("rename", "rename-old"):
            if entries.get(op[2], {}).get(op[3]) == op[6]:
                del entries[op[2]][op[3]]
        if name in ("rename", "rename-new"):
            entries.setdefault(op[4], {})[op[5]] = op[6]
        if name in ("exchange", "exchange-new"):  # the second name now holds the first node, and vice versa
            entries.setdefault(op[4], {})[op[5]] = op[6]
        if name in ("exchange", "exchange-old"):
            entries.setdefault(op[2], {})[op[3]] = op[7]
        if len(entry) > 4:
            node, n = entry[4]
            flushed[node] = max(flushed.get(node, 0), n)
    return entries, flushed


def _file_spec(r: _Replay, node: int, extra: dict, flushed: dict) -> tuple:
    idx = r.data.get(node, [])
    n = max(r.synced.get(node, 0), flushed.get(node, 0))
    spec = [(i, "") for i in idx[:n]]
    spec += extra.get(node, [])
    return tuple(spec)


def _tree(r: _Replay, entries: dict, extra: dict, flushed: dict) -> dict:
    state: dict[str, tuple] = {}

    def walk(folder: int, prefix: str, depth: int) -> None:
        if depth > 64:  # a folder made to appear in two places cannot loop, but stay safe
            return
        for name, node in sorted(entries.get(folder, {}).items()):
            path = f"{prefix}{name}"
            if node in r.folders:
                state[path] = ("dir",)
                walk(node, path + "/", depth + 1)
            elif node in r.symlinks:
                state[path] = ("symlink", r.symlinks[node])
            else:
                state[path] = ("file", _file_spec(r, node, extra, flushed))

    walk(0, "", 0)
    return state


def _pending_data_variant(ops: list[list], r: _Replay, rng: random.Random, profile: str) -> dict:
    extra: dict[int, list] = {}
    if profile == "nfs":
        return extra
    for node, idx in r.data.items():
        pending = idx[r.synced.get(node, 0):]
        if not pending:
            continue
        if profile == "ext4":  # a prefix of the writes reached the disk, the last one maybe torn
            cut = rng.randint(0, len(pending))
            chosen = [(i, "") for i in pending[:cut]]
            if chosen and ops[chosen[-1][0]][0] == "write" and rng.random() < 0.5:
                chosen[-1] = (chosen[-1][0], _tear(ops[chosen[-1][0]], rng))
        else:  # strict POSIX: any subset, each kept whole, torn or zeroed
            chosen = []
            for i in pending:
                roll = rng.random()
                if roll < 0.4:
                    continue
                if ops[i][0] == "write" and roll < 0.6:
                    chosen.append((i, _tear(ops[i], rng)))
                elif ops[i][0] == "write" and roll < 0.7:
                    chosen.append((i, "zero"))
                else:
                    chosen.append((i, ""))
        if chosen:
            extra[node] = chosen
    return extra


def _tear(op: list, rng: random.Random) -> str:
    """Which of a write's pages reached the disk, as a bit string ("tear:0110..."), the rest reads as zeros."""
    offset, length = op[3], op[5]
    first, last = offset // PAGE, (offset + max(length, 1) - 1) // PAGE
    bits = "".join(rng.choice("01") for _ in range(last - first + 1))
    return "tear:" + bits


def _pending_ns_variant(r: _Replay, rng: random.Random, profile: str) -> set:
    pending = [pos for pos, entry in enumerate(r.ns) if not entry[3]]
    if not pending:
        return set()
    if profile == "ext4":  # an ordered journal: a prefix of what was not committed yet
        return set(pending[:rng.randint(0, len(pending))])
    return {pos for pos in pending if rng.random() < 0.5}


def state_at(ops: list[list], k: int, profile: str, variant: int = 0, seed: int = 0) -> dict:
    """The durable state after the first k operations. variant 0: only what was made durable; variant v > 0: a
    seeded choice of unsynced operations kept too, as the profile allows."""
    if profile not in PROFILES:
        raise ValueError(f"unknown persistence profile {profile!r} (one of {', '.join(PROFILES)})")
    r = _replay(ops, k, profile)
    if variant == 0:
        entries, flushed = _namespace(r, set())
        return _tree(r, entries, {}, flushed)
    rng = random.Random(f"{seed}:{k}:{variant}:{profile}")
    kept = _pending_ns_variant(r, rng, profile)
    entries, flushed = _namespace(r, kept)
    return _tree(r, entries, _pending_data_variant(ops, r, rng, profile), flushed)


def visible_at(ops: list[list], k: int) -> dict:
    """What the process saw after the first k operations (every operation kept): the state a process kill leaves,
    used to start a second traced run from the leftovers of an interrupted one."""
    r = _replay(ops, k, "posix")
    for entry in r.ns:
        entry[3] = True
    for node, idx in r.data.items():
        r.synced[node] = len(idx)
    entries, flushed = _namespace(r, set())
    return _tree(r, entries, {}, flushed)


def signature(state: dict) -> int:
    return hash(tuple(sorted(state.items())))


def materialize(state: dict, ops: list[list], log_dir: Path, out: Path) -> None:
    """Write a durable state as real files under ``out`` (which must not exist)."""
    out.mkdir(parents=True)
    with open(Path(log_dir) / "data.bin", "rb") as blobs:
        for path, what in sorted(state.items()):
            p = out / path
            if what[0] == "dir":
                p.mkdir(exist_ok=True)
            elif what[0] == "symlink":
                os.symlink(what[1], p)
            else:
                p.write_bytes(_content(what[1], ops, blobs))


def files(state: dict, ops: list[list], log_dir: Path, under: str = "") -> dict[str, bytes]:
    """The bytes of every file of a state below ``under`` (a folder path, "" for all), keyed by the path below it."""
    prefix = under.rstrip("/") + "/" if under else ""
    with open(Path(log_dir) / "data.bin", "rb") as blobs:
        return {path[len(prefix):]: _content(what[1], ops, blobs) for path, what in state.items()
                if path.startswith(prefix) and what[0] == "file"}


def _content(spec: tuple, ops: list[list], blobs) -> bytes:
    buf = bytearray()
    for i, how in spec:
        op = ops[i]
        if op[0] == "truncate":
            length = op[3]
            del buf[length:]
            buf.extend(b"\0" * (length - len(buf)))
            continue
        offset, blob, length = op[3], op[4], op[5]
        blobs.seek(blob)
        data = bytearray(blobs.read(length))
        if how == "zero":
            data = bytearray(length)
        elif how.startswith("tear:"):
            bits, first = how[5:], offset // PAGE
            for j, bit in enumerate(bits):
                if bit == "0":
                    lo = max((first + j) * PAGE, offset) - offset
                    hi = min((first + j + 1) * PAGE, offset + length) - offset
                    data[lo:hi] = bytes(hi - lo)
        if len(buf) < offset:
            buf.extend(b"\0" * (offset - len(buf)))
        buf[offset:offset + length] = data
    return bytes(buf)


def states(ops: list[list], profile: str, *, start: int = 0, stop: int | None = None, variants: int = 0,
           seed: int = 0):
    """Every crash point k in [start, stop] (0 = none of the operations after the barrier), each with its base state
    and ``variants`` seeded ones: yields (k, variant, state, signature)."""
    stop = len(ops) if stop is None else stop
    for k in range(max(start, first_op_after_barrier(ops)), stop + 1):
        for v in range(variants + 1):
            s = state_at(ops, k, profile, v, seed)
            yield k, v, s, signature(s)
