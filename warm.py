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

This module imports nothing heavy at the top: the rank side runs before train.py's imports. For the same reason it
holds the two process helpers that train.py's modules share with it (``process_age``, ``die_with_parent``).
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

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
_REQUEST_MAX = 1 << 20


def process_age() -> float | None:
    """Seconds since this process started (Linux /proc), so the interpreter's start-up before our first line counts;
    None where /proc cannot tell."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            return float(uptime.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def die_with_parent(parent: int) -> str | None:
    """Have the kernel SIGKILL this process when its parent dies (Linux PR_SET_PDEATHSIG); ``parent``: the parent's pid
    as read earlier -- if it is gone already, this process ends now. Returns why the kernel refused, else None."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # 1: PR_SET_PDEATHSIG
        return os.strerror(ctypes.get_errno())
    if os.getppid() != parent:  # it died before the signal was set: end as if it had fired
        os.kill(os.getpid(), signal.SIGKILL)
    return None


# --- what defines a rank's process: the request ---------------------------------------------------------------------

ANSWER_S = 5.0  # a rank waits this long for the standby's answer before it starts cold; the standby as long for a
#                 request, and for its child to become the rank

# Variables read when the interpreter, its loader, the OpenMP/BLAS runtimes or torch's config modules start: in a
# standby's child the standby's values would hold, so a rank whose values differ is declined (docs/checkpointing.md
# lists them). OMP_NUM_THREADS is applied instead (torch.set_num_threads), and PYTHONUNBUFFERED has no effect (the
# child opens its own line-buffered streams). A launcher sets the _RUNTIME ones for each rank, read when the process
# group starts, after the hand-over.
_IMPORT_TIME = ("PYTHON", "LD_", "MALLOC_", "GLIBC_TUNABLES", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "TORCH",
                "PYTORCH_")
_RUNTIME = ("TORCHELASTIC_", "TORCH_ELASTIC_", "TORCH_NCCL_", "PYTHONUNBUFFERED", "OMP_NUM_THREADS")


class Declined(Exception):
    """The standby cannot run this rank as a cold start would: why, in one line (the rank prints it and starts cold)."""


def _is_str_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _is_int(v) -> bool:
    return type(v) is int


_FIELDS = {  # the request's typed fields: anything else is declined before any of it is used
    "argv": lambda v: _is_str_list(v) and len(v) > 0,
    "env": lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()),
    "cwd": lambda v: isinstance(v, str),
    "exe": lambda v: isinstance(v, str),
    "prefix": lambda v: isinstance(v, str),
    "flags": lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
    "xoptions": lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
    "age": lambda v: type(v) in (int, float) and v >= 0,
    "umask": lambda v: _is_int(v) and 0 <= v <= 0o777,
    "rlimits": lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, list) and len(x) == 2
                                                     and all(_is_int(n) for n in x) for k, x in v.items()),
    "affinity": lambda v: isinstance(v, list) and all(_is_int(x) and x >= 0 for x in v),
    "nice": lambda v: _is_int(v),
    "cgroup": lambda v: isinstance(v, str),
}


