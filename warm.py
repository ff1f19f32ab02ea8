"""A warm standby: restart a rank without paying its imports again.

A restart spends most of its time before training resumes on importing PyTorch and on what the first optimizer
imports (torch._dynamo), about 3 s of a 5 s restart measured here (docs/benchmarks.md). A standby process pays them
once, before any failure, and then waits on a Unix socket. A rank started with ``PYRECOVER_WARM=SOCKET`` hands
itself over when a standby is listening there: its arguments, environment, working directory and standard streams go
to the standby, which forks a child that runs train.py exactly as the rank would have (the same code, the same flags;
nothing of a previous run is reused but the imported modules). Without a standby the rank starts cold, as always.

    python warm.py serve /tmp/pyrecover-$USER/warm.sock &       # once per node, before the run
    PYRECOVER_WARM=/tmp/pyrecover-$USER/warm.sock torchrun ... train.py ...

Who is trusted (docs/reliability.md, the threat model): the socket's folder is this user's alone (the standby creates
it 0700, or refuses one that another user owns or can write), and each end checks the other with SO_PEERCRED: a rank
hands itself only to a standby of its own user, and uses a pid from it only if it is the standby's own child. The
child becomes the process a cold start would make: the rank's umask, resource limits, CPU affinity and nice are
applied; a rank whose interpreter, ``sys.prefix``, interpreter options, cgroup or start-up variables differ from the
standby's is declined. Every decline, and a standby that does not answer within ``ANSWER_S``, is a cold start with one
line. A request is read with that deadline inside the standby's event loop and checked field by field: no client can
stop the standby or stall the others.

The rank process stays as the child's stand-in: it forwards the signals it gets (SLURM's warning, SIGTERM) and exits
with the child's exit code. When the rank process dies (SIGKILL, or its torchrun died), the standby SIGKILLs the
child, as the kernel would have killed the rank itself. The standby keeps serving: one per node serves every restart.

This module imports nothing heavy at the top: the rank side runs before train.py's imports (its process helpers,
shared with train.py's modules, are in procs.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import struct
import sys
import time

from procs import die_with_parent, process_age  # the rank side's helpers (stdlib only)

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
_REQUEST_MAX = 1 << 20


# --- what defines a rank's process: the request ---------------------------------------------------------------------

ANSWER_S = 5.0  # a rank waits this long for each answer of the standby before it starts cold; the standby as long for
#                 each message of a rank, and for its child to become the rank
_PENDING_MAX = 32  # connections still talking to the standby: beyond, new ones wait in the backlog (then start cold)

# Variables read when the interpreter, its loader, the OpenMP/BLAS runtimes or torch's config modules start: in a
# standby's child the standby's values would hold, so a rank whose values differ is declined (docs/checkpointing.md
# lists them). OMP_NUM_THREADS is applied instead (torch.set_num_threads), and PYTHONUNBUFFERED has no effect (the
# child opens its own line-buffered streams). A launcher sets the _RUNTIME ones for each rank, read when the process
# group starts, after the hand-over.
_IMPORT_TIME = ("PYTHON", "LD_", "MALLOC_", "GLIBC_TUNABLES", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "TORCH",
                "PYTORCH_")
_RUNTIME = ("TORCHELASTIC_", "TORCH_ELASTIC_", "TORCH_NCCL_", "PYTHONUNBUFFERED", "OMP_NUM_THREADS")
# What the kernel says of the rank's process that its child could not take on (credentials, confinement): read from
# /proc/<rank pid>/status and /proc/<rank pid>/ns, compared with the standby's own, declined when they differ.
_CREDENTIALS = ("Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")
_NAMESPACES = ("mnt", "net", "pid", "ipc", "uts", "user", "cgroup")


class Declined(Exception):
    """The standby cannot run this rank as a cold start would: why, in one line (the rank prints it and starts cold)."""


def _is_int(v, low: int = -(2 ** 63), high: int = 2 ** 63 - 1) -> bool:
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
    "flags": lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
    "warnoptions": _is_texts,
    "xoptions": lambda v: isinstance(v, dict) and all(_is_text(k) and _is_text(x) for k, x in v.items()),
    "age": lambda v: type(v) in (int, float) and 0 <= v < 1e9,
    "umask": lambda v: _is_int(v, 0, 0o777),
    "rlimits": lambda v: isinstance(v, dict) and all(
        isinstance(k, str) and k.startswith("RLIMIT_") and isinstance(x, list) and len(x) == 2
        and all(_is_int(n, -1) for n in x) for k, x in v.items()),
    "affinity": lambda v: isinstance(v, list) and 0 < len(v) and all(_is_int(x, 0, 2 ** 16) for x in v),
    "nice": lambda v: _is_int(v, -20, 19),
    "scheduler": lambda v: isinstance(v, list) and len(v) == 2 and all(_is_int(x, 0, 99) for x in v),
    "oom_score_adj": lambda v: _is_int(v, -1000, 1000),
    "ignored": lambda v: isinstance(v, list) and all(_is_int(x, 1, 64) for x in v),
}


def describe_rank() -> dict:
    """What makes this process the rank it is, for the standby's child to become it (or the standby to decline)."""
    import resource

    mask = os.umask(0)
    os.umask(mask)
    return {"argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd(), "exe": os.path.realpath(sys.executable),
            "prefix": sys.prefix, "flags": _flags(), "warnoptions": list(sys.warnoptions),
            "xoptions": {k: str(v) for k, v in sys._xoptions.items()}, "age": process_age() or 0.0, "umask": mask,
            "rlimits": {name: list(resource.getrlimit(getattr(resource, name))) for name in dir(resource)
                        if name.startswith("RLIMIT_")},
            "affinity": sorted(os.sched_getaffinity(0)), "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "scheduler": [os.sched_getscheduler(0), os.sched_getparam(0).sched_priority],
            "oom_score_adj": _oom_score_adj(), "ignored": _ignored_signals()}


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
        raise Declined(f"its request has other fields than a rank's ({_short(', '.join(odd))}): another PyRecover "
                       "version?")
    bad = [name for name, ok in _FIELDS.items() if not ok(request[name])]
    if bad:
        raise Declined(f"its request's {', '.join(bad)} {'has' if len(bad) == 1 else 'have'} the wrong type or range")
    return request


