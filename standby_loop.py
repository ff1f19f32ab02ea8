"""A warm standby's event loop (warm.py): every connection is a small state machine (request, streams, starting,
running) with a deadline until it runs. Nothing a client sends can make it wait, raise out of it, or end a running
rank. When a rank process goes away (SIGKILL, or its torchrun died), the loop SIGKILLs its child, as the kernel would
have killed the rank itself.

What to decline and how to fork a child are the server's (warm.py): the loop gets them as two callables.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import time

from standby_protocol import ANSWER_S, REQUEST_MAX, Declined, parse_request, peer_of, short

PENDING_MAX = 32  # connections still talking to the standby: beyond, new ones wait in the backlog (then start cold)


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


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


class Loop:
    """The standby's connections and children; ``turn`` waits at most 0.2 s for what comes, then handles it."""

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
        want = not self.stopped and len(self.pending) < PENDING_MAX and now >= self.paused_until
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
        pid, uid = peer_of(conn)
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
            data, ancillary, flags, _ = conn.recvmsg(REQUEST_MAX)
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
            return self._refuse(conn, short(answer or "its child failed to start", 500))
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
                # a signal's death as a shell gives it (128 + n), and the signal, for the rank process to die of
                ended = {"rc": rc, "signal": None} if rc >= 0 else {"rc": 128 - rc, "signal": -rc}
                conn.send(json.dumps(ended).encode())
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