def describe_rank() -> dict:
    """What makes this process the rank it is, for the standby's child to become it (or the standby to decline)."""
    import resource

    mask = os.umask(0)
    os.umask(mask)
    return {"argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd(), "exe": os.path.realpath(sys.executable),
            "prefix": sys.prefix, "flags": _flags(), "xoptions": {k: str(v) for k, v in sys._xoptions.items()},
            "age": process_age() or 0.0, "umask": mask,
            "rlimits": {name: list(resource.getrlimit(getattr(resource, name))) for name in dir(resource)
                        if name.startswith("RLIMIT_")},
            "affinity": sorted(os.sched_getaffinity(0)), "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "cgroup": _cgroup()}


def parse_request(message: bytes) -> dict:
    """A rank's request, checked field by field; Declined with why otherwise."""
    try:
        request = json.loads(message)
    except ValueError:
        raise Declined("its request is not JSON") from None
    if not isinstance(request, dict):
        raise Declined("its request is not a JSON object")
    if set(request) != set(_FIELDS):
        odd = sorted(set(request) ^ set(_FIELDS))
        raise Declined(f"its request has other fields than a rank's ({', '.join(odd)[:200]}): another PyRecover "
                       "version?")
    bad = [name for name, ok in _FIELDS.items() if not ok(request[name])]
    if bad:
        raise Declined(f"its request's {', '.join(bad)} {'has' if len(bad) == 1 else 'have'} the wrong type")
    return request


def _flags() -> list[int]:
    return [int(flag) for flag in sys.flags]  # ints and bools (safe_path)


def _cgroup() -> str:
    try:
        with open("/proc/self/cgroup") as f:
            return f.read()
    except OSError:
        return ""


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
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
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
    # Before anything is sent (the environment holds the user's keys, the streams are the rank's): the listener must
    # be this user's, in a folder only this user can write.
    standby, uid = _peer(conn)
    if uid != os.geteuid():
        return cold(f"it is served by uid {uid}, not by this user (uid {os.geteuid()})")
    why = _nodetrust().owner_only_reason(os.path.dirname(os.path.abspath(path)))
    if why is not None:
        return cold(f"{why}: another user could serve there")
    try:
        socket.send_fds(conn, [json.dumps(describe_rank()).encode()], [0, 1, 2])
        reply = _message(conn)
    except TimeoutError:
        return cold(f"no answer within {ANSWER_S:.0f}s")
    except (OSError, ValueError) as e:
        return cold(f"{getattr(e, 'strerror', None) or e}")
    if "decline" in reply:
        return cold(str(reply["decline"])[:500])
    child = reply.get("pid")
    if not (_is_int(child) and child > 0 and _parent_of(child) == standby):
        return cold(f"its answer names no child of the standby (pid {standby}): {str(reply)[:100]}")
    conn.settimeout(None)  # from here the child trains: as long as it takes

    def forward(signum: int, _frame) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(FORWARDED))  # train.py holds USR1/USR2 during its imports
    try:
        rc = _message(conn).get("rc")  # interrupted by a forwarded signal: retried (PEP 475)
    except (OSError, ValueError):
        rc = None
    if not _is_int(rc):
        print(f"error: the warm standby {path} ended while running this rank", file=sys.stderr, flush=True)
        return 1
    return rc


# --- the standby's side ----------------------------------------------------------------------------------------------