def _short(text: str, limit: int = 200) -> str:
    """Client-given text, cut for a log line."""
    return text if len(text) <= limit else text[:limit] + "..."


def _flags() -> list[int]:
    return [int(flag) for flag in sys.flags]  # ints and bools (safe_path)


def _oom_score_adj(pid: int | str = "self") -> int:
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


def _confinement(pid: int | str) -> dict[str, str]:
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


def _nodetrust():
    """checkpoint/nodetrust.py, loaded without the checkpoint package (which imports torch): the rank side runs before
    train.py's imports. The one rule for folders every user of a node shares."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_pyrecover_nodetrust", os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint", "nodetrust.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _peer(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket, as the kernel saw it connect or listen."""
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def _parent_of(pid: int) -> int | None:
    try:
        return int(_proc_text(pid, "stat").rsplit(")", 1)[1].split()[1])
    except (ValueError, IndexError):
        return None


def _message(conn: socket.socket) -> dict:
    """One JSON object from the standby; ValueError if it is anything else."""
    data = conn.recv(_REQUEST_MAX)
    if not data:
        raise ValueError("it closed the connection")
    reply = json.loads(data)
    if not isinstance(reply, dict):
        raise ValueError("its answer is not a JSON object")
    return reply


# --- the rank's side -------------------------------------------------------------------------------------------------

