"""What a rank and a warm standby say to each other (warm.py), and what each end reads of the other.

A rank sends one request: a JSON object that says what makes its process the rank it is (``describe_rank``). Only
once the standby has answered ``{"go": true}`` does the rank pass its three standard streams (one message "streams"
with the descriptors); then the standby answers ``{"pid": N}`` (its child runs the rank) and, when the child ends,
``{"rc": N}``. Any step may instead be ``{"decline": why}``: the rank starts cold and prints why. The standby checks a
request field by field (``parse_request``) before it uses any of it; each end checks the other with SO_PEERCRED
(``peer_of``).

Both ends import this module: the rank's end runs before train.py's imports, so it holds the standard library only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

from procs import process_age

ANSWER_S = 5.0  # a rank waits this long for each answer of the standby before it starts cold; the standby as long for
#                 each message of a rank, and for its child to become the rank
REQUEST_MAX = 1 << 20

# What the kernel says of the rank's process that its child could not take on (credentials, confinement): read from
# /proc/<rank pid>/status and /proc/<rank pid>/ns, compared with the standby's own, declined when they differ.
_CREDENTIALS = ("Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")
_NAMESPACES = ("mnt", "net", "pid", "ipc", "uts", "user", "cgroup")


class Declined(Exception):
    """The standby cannot run this rank as a cold start would: why, in one line (the rank prints it and starts cold)."""


def is_int(v, low: int = -(2 ** 63), high: int = 2 ** 63 - 1) -> bool:
    return type(v) is int and low <= v <= high


def _is_text(v) -> bool:
    return isinstance(v, str) and "\0" not in v


def _is_texts(v) -> bool:
    return isinstance(v, list) and all(_is_text(x) for x in v)


_FIELDS = {  # the request's typed fields: anything else is declined before any of it is used
    "argv": lambda v: _is_texts(v) and len(v) > 0,
    "env": lambda v: isinstance(v, dict) and all(_is_text(k) and k and "=" not in k and _is_text(x)
                                                 for k, x in v.items()),
    "cwd": _is_text,
    "exe": _is_text,
    "prefix": _is_text,
    "flags": lambda v: isinstance(v, list) and all(is_int(x) for x in v),
    "warnoptions": _is_texts,
    "xoptions": lambda v: isinstance(v, dict) and all(_is_text(k) and _is_text(x) for k, x in v.items()),
    "age": lambda v: type(v) in (int, float) and 0 <= v < 1e9,
    "umask": lambda v: is_int(v, 0, 0o777),
    "rlimits": lambda v: isinstance(v, dict) and all(
        isinstance(k, str) and k.startswith("RLIMIT_") and isinstance(x, list) and len(x) == 2
        and all(is_int(n, -1) for n in x) for k, x in v.items()),
    "affinity": lambda v: isinstance(v, list) and 0 < len(v) and all(is_int(x, 0, 2 ** 16) for x in v),
    "nice": lambda v: is_int(v, -20, 19),
    "scheduler": lambda v: isinstance(v, list) and len(v) == 2 and all(is_int(x, 0, 99) for x in v),
    "oom_score_adj": lambda v: is_int(v, -1000, 1000),
    "ignored": lambda v: isinstance(v, list) and all(is_int(x, 1, 64) for x in v),
}


def describe_rank() -> dict:
    """What makes this process the rank it is, for the standby's child to become it (or the standby to decline)."""
    import resource

    mask = os.umask(0)
    os.umask(mask)
    return {"argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd(), "exe": os.path.realpath(sys.executable),
            "prefix": sys.prefix, "flags": interpreter_flags(), "warnoptions": list(sys.warnoptions),
            "xoptions": {k: str(v) for k, v in sys._xoptions.items()}, "age": process_age() or 0.0, "umask": mask,
            "rlimits": {name: list(resource.getrlimit(getattr(resource, name))) for name in dir(resource)
                        if name.startswith("RLIMIT_")},
            "affinity": sorted(os.sched_getaffinity(0)), "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "scheduler": [os.sched_getscheduler(0), os.sched_getparam(0).sched_priority],
            "oom_score_adj": oom_score_adj(), "ignored": _ignored_signals()}


def parse_request(message: bytes) -> dict:
    """A rank's request, checked field by field; Declined with why otherwise."""
    try:
        request = json.loads(message)
    except (ValueError, RecursionError):
        raise Declined("its request is not JSON") from None
    if not isinstance(request, dict):
        raise Declined("its request is not a JSON object")
    if set(request) != set(_FIELDS):
        odd = sorted(set(request) ^ set(_FIELDS))
        raise Declined(f"its request has other fields than a rank's ({short(', '.join(odd))}): another PyRecover "
                       "version?")
    bad = [name for name, ok in _FIELDS.items() if not ok(request[name])]
    if bad:
        raise Declined(f"its request's {', '.join(bad)} {'has' if len(bad) == 1 else 'have'} the wrong type or range")
    return request


def short(text: str, limit: int = 200) -> str:
    """Client-given text, cut for a log line."""
    return text if len(text) <= limit else text[:limit] + "..."


def interpreter_flags() -> list[int]:
    return [int(flag) for flag in sys.flags]  # ints and bools (safe_path)


def oom_score_adj(pid: int | str = "self") -> int:
    try:
        with open(f"/proc/{pid}/oom_score_adj") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


def _ignored_signals() -> list[int]:
    """Signals this process ignores (nohup's SIGHUP): its child ignores them too, and they are not forwarded."""
    return sorted(int(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)
                  and signal.getsignal(s) is signal.SIG_IGN)


def _proc_text(pid: int | str, name: str) -> str:
    try:
        with open(f"/proc/{pid}/{name}") as f:
            return f.read()
    except OSError:
        return ""


def confinement(pid: int | str) -> dict[str, str]:
    """The credentials, namespaces and cgroup of a process, as the kernel reports them."""
    status = dict(line.split(":", 1) for line in _proc_text(pid, "status").splitlines() if ":" in line)
    seen = {name: status.get(name, "").strip() for name in _CREDENTIALS}
    for ns in _NAMESPACES:
        try:
            seen[f"{ns} namespace"] = os.readlink(f"/proc/{pid}/ns/{ns}")
        except OSError:
            seen[f"{ns} namespace"] = "?"
    seen["cgroup"] = _proc_text(pid, "cgroup")
    return seen


def nodetrust():
    """checkpoint/nodetrust.py, loaded without the checkpoint package (which imports torch): the rank side runs before
    train.py's imports. The one rule for folders every user of a node shares."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_pyrecover_nodetrust", os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint", "nodetrust.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def peer_of(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket, as the kernel saw it connect or listen."""
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def parent_of(pid: int) -> int | None:
    try:
        return int(_proc_text(pid, "stat").rsplit(")", 1)[1].split()[1])
    except (ValueError, IndexError):
        return None


def receive(conn: socket.socket) -> dict:
    """One JSON object from the standby; ValueError if it is anything else."""
    data = conn.recv(REQUEST_MAX)
    if not data:
        raise ValueError("it closed the connection")
    reply = json.loads(data)
    if not isinstance(reply, dict):
        raise ValueError("its answer is not a JSON object")
    return reply
