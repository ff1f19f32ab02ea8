"""A rank's end of a warm standby (warm.py): train.py's first lines call ``hand_over`` before its imports.

The rank process stays as the child's stand-in: it forwards the signals it gets (SLURM's warning, SIGTERM) and exits
with the child's exit code. It imports the standard library only, and never train.py: the standby's side does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

from procs import die_with_parent
from standby_protocol import ANSWER_S, describe_rank, is_int, nodetrust, parent_of, peer_of, receive, short

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


def hand_over(path: str) -> int | None:
    """Run this rank in the standby listening at ``path``: its exit code, or None for a cold start (no standby, or it
    could not be trusted, declined or did not answer: one line says why)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # die with torchrun, as distributed.follow_launcher ties a cold rank
        die_with_parent(os.getppid())
    elif os.environ.get("PYRECOVER_LAUNCHER_PID", "").isdigit():  # launcher.py's spare: die with the launcher
        die_with_parent(int(os.environ["PYRECOVER_LAUNCHER_PID"]))
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
    standby, uid = peer_of(conn)
    if uid != os.geteuid():
        return cold(f"it is served by uid {uid}, not by this user (uid {os.geteuid()})")
    why = nodetrust().owner_only_reason(os.path.dirname(os.path.abspath(path)))
    if why is not None:
        return cold(f"{why}: another user could serve there")
    # Two steps: the request, then -- only once the standby has agreed -- the streams. A declining, frozen or slow
    # standby never holds this rank's stdout/stderr open (a pipe's reader would wait for its end).
    try:
        conn.send(json.dumps(describe_rank()).encode())
        reply = receive(conn)
        if reply.get("go") is True:
            socket.send_fds(conn, [b"streams"], [0, 1, 2])
            reply = receive(conn)
    except TimeoutError:
        return cold(f"no answer within {ANSWER_S:.0f}s")
    except (OSError, ValueError) as e:
        return cold(short(f"{getattr(e, 'strerror', None) or e}"))
    if "decline" in reply:
        return cold(short(str(reply["decline"]), 500))
    child = reply.get("pid")
    # A child that already ended (a bad flag exits at once) may be reaped before this look: no process, and its exit
    # code still comes from the standby. A process with another parent is not the standby's child.
    if not (is_int(child, 1) and parent_of(child) in (standby, None)):
        return cold(f"its answer names no child of the standby (pid {standby}): {short(str(reply), 100)}")
    conn.settimeout(None)  # from here the child trains: as long as it takes
    if os.environ.get("PYRECOVER_MEMBER"):  # launcher.py names its members by this process's pid: link the two
        print(f"member {os.environ['PYRECOVER_MEMBER']} (pid {os.getpid()}) runs in pid {child}, forked by the warm "
              f"standby (pid {standby})", file=sys.stderr, flush=True)

    def forward(signum: int, _frame) -> None:
        if parent_of(child) != standby:  # ended (its pid may be another process's by now)
            return
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    forwarded = [sig for sig in FORWARDED if signal.getsignal(sig) is not signal.SIG_IGN]  # nohup's SIGHUP stays off
    for sig in forwarded:
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(forwarded))  # train.py holds USR1/USR2 during its imports
    try:
        ended = receive(conn)  # interrupted by a forwarded signal: retried (PEP 475)
        rc, signum = ended.get("rc"), ended.get("signal")
    except (OSError, ValueError):
        rc = signum = None
    if not is_int(rc, 0, 255):
        print(f"error: the warm standby {path} ended while running this rank", file=sys.stderr, flush=True)
        return 1
    if is_int(signum, 1, 64) and signum not in (signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU):
        # the child died of a signal: so does this stand-in, so that its parent (torchrun, launcher.py) sees the
        # death it would have seen of a cold rank (a SIGKILL, not an exit code 137)
        import resource

        sys.stdout.flush()
        sys.stderr.flush()
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the child dumped its own core, where the rank allows one
        if signum != signal.SIGKILL:  # its action cannot be set, nor does it need to be
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        os.kill(os.getpid(), signum)
    return rc