def hand_over(path: str) -> int | None:
    """Run this rank in the standby listening at ``path``: its exit code, or None for a cold start (no standby, or it
    could not be trusted, declined or did not answer: one line says why)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # die with torchrun, as distributed.follow_launcher ties a cold rank
        die_with_parent(os.getppid())
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(ANSWER_S)

    def cold(why: str) -> None:
        print(f"warm standby {path} not used ({why}): a cold start", file=sys.stderr, flush=True)
        conn.close()  # a child the standby may have started for this rank dies with the connection

    try:
        conn.connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        conn.close()
        return None  # nobody listening: a cold start, the normal case without a standby
    except OSError as e:
        return cold(f"it did not accept: {e.strerror or e}")
    # Before anything is sent (the environment holds the user's keys): the listener must be this user's, in a folder
    # only this user can write.
    standby, uid = _peer(conn)
    if uid != os.geteuid():
        return cold(f"it is served by uid {uid}, not by this user (uid {os.geteuid()})")
    why = _nodetrust().owner_only_reason(os.path.dirname(os.path.abspath(path)))
    if why is not None:
        return cold(f"{why}: another user could serve there")
    # Two steps: the request, then -- only once the standby has agreed -- the streams. A declining, frozen or slow
    # standby never holds this rank's stdout/stderr open (a pipe's reader would wait for its end).
    try:
        conn.send(json.dumps(describe_rank()).encode())
        reply = _message(conn)
        if reply.get("go") is True:
            socket.send_fds(conn, [b"streams"], [0, 1, 2])
            reply = _message(conn)
    except TimeoutError:
        return cold(f"no answer within {ANSWER_S:.0f}s")
    except (OSError, ValueError) as e:
        return cold(_short(f"{getattr(e, 'strerror', None) or e}"))
    if "decline" in reply:
        return cold(_short(str(reply["decline"]), 500))
    child = reply.get("pid")
    if not (_is_int(child, 1) and _parent_of(child) == standby):
        return cold(f"its answer names no child of the standby (pid {standby}): {_short(str(reply), 100)}")
    conn.settimeout(None)  # from here the child trains: as long as it takes

    def forward(signum: int, _frame) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    forwarded = [sig for sig in FORWARDED if signal.getsignal(sig) is not signal.SIG_IGN]  # nohup's SIGHUP stays off
    for sig in forwarded:
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(forwarded))  # train.py holds USR1/USR2 during its imports
    try:
        rc = _message(conn).get("rc")  # interrupted by a forwarded signal: retried (PEP 475)
    except (OSError, ValueError):
        rc = None
    if not _is_int(rc, 0, 255):
        print(f"error: the warm standby {path} ended while running this rank", file=sys.stderr, flush=True)
        return 1
    return rc


# --- the standby's side ----------------------------------------------------------------------------------------------

def _say(line: str) -> None:
    """One line on the standby's stderr, never waiting: a full pipe (nobody reads the standby's output) or a closed
    one drops the line rather than stall or end the standby that runs ranks."""
    data = line.rstrip("\n").encode(errors="replace")[:4000] + b"\n"
    try:
        _, writable, _ = select.select([], [2], [], 0)
        if writable:
            os.write(2, data)  # at most PIPE_BUF bytes: a pipe with room takes them whole, without blocking
    except (OSError, ValueError):
        pass


def serve(path: str) -> int:
    """Import train.py's world once, then run each rank that connects in a forked child, until SIGTERM/SIGINT (then
    the children get SIGTERM, and the standby exits once they have)."""
    t0 = time.monotonic()
    started_with = dict(os.environ)  # what the imports below read (torch adds variables of its own as it goes)
    path = os.path.abspath(path)
    if len(os.fsencode(path)) > 107:  # sun_path: 108 bytes with its NUL
        print(f"error: warm standby {path}: a socket path has at most 107 bytes; use a shorter one", file=sys.stderr)
        return 2
    nodetrust = _nodetrust()
    try:  # the ranks hand over their environment and streams here: a folder of this user's alone
        nodetrust.own_folder(os.path.dirname(path), f"warm standby {path}")
    except nodetrust.Untrusted as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if os.path.lexists(path) and not _is_socket(path):
        print(f"error: {path} exists and is not a socket; give the standby another path", file=sys.stderr)
        return 2
    lock = _lock(path)
    if isinstance(lock, str):
        print(f"error: {lock}; stop it first or give this standby another path", file=sys.stderr)
        return 2

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import importlib

    import torch

    import train
    from checkpoint import knobs

    importlib.import_module("torch._dynamo")  # torch.optim imports it when the first optimizer is built
    script = os.path.realpath(train.__file__)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _f: stopping.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _f: stopping.append(signum))

    try:
        os.unlink(path)  # a socket left by a standby that was killed (a live one holds the lock)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    os.chmod(path, 0o600)
    ours = _identity(path)  # at the end, this socket goes, and no other standby's that took the name since
    listener.listen(64)
    listener.setblocking(False)
    mine = _confinement("self")
    print(f"warm standby ready on {path} (pid {os.getpid()}, imports {time.monotonic() - t0:.1f}s)", flush=True)

    def import_time(name: str) -> bool:
        return (name.startswith(_IMPORT_TIME) or name in knobs.IMPORT_TIME) and not name.startswith(_RUNTIME)

    def decline(request: dict, rank: int) -> str | None:
        """Why this standby's child would not be the process a cold start makes, or None. ``rank``: the rank
        process's pid, as the kernel gave it."""
        env = request["env"]
        if request["exe"] != os.path.realpath(sys.executable):
            return f"the rank runs {_short(request['exe'])}, the standby {os.path.realpath(sys.executable)}"
        if request["prefix"] != sys.prefix:
            return f"the rank's environment is {_short(request['prefix'])}, the standby's {sys.prefix}"
        if (request["flags"] != _flags() or request["warnoptions"] != sys.warnoptions
                or request["xoptions"] != {k: str(v) for k, v in sys._xoptions.items()}):
            return "the rank's interpreter options (-O, -W, -X, ...) differ from the standby's"
        theirs = _confinement(rank)
        differ = [name for name in mine if theirs[name] != mine[name]]
        if "cgroup" in differ:
            return ("the rank runs in another cgroup than the standby (another job step's memory and device limits): "
                    "start the standby inside the ranks' job step")
        if differ:
            return (f"the rank's {', '.join(differ)} differ{'s' if len(differ) == 1 else ''} from the standby's: "
                    "its child could not take them on")
        threads = env.get("OMP_NUM_THREADS")
        if threads is None and started_with.get("OMP_NUM_THREADS") is not None:
            return "OMP_NUM_THREADS is set in the standby but not in the rank"
        if threads is not None and not (threads.isdigit() and 0 < int(threads) < 1 << 16):
            return f"OMP_NUM_THREADS={_short(threads, 20)} is not a plain thread count"
        differ = sorted(n for n in set(env) | set(started_with)
                        if import_time(n) and env.get(n) != started_with.get(n))
        if differ:  # names only: values may be secrets
            return (f"{_short(', '.join(differ))} differ{'s' if len(differ) == 1 else ''} between the rank and the "
                    "standby, read at start-up; start the standby with the ranks' environment")
        if torch.cuda.is_initialized():  # never is_available(): it would initialise the driver the children need
            return "CUDA is initialised in the standby"
        return None

    def fork(request: dict, fds: list[int], sockets: list) -> tuple[int, int]:
        """A child that becomes the rank; (its pid, the pipe on which it says it has, or why it could not)."""
        sockets = [*sockets, lock]
        ready_r, ready_w = os.pipe()
        sys.stdout.flush()
        standby = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            _run_child(request, fds, sockets, ready_w, standby, script, torch, train)
        os.close(ready_w)
        return pid, ready_r

    loop = _Loop(listener, decline, fork)
    try:
        while not stopping or loop.children or loop.starting:
            if stopping:
                loop.stop()
            loop.turn()
    finally:
        loop.kill_all()
        if _identity(path) == ours:
            try:
                os.unlink(path)
            except OSError:
                pass
        os.close(lock)
    return 0


