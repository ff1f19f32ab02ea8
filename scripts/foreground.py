"""Run a command as the terminal's foreground job, the way a job-control shell does, and exit with its exit code.

    python scripts/foreground.py CMD [ARGS...]

Why (`make train`): Ctrl-C sends SIGINT to the terminal's whole foreground process group. Under plain make that group
is make itself, its recipe shell and train.py; train.py saves and exits 4, but GNU make re-raises any SIGINT it got on
itself once its children are done, so `make train` "fails" (Interrupt / Error 4, exit 130) although nothing failed.
Here CMD gets its own process group and the terminal, so Ctrl-C (and Ctrl-\\, and the terminal's hangup) reaches only
CMD; make sees an ordinary exit code and the Makefile decides what it means. SIGINT/SIGTERM/SIGHUP sent to this
process (e.g. `kill -TERM` to make's process group) are forwarded to CMD, which is no longer in that group. Without a
controlling terminal, or when started in the background, CMD simply runs as a child in the same group (nothing to take
over; SIGTERM/SIGHUP are still forwarded, SIGINT is not: the group's SIGINT reaches CMD itself). GNU make itself still
re-raises a SIGINT it received there (no terminal: no Ctrl-C to shield it from).
Ctrl-Z is ignored by CMD: a job stopped behind make's back could not be resumed with `fg`.
"""

from __future__ import annotations

import os
import signal
import sys


def _terminal() -> int | None:
    """The controlling terminal, if this process is in its foreground process group."""
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.tcgetpgrp(fd) == os.getpgrp():
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _give_terminal(fd: int, pgrp: int) -> None:
    # tcsetpgrp from a process that is (or is about to be) in a background group raises SIGTTOU unless it is ignored.
    old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(fd, pgrp)
    except OSError:
        pass
    finally:
        signal.signal(signal.SIGTTOU, old)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: foreground.py CMD [ARGS...]", file=sys.stderr)
        return 2
    tty = _terminal()
    pid = os.fork()
    if pid == 0:
        if tty is not None:
            os.setpgid(0, 0)
            _give_terminal(tty, os.getpgrp())
            os.close(tty)
        signal.signal(signal.SIGTSTP, signal.SIG_IGN)  # ignored dispositions survive exec
        try:
            os.execvp(argv[0], argv)
        except OSError as e:
            print(f"foreground.py: cannot run {argv[0]}: {e}", file=sys.stderr)
            os._exit(127)
    if tty is not None:
        try:
            os.setpgid(pid, pid)  # also here: whichever of parent and child runs first, the group exists before use
        except OSError:
            pass
        _give_terminal(tty, pid)

    def forward(signum, _frame):
        try:
            os.killpg(pid, signum) if tty is not None else os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        if tty is None and sig in (signal.SIGINT, signal.SIGQUIT):
            # CMD is in this process's group: a group-wide SIGINT reaches it already, and a forwarded second one
            # would be train.py's "second Ctrl-C: quit without saving".
            signal.signal(sig, signal.SIG_IGN)
        else:
            signal.signal(sig, forward)
    _, status = os.waitpid(pid, 0)
    if tty is not None:
        _give_terminal(tty, os.getpgrp())  # the terminal back to make's group before make prints anything
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