def serve(path: str) -> int:
    """Import train.py's world once, then run each rank that connects in a forked child, until SIGTERM/SIGINT (then
    the children get SIGTERM, and the standby exits once they have)."""
    t0 = time.monotonic()
    started_with = dict(os.environ)  # what the imports below read (torch adds variables of its own as it goes)
    path = os.path.abspath(path)
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
    print(f"warm standby ready on {path} (pid {os.getpid()}, imports {time.monotonic() - t0:.1f}s)", flush=True)

    def import_time(name: str) -> bool:
        return (name.startswith(_IMPORT_TIME) or name in knobs.IMPORT_TIME) and not name.startswith(_RUNTIME)

    def decline(request: dict) -> str | None:
        """Why this standby's child would not be the process a cold start makes, or None."""
        argv, env = request["argv"], request["env"]
        if request["exe"] != os.path.realpath(sys.executable):
            return f"the rank runs {request['exe']}, the standby {os.path.realpath(sys.executable)}"
        if request["prefix"] != sys.prefix:
            return f"the rank's environment is {request['prefix']}, the standby's {sys.prefix}"
        if request["flags"] != _flags() or request["xoptions"] != {k: str(v) for k, v in sys._xoptions.items()}:
            return "the rank's interpreter options (-O, -X, ...) differ from the standby's"
        if os.path.realpath(os.path.join(request["cwd"], argv[0])) != script:
            return f"the rank runs {argv[0]}, the standby {script}"
        if request["cgroup"] != _cgroup():
            return ("the rank runs in another cgroup than the standby (another job step's memory and device limits): "
                    "start the standby inside the ranks' job step")
        if env.get("OMP_NUM_THREADS") is None and started_with.get("OMP_NUM_THREADS") is not None:
            return "OMP_NUM_THREADS is set in the standby but not in the rank"
        differ = sorted(n for n in set(env) | set(started_with)
                        if import_time(n) and env.get(n) != started_with.get(n))
        if differ:  # names only: values may be secrets
            return (f"{', '.join(differ)[:200]} differ{'s' if len(differ) == 1 else ''} between the rank and the "
                    "standby, read at start-up; start the standby with the ranks' environment")
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return "CUDA is initialised in the standby"
        return None

    pending: dict[socket.socket, float] = {}  # accepted, request not read yet: its deadline
    children: dict[int, socket.socket] = {}
    listener.setblocking(False)
    try:
        while not stopping or children:
            if stopping and listener.fileno() >= 0:
                listener.close()
                for conn in pending:
                    conn.close()
                pending.clear()
                for pid in children:
                    _signal(pid, signal.SIGTERM)
            watched = [*children.values(), *pending] + ([listener] if listener.fileno() >= 0 else [])
            try:
                ready, _, _ = select.select(watched, [], [], 0.2)
            except InterruptedError:
                ready = []
            for conn in ready:
                if conn is listener:
                    _accept(listener, pending)
                elif conn in pending:
                    del pending[conn]
                    sockets = [listener, conn, *pending, *children.values()]
                    _answer(conn, children, decline, sockets, lambda request, fds, sockets: _fork(
                        request, fds, sockets, torch, train))
                else:
                    try:
                        gone = conn.recv(1) == b""
                    except OSError:
                        gone = True
                    if gone:  # the rank process died: its child goes too, as the kernel would have killed the rank
                        pid = next(p for p, c in children.items() if c is conn)
                        _signal(pid, signal.SIGKILL)
            now = time.monotonic()
            for conn in [c for c, deadline in pending.items() if deadline < now]:
                del pending[conn]
                _refuse(conn, f"no request within {ANSWER_S:.0f}s")
            _reap(children)
    finally:
        for pid in children:
            _signal(pid, signal.SIGKILL)
        if listener.fileno() >= 0:
            listener.close()
        if _identity(path) == ours:
            try:
                os.unlink(path)
            except OSError:
                pass
        os.close(lock)
    return 0


def _lock(path: str) -> int | str:
    """One standby per socket path: an exclusive lock held for the standby's life (a descriptor), or why not."""
    import fcntl

    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
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


def _accept(listener: socket.socket, pending: dict) -> None:
    try:
        conn, _ = listener.accept()
    except (BlockingIOError, InterruptedError):
        return
    conn.setblocking(True)  # read only once select says a message is there; sends are small
    pid, uid = _peer(conn)
    if uid != os.geteuid():  # the socket is 0600 in a folder of ours: only root gets here, and it is not this user
        print(f"warm standby: refused a connection from uid {uid} (pid {pid}): not this user", file=sys.stderr,
              flush=True)
        conn.close()
        return
    pending[conn] = time.monotonic() + ANSWER_S


def _refuse(conn: socket.socket, why: str) -> None:
    print(f"warm standby: declined a rank ({why})", file=sys.stderr, flush=True)
    try:
        conn.send(json.dumps({"decline": why}).encode())
    except OSError:
        pass
    conn.close()