class _Loop:
    """The standby's event loop: every connection is a small state machine (request, streams, starting, running)
    with a deadline until it runs. Nothing a client sends can make it wait, raise out of it, or end a running rank."""

    def __init__(self, listener: socket.socket, decline, fork):
        import selectors

        self.sel = selectors.DefaultSelector()  # epoll: no limit on descriptor numbers, as select() has
        self.listener, self.decline, self.fork = listener, decline, fork
        self.pending: dict[socket.socket, list] = {}  # [state, deadline, request, rank pid]
        self.starting: dict[int, tuple[int, socket.socket, float]] = {}  # ready pipe -> (pid, connection, deadline)
        self.children: dict[int, socket.socket] = {}
        self.listening, self.paused_until, self.stopped = False, 0.0, False

    def turn(self) -> None:
        now = time.monotonic()
        want = not self.stopped and len(self.pending) < _PENDING_MAX and now >= self.paused_until
        if want != self.listening:
            if want:
                self.sel.register(self.listener, 1, ("listen", None))
            else:
                self.sel.unregister(self.listener)
            self.listening = want
        try:
            events = self.sel.select(0.2)
        except InterruptedError:
            events = []
        for key, _ in events:
            kind, what = key.data
            try:
                {"listen": self._accept, "pending": self._pending, "starting": self._started,
                 "child": self._child}[kind](what if what is not None else key.fileobj)
            except (BlockingIOError, InterruptedError):
                pass  # nothing there after all: the selector says again when there is
            except OSError as e:  # the client's end failed (reset, gone): only that connection goes
                _say(f"warm standby: a connection failed ({e.strerror or e})")
                if kind == "pending":
                    self._drop(key.fileobj)
            except Exception as e:  # a bug, not a client: one line, and only that connection goes
                import traceback

                _say(f"warm standby: internal error ({type(e).__name__}: {e}); dropped one connection\n"
                     + traceback.format_exc())
                if kind == "pending":
                    self._drop(key.fileobj)
        now = time.monotonic()
        for conn in [c for c, p in self.pending.items() if p[1] < now]:
            self._refuse(conn, f"no {'request' if self.pending[conn][0] == 'request' else 'streams'} within "
                               f"{ANSWER_S:.0f}s")
        for ready in [r for r, (_, _, deadline) in self.starting.items() if deadline < now]:
            pid, conn, _ = self._unstart(ready)
            _signal(pid, signal.SIGKILL)
            self._refuse(conn, f"its child did not start within {ANSWER_S:.0f}s")
        self._reap()

    def _accept(self, listener: socket.socket) -> None:
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:  # out of descriptors (a flood of connections): wait a moment, the backlog keeps them
            _say(f"warm standby: cannot accept ({e.strerror or e}); pausing")
            self.paused_until = time.monotonic() + 0.2
            return
        pid, uid = _peer(conn)
        if uid != os.geteuid():  # the socket is 0600 in a folder of ours: only root gets here, and it is not this user
            _say(f"warm standby: refused a connection from uid {uid} (pid {pid}): not this user")
            conn.close()
            return
        conn.setblocking(False)  # read only once the selector says a message is there; answers are small
        self.pending[conn] = ["request", time.monotonic() + ANSWER_S, None, pid]
        self.sel.register(conn, 1, ("pending", None))

    def _pending(self, conn: socket.socket) -> None:
        state, _, request, rank = self.pending[conn]
        if state == "request":
            data, ancillary, flags, _ = conn.recvmsg(_REQUEST_MAX)
            if not data and not ancillary:
                return self._drop(conn)  # it went away
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                return self._refuse(conn, "its request is too large, or carries descriptors")
            try:
                request = parse_request(data)
                why = self.decline(request, rank)
            except Declined as e:
                why = str(e)
            if why is not None:
                return self._refuse(conn, why)
            self.pending[conn] = ["streams", time.monotonic() + ANSWER_S, request, rank]
            conn.send(b'{"go": true}')
            return
        fds: list[int] = []
        try:
            data, fds, flags, _ = socket.recv_fds(conn, 64, 3)
            if not data and not fds:
                return self._drop(conn)
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or data != b"streams" or len(fds) != 3:
                return self._refuse(conn, "it did not pass its three standard streams")
            del self.pending[conn]
            self.sel.unregister(conn)
            sockets = [self.listener, conn, *self.pending, *self.children.values(),
                       *(c for _, c, _ in self.starting.values()), *self.starting, self.sel.fileno()]
            pid, ready = self.fork(request, fds, sockets)
            self.starting[ready] = (pid, conn, time.monotonic() + ANSWER_S)
            self.sel.register(ready, 1, ("starting", ready))
        finally:
            for fd in fds:
                os.close(fd)

    def _started(self, ready: int) -> None:
        answer = os.read(ready, 4096).decode(errors="replace")
        pid, conn, _ = self._unstart(ready)
        if answer != "ok":
            _signal(pid, signal.SIGKILL)  # reaped with the others; it is no rank's
            return self._refuse(conn, _short(answer or "its child failed to start", 500))
        try:
            conn.send(json.dumps({"pid": pid}).encode())
        except OSError:  # the rank is gone already: so is its child
            _signal(pid, signal.SIGKILL)
            conn.close()
            return
        self.children[pid] = conn
        self.sel.register(conn, 1, ("child", pid))

    def _unstart(self, ready: int) -> tuple[int, socket.socket, float]:
        self.sel.unregister(ready)
        os.close(ready)
        return self.starting.pop(ready)

    def _child(self, pid: int) -> None:
        conn = self.children[pid]
        try:
            gone = conn.recv(4096) == b""  # a rank sends nothing after its streams: anything else is drained
        except BlockingIOError:
            gone = False
        except OSError:
            gone = True
        if gone:  # the rank process died: its child goes too, as the kernel would have killed the rank
            _signal(pid, signal.SIGKILL)

    def _refuse(self, conn: socket.socket, why: str) -> None:
        _say(f"warm standby: declined a rank ({why})")
        try:
            conn.send(json.dumps({"decline": why}).encode())
        except OSError:
            pass
        self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        if self.pending.pop(conn, None) is not None:
            self.sel.unregister(conn)
        conn.close()

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue  # a child that never became a rank
            self.sel.unregister(conn)
            rc = os.waitstatus_to_exitcode(status)
            try:
                conn.send(json.dumps({"rc": rc if rc >= 0 else 128 - rc}).encode())
            except OSError:
                pass  # the rank process is gone already
            conn.close()

    def stop(self) -> None:
        """SIGTERM/SIGINT: no new ranks; those running get SIGTERM once (they save and stop)."""
        if self.stopped:
            return
        self.stopped = True
        for conn in list(self.pending):
            self._refuse(conn, "the standby is stopping")
        self.listener.close()
        self.listening = False
        for pid in self.children:
            _signal(pid, signal.SIGTERM)

    def kill_all(self) -> None:
        for pid in [*self.children, *(p for p, _, _ in self.starting.values())]:
            _signal(pid, signal.SIGKILL)
        if self.listener.fileno() >= 0:
            self.listener.close()


