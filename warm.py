"""A warm standby: restart a rank without paying its imports again.

A restart spends most of its time before training resumes on importing PyTorch and on what the first optimizer
imports (torch._dynamo), about 3 s of a 5 s restart measured here (docs/benchmarks.md). A standby process pays them
once, before any failure, and then waits on a Unix socket. A rank started with ``PYRECOVER_WARM=SOCKET`` hands
itself over when a standby is listening there: its arguments, environment, working directory and standard streams go
to the standby, which forks a child that runs train.py exactly as the rank would have (the same code, the same flags;
nothing of a previous run is reused but the imported modules). Without a standby the rank starts cold, as always.

    python warm.py serve /tmp/pyrecover-warm.sock &       # once per node, before the run
    PYRECOVER_WARM=/tmp/pyrecover-warm.sock torchrun ... train.py ...

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


# --- the rank's side -------------------------------------------------------------------------------------------------

def hand_over(path: str) -> int | None:
    """Run this rank in the standby listening at ``path``: its exit code, or None for a cold start (no standby, or it
    declined: one line says why)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # die with torchrun, as distributed.follow_launcher ties a cold rank
        die_with_parent(os.getppid())
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(path)
    except OSError:
        return None  # nobody listening: a cold start, the normal case without a standby
    request = {"argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd(), "exe": os.path.realpath(sys.executable),
               "age": process_age() or 0.0}
    try:
        socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
        reply = json.loads(conn.recv(_REQUEST_MAX) or b'{"decline": "it closed the connection"}')
    except OSError as e:
        reply = {"decline": f"{e.strerror or e}"}
    if "decline" in reply:
        print(f"warm standby {path} not used ({reply['decline']}): a cold start", file=sys.stderr, flush=True)
        conn.close()
        return None
    child = reply["pid"]

    def forward(signum: int, _frame) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(FORWARDED))  # train.py holds USR1/USR2 during its imports
    message = conn.recv(_REQUEST_MAX)  # interrupted by a forwarded signal: retried (PEP 475)
    if not message:
        print(f"error: the warm standby {path} ended while running this rank", file=sys.stderr, flush=True)
        return 1
    return int(json.loads(message)["rc"])


# --- the standby's side ----------------------------------------------------------------------------------------------

def serve(path: str) -> int:
    """Import train.py's world once, then run each rank that connects in a forked child, until SIGTERM/SIGINT (then
    the children get SIGTERM, and the standby exits once they have)."""
    t0 = time.monotonic()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import importlib

    import torch

    import train

    importlib.import_module("torch._dynamo")  # torch.optim imports it when the first optimizer is built
    env_threads = os.environ.get("OMP_NUM_THREADS")
    script = os.path.realpath(train.__file__)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _f: stopping.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _f: stopping.append(signum))

    if os.path.exists(path) and not _is_socket(path):
        print(f"error: {path} exists and is not a socket; give the standby another path", file=sys.stderr)
        return 2
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        os.unlink(path)  # a socket left by a standby that was killed
    except FileNotFoundError:
        pass
    listener.bind(path)
    os.chmod(path, 0o600)  # the ranks hand over their environment: this user's only
    listener.listen(64)
    print(f"warm standby ready on {path} (pid {os.getpid()}, imports {time.monotonic() - t0:.1f}s)", flush=True)

    def decline(request: dict) -> str | None:
        argv = request.get("argv") or [""]
        if request.get("exe") != os.path.realpath(sys.executable):
            return f"the rank runs {request.get('exe')}, the standby {os.path.realpath(sys.executable)}"
        if os.path.realpath(os.path.join(request.get("cwd", ""), argv[0])) != script:
            return f"the rank runs {argv[0]}, the standby {script}"
        threads = request.get("env", {}).get("OMP_NUM_THREADS")
        if threads is None and env_threads is not None:
            return "OMP_NUM_THREADS is set in the standby but not in the rank"
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return "CUDA is initialised in the standby"
        return None

    children: dict[int, socket.socket] = {}
    try:
        while not stopping or children:
            if stopping and listener.fileno() >= 0:
                listener.close()
                for pid in children:
                    _signal(pid, signal.SIGTERM)
            watched = list(children.values()) + ([listener] if listener.fileno() >= 0 else [])
            try:
                ready, _, _ = select.select(watched, [], [], 0.2)
            except InterruptedError:
                ready = []
            for conn in ready:
                if conn is listener:
                    _accept(listener, children, decline, torch, train)
                    continue
                try:
                    gone = conn.recv(1) == b""
                except OSError:
                    gone = True
                if gone:  # the rank process died: its child goes too, as the kernel would have killed the rank
                    pid = next(p for p, c in children.items() if c is conn)
                    _signal(pid, signal.SIGKILL)
            _reap(children)
    finally:
        for pid in children:
            _signal(pid, signal.SIGKILL)
        if listener.fileno() >= 0:
            listener.close()
        try:
            if _is_socket(path):
                os.unlink(path)
        except OSError:
            pass
    return 0


def _accept(listener, children, decline, torch, train) -> None:
    conn, _ = listener.accept()
    try:
        message, fds, _, _ = socket.recv_fds(conn, _REQUEST_MAX, 3)
        request = json.loads(message)
    except (OSError, ValueError) as e:
        conn.close()
        print(f"warm standby: a malformed request ({e}); ignored", file=sys.stderr, flush=True)
        return
    why = decline(request) if len(fds) == 3 else "it did not pass its standard streams"
    if why is not None:
        for fd in fds:
            os.close(fd)
        conn.send(json.dumps({"decline": why}).encode())
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    request["standby_pid"] = os.getpid()
    pid = os.fork()
    if pid == 0:
        _run_child(request, fds, [listener, conn, *children.values()], torch, train)
    for fd in fds:
        os.close(fd)
    children[pid] = conn
    conn.send(json.dumps({"pid": pid}).encode())


def _run_child(request: dict, fds: list[int], sockets: list, torch, train) -> None:
    """In the forked child: become the rank (its streams, directory, environment, arguments), run train.py's CLI and
    exit with its code. Never returns."""
    code = 1
    try:
        for s in sockets:
            s.close()
        die_with_parent(request["standby_pid"])  # the standby gone: nobody would report or end this child
        os.setsid()  # signals for the standby (a terminal's Ctrl-C) are not this rank's
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # line-buffered, as train.py's own streams
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = list(request["argv"])
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})  # as train.py's start does
        threads = request["env"].get("OMP_NUM_THREADS")
        if threads is not None:  # read by the OpenMP runtime when torch was imported: the standby's, not the rank's
            torch.set_num_threads(int(threads))
        train.started_as_standby_child(request["age"])
        code = train.cli()
        train.exit_process(code)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code if isinstance(code, int) else 1)


def _reap(children: dict) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
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