def _answer(conn: socket.socket, children: dict, decline, sockets: list, fork) -> None:
    """Read one rank's request (select said it is there) and run it in a child, or decline it; whatever the client
    sent, the standby keeps serving."""
    fds: list[int] = []
    try:
        message, fds, flags, _ = socket.recv_fds(conn, _REQUEST_MAX, 3)
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise Declined("its request is too large")
        if len(fds) != 3:
            raise Declined("it did not pass its standard streams")
        request = parse_request(message)
        why = decline(request)
        if why is not None:
            raise Declined(why)
        pid = fork(request, fds, sockets)
    except Declined as e:
        return _refuse(conn, str(e))
    except OSError as e:
        print(f"warm standby: a connection failed ({e.strerror or e})", file=sys.stderr, flush=True)
        return conn.close()
    except Exception:  # a bug in the standby: its traceback, and this rank starts cold; the others run on
        import traceback

        traceback.print_exc()
        return _refuse(conn, "the standby failed on this request (see its log)")
    finally:
        for fd in fds:
            os.close(fd)
    children[pid] = conn
    try:
        conn.send(json.dumps({"pid": pid}).encode())
    except OSError:  # the rank is gone already: so is its child
        _signal(pid, signal.SIGKILL)
        children.pop(pid)
        conn.close()


def _fork(request: dict, fds: list[int], sockets: list, torch, train) -> int:
    """A child that has become the rank's process (or Declined: why it could not); its pid."""
    ready_r, ready_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    standby = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        _run_child(request, fds, sockets, ready_w, standby, torch, train)
    os.close(ready_w)
    try:
        ready, _, _ = select.select([ready_r], [], [], ANSWER_S)
        answer = os.read(ready_r, 4096).decode(errors="replace") if ready else ""
    finally:
        os.close(ready_r)
    if answer != "ok":
        _signal(pid, signal.SIGKILL)  # reaped with the others; it is no rank's
        raise Declined(answer or f"its child did not start within {ANSWER_S:.0f}s")
    return pid


def _become(request: dict) -> None:
    """In the child: take on what defines the rank's process, or raise Declined where the kernel refuses."""
    import resource

    nice = request["nice"]
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError:
        raise Declined(f"the rank's nice {nice} is below the standby's {os.getpriority(os.PRIO_PROCESS, 0)}") from None
    cpus = set(request["affinity"])
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        pass  # checked below
    if set(os.sched_getaffinity(0)) != cpus:
        raise Declined(f"the rank's CPUs {sorted(cpus)} are not within the standby's")
    for name, (soft, hard) in request["rlimits"].items():
        which = getattr(resource, name, None) if name.startswith("RLIMIT_") else None
        if which is None:
            raise Declined(f"{name} is unknown to the standby")
        try:
            resource.setrlimit(which, (soft, hard))
        except (ValueError, OSError):
            raise Declined(f"the rank's {name} {soft}/{hard} exceeds the standby's "
                           f"{'/'.join(map(str, resource.getrlimit(which)))}") from None
    os.umask(request["umask"])
    try:
        os.chdir(request["cwd"])
    except OSError as e:
        raise Declined(f"its folder {request['cwd']}: {e.strerror}") from None


def _run_child(request: dict, fds: list[int], sockets: list, ready: int, standby: int, torch, train) -> None:
    """In the forked child: become the rank (its process settings, streams, directory, environment, arguments), say
    so through ``ready``, run train.py's CLI and exit with its code. Never returns."""
    code = 1
    try:
        for s in sockets:
            s.close()
        die_with_parent(standby)  # the standby gone: nobody would report or end this child
        os.setsid()  # signals for the standby (a terminal's Ctrl-C) are not this rank's
        try:
            _become(request)
        except Declined as e:
            os.write(ready, str(e).encode()[:4000])
            os._exit(1)
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # line-buffered, as train.py's own streams
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = list(request["argv"])
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})  # as train.py's start does
        threads = request["env"].get("OMP_NUM_THREADS")
        if threads is not None:  # read by the OpenMP runtime when torch was imported: the standby's, not the rank's
            torch.set_num_threads(int(threads))
        os.write(ready, b"ok")
        os.close(ready)
        train.started_as_standby_child(request["age"])
        code = train.cli()
        train.exit_process(code)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code if isinstance(code, int) else 1)


def _reap(children: dict) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue  # a child that never became a rank
        rc = os.waitstatus_to_exitcode(status)
        try:
            conn.send(json.dumps({"rc": rc if rc >= 0 else 128 - rc}).encode())
        except OSError:
            pass  # the rank process is gone already
        conn.close()


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