def _lock(path: str) -> int | str:
    """One standby per socket path: an exclusive lock held for the standby's life (a descriptor), or why not."""
    import fcntl

    try:
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        return f"cannot lock {path}.lock ({e.strerror or e})"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        return f"a warm standby (pid {holder}) already serves {path}"
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:  # a live standby that does not take the lock (its lock file removed) still answers
        probe.connect(path)
        live = True
    except OSError:
        live = False
    finally:
        probe.close()
    if live:
        os.close(fd)
        return f"a live warm standby already listens on {path}"
    return fd


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _become(request: dict, script: str) -> None:
    """In the child: take on what defines the rank's process, or raise Declined where the kernel refuses."""
    import resource

    nice = request["nice"]
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError:
        raise Declined(f"the rank's nice {nice} is below the standby's {os.getpriority(os.PRIO_PROCESS, 0)}") from None
    policy, priority = request["scheduler"]
    try:
        if (policy, priority) != (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority):
            os.sched_setscheduler(0, policy, os.sched_param(priority))
    except OSError:
        raise Declined(f"the rank's scheduling policy {policy} (priority {priority}) is not the standby's to "
                       "set") from None
    if request["oom_score_adj"] != _oom_score_adj():
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write(str(request["oom_score_adj"]))
        except OSError:
            raise Declined(f"the rank's oom_score_adj {request['oom_score_adj']} is below what the standby may "
                           "set") from None
    cpus = set(request["affinity"])
    try:
        os.sched_setaffinity(0, cpus)
    except (OSError, ValueError, OverflowError):
        pass  # checked below
    if set(os.sched_getaffinity(0)) != cpus:
        raise Declined(f"the rank's CPUs {_short(str(sorted(cpus)), 80)} are not within the standby's")
    for name, (soft, hard) in request["rlimits"].items():
        which = getattr(resource, name, None)
        if not isinstance(which, int):
            raise Declined(f"{_short(name, 40)} is unknown to the standby")
        try:
            resource.setrlimit(which, (soft, hard))
        except (ValueError, OSError, OverflowError):
            raise Declined(f"the rank's {name} {soft}/{hard} exceeds the standby's "
                           f"{'/'.join(map(str, resource.getrlimit(which)))}") from None
    os.umask(request["umask"])
    try:
        os.chdir(request["cwd"])
    except OSError as e:
        raise Declined(f"its folder {_short(request['cwd'])}: {e.strerror}") from None
    argv0 = request["argv"][0]
    if os.path.realpath(argv0) != script:  # in the rank's folder, as the rank resolved it
        raise Declined(f"the rank runs {_short(argv0)}, the standby {script}")


