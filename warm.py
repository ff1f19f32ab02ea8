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
hands itself only to a standby of its own user, and uses a pid from it only if it is the standby's own child. A rank
whose interpreter, ``sys.prefix``, interpreter options, cgroup or start-up variables differ from the standby's is
declined. Every decline, and a standby that does not answer within ``ANSWER_S``, is a cold start with one line. The
standby keeps serving: one per node serves every restart.

This file is the standby's command and its decisions (``serve``: what to decline, when to fork). The rest, by job:
standby_protocol.py (the messages, and what each end reads of the other), standby_client.py (the rank's end, which
train.py's first lines call), standby_loop.py (the event loop), standby_child.py (the child that becomes the rank and
runs train.py). This module imports nothing heavy at the top: launchers, benchmarks and tests import it for
``running``; ``serve`` pays train.py's imports once its socket is known to be usable.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time

from standby_protocol import confinement, interpreter_flags, nodetrust, short

# Variables read when the interpreter, its loader, the OpenMP/BLAS runtimes or torch's config modules start: in a
# standby's child the standby's values would hold, so a rank whose values differ is declined (docs/checkpointing.md
# lists them). OMP_NUM_THREADS is applied instead (torch.set_num_threads), and PYTHONUNBUFFERED has no effect (the
# child opens its own line-buffered streams). A launcher sets the _RUNTIME ones for each rank, read when the process
# group starts, after the hand-over.
_IMPORT_TIME = ("PYTHON", "LD_", "MALLOC_", "GLIBC_TUNABLES", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "TORCH",
                "PYTORCH_")
_RUNTIME = ("TORCHELASTIC_", "TORCH_ELASTIC_", "TORCH_NCCL_", "PYTHONUNBUFFERED", "OMP_NUM_THREADS")


def serve(path: str) -> int:
    """Import train.py's world once, then run each rank that connects in a forked child, until SIGTERM/SIGINT (then
    the children get SIGTERM, and the standby exits once they have)."""
    t0 = time.monotonic()
    if os.environ.get("PYRECOVER_LAUNCHER_PID", "").isdigit():  # launcher.py's spares' standby ends with it
        from procs import die_with_parent

        die_with_parent(int(os.environ["PYRECOVER_LAUNCHER_PID"]))
    started_with = dict(os.environ)  # what the imports below read (torch adds variables of its own as it goes)
    path = os.path.abspath(path)
    if len(os.fsencode(path)) > 107:  # sun_path: 108 bytes with its NUL
        print(f"error: warm standby {path}: a socket path has at most 107 bytes; use a shorter one", file=sys.stderr)
        return 2
    trust = nodetrust()
    try:  # the ranks hand over their environment and streams here: a folder of this user's alone
        trust.own_folder(os.path.dirname(path), f"warm standby {path}")
    except trust.Untrusted as e:
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

    import standby_child  # train.py and its world: the imports every rank after this one skips
    from checkpoint import knobs
    from standby_loop import Loop

    importlib.import_module("torch._dynamo")  # torch.optim imports it when the first optimizer is built
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
    mine = confinement("self")
    print(f"warm standby ready on {path} (pid {os.getpid()}, imports {time.monotonic() - t0:.1f}s)", flush=True)

    def import_time(name: str) -> bool:
        return (name.startswith(_IMPORT_TIME) or name in knobs.IMPORT_TIME) and not name.startswith(_RUNTIME)

    def decline(request: dict, rank: int) -> str | None:
        """Why this standby's child would not be the process a cold start makes, or None. ``rank``: the rank
        process's pid, as the kernel gave it."""
        env = request["env"]
        if request["exe"] != os.path.realpath(sys.executable):
            return f"the rank runs {short(request['exe'])}, the standby {os.path.realpath(sys.executable)}"
        if request["prefix"] != sys.prefix:
            return f"the rank's environment is {short(request['prefix'])}, the standby's {sys.prefix}"
        if (request["flags"] != interpreter_flags() or request["warnoptions"] != sys.warnoptions
                or request["xoptions"] != {k: str(v) for k, v in sys._xoptions.items()}):
            return "the rank's interpreter options (-O, -W, -X, ...) differ from the standby's"
        theirs = confinement(rank)
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
            return f"OMP_NUM_THREADS={short(threads, 20)} is not a plain thread count"
        differ = sorted(n for n in set(env) | set(started_with)
                        if import_time(n) and env.get(n) != started_with.get(n))
        if differ:  # names only: values may be secrets
            return (f"{short(', '.join(differ))} differ{'s' if len(differ) == 1 else ''} between the rank and the "
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
            standby_child.run_child(request, fds, sockets, ready_w, standby)
        os.close(ready_w)
        return pid, ready_r

    loop = Loop(listener, decline, fork)
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