def _run_child(request: dict, fds: list[int], sockets: list, ready: int, standby: int, script: str, torch,
               train) -> None:
    """In the forked child: become the rank (its process settings, streams, directory, environment, arguments), say
    so through ``ready``, run train.py's CLI and exit with its code. Never returns."""
    code = 1
    try:
        for s in sockets:  # the standby's: its sockets, pipes, epoll and lock are not the rank's
            s.close() if isinstance(s, socket.socket) else os.close(s)
        die_with_parent(standby)  # the standby gone: nobody would report or end this child
        os.setsid()  # signals for the standby (a terminal's Ctrl-C) are not this rank's
        try:
            _become(request, script)
        except Declined as e:
            os.write(ready, str(e).encode()[:4000])
            os._exit(1)
        except Exception as e:  # a value the kernel refuses in a way not foreseen: still a decline, in one line
            os.write(ready, _short(f"its child could not become it ({type(e).__name__}: {e})", 500).encode())
            os._exit(1)
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # line-buffered, as train.py's own streams
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.environ.clear()
        os.environ.update(request["env"])
        import tempfile

        tempfile.tempdir = None  # the standby's TMPDIR was cached by its imports: this rank's, read again when used
        sys.argv = list(request["argv"])
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for signum in request["ignored"]:  # what the rank ignores (nohup's SIGHUP), its child ignores
            try:
                signal.signal(signum, signal.SIG_IGN)
            except (OSError, ValueError):
                pass
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})  # as train.py's start does
        threads = request["env"].get("OMP_NUM_THREADS")
        if threads is not None:  # read by the OpenMP runtime when torch was imported: the standby's, not the rank's
            torch.set_num_threads(int(threads))
        elif set(request["affinity"]) != set(os.sched_getaffinity(standby)):
            torch.set_num_threads(len(request["affinity"]))  # OpenMP's default: the CPUs the process may run on
        os.write(ready, b"ok")
        os.close(ready)
        train.started_as_standby_child(request["age"])
        code = train.cli()
        train.exit_process(code)
    except SystemExit as e:  # argparse's --help (0) or a bad flag (2): the exit code a cold start would give
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
        os._exit(code if isinstance(code, int) else 1)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _is_socket(path: str) -> bool:
    import stat

    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def running(path: str, env: dict | None = None):
    """A standby serving at ``path`` while the block runs (for launcher scripts, the benchmarks and the tests): yields
    its process once it is ready, and stops it (SIGTERM, by its PID) at the end."""
    import subprocess

    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = proc.stdout.readline()
        if not line.startswith("warm standby ready"):
            raise RuntimeError(f"the warm standby did not start: {line}{proc.stdout.read()}")
        import threading

        proc.lines = []  # what it says later (declines), read as it comes: a pipe nobody reads would fill up
        threading.Thread(target=lambda: proc.lines.extend(proc.stdout), daemon=True).start()
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "serve":
        print("usage: python warm.py serve SOCKET_PATH", file=sys.stderr)
        return 2
    return serve(argv[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
